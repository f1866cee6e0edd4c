"""The demo model: a real checkpoint transformers loads and runs, written the same byte for
byte every time, with a round-tripping byte-level BPE tokenizer, BOS on encode, a Llama 3
style chat template and both end ids; and the helpers of ``pdserve.engine.tokenizer``."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.engine import demo_model
from pdserve.engine.demo_model import (
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    default_demo_model_path,
    ensure_demo_model,
    is_demo_model,
    make_demo_model,
)
from pdserve.engine.tokenizer import (
    apply_chat_template,
    encode_prompt,
    eos_token_ids,
    load_tokenizer,
)

ROUND_TRIP_TEXTS = [
    "héllo 世界 🙂",
    "The KV cache holds 131072 bytes per token.",
    "  two leading spaces, a tab\tand\n\nblank lines \n",
    "def f(x):\n    return x ** 2  # squared\n",
    "Привет, naïve café — 東京 🚀🚀",
    "",
    " ",
]
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a KV cache?"}]
ASSISTANT_HEADER = "<|start_header_id|>assistant<|end_header_id|>\n\n"


@pytest.fixture(scope="module")
def demo_path(tmp_path_factory) -> Path:
    return make_demo_model(tmp_path_factory.mktemp("demo") / "demo-model")


@pytest.fixture(scope="module")
def tokenizer(demo_path):
    return load_tokenizer(demo_path)


def test_config_is_a_small_gqa_llama_whose_vocab_matches_the_tokenizer(demo_path, tokenizer):
    config = json.loads((demo_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (
        256, 4, 512)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (8, 4)
    assert config["max_position_embeddings"] == 2048
    assert config["dtype"] == "float32"
    assert config["tie_word_embeddings"] is False
    assert config["vocab_size"] == len(tokenizer) == VOCAB_SIZE
    # the named special tokens take the last ids, in Llama 3's order; nothing is reserved
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(
        range(VOCAB_SIZE - len(SPECIAL_TOKENS), VOCAB_SIZE))
    assert "<|reserved_special_token_0|>" not in tokenizer.get_vocab()


def test_transformers_loads_and_generates(demo_path):
    model = AutoModelForCausalLM.from_pretrained(demo_path, local_files_only=True).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(demo_path, local_files_only=True)
    assert model.dtype == torch.float32
    ids = torch.tensor([encode_prompt(hf_tokenizer, "Paged attention splits the cache")])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=8, min_new_tokens=8)
    new_tokens = out[0, ids.shape[1]:]
    assert new_tokens.shape == (8,)
    assert 0 <= int(new_tokens.min()) and int(new_tokens.max()) < VOCAB_SIZE
    assert isinstance(hf_tokenizer.decode(new_tokens), str)


def test_pdserve_engine_generates_what_transformers_does(demo_path):
    from pdserve.engine import LLM, SamplingParams

    prompt = "The router sends the prompt to"
    llm = LLM(str(demo_path), dtype="float32", max_model_len=256, load_progress=False)
    output = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8,
                                                   ignore_eos=True))[0].outputs[0]
    model = AutoModelForCausalLM.from_pretrained(demo_path, local_files_only=True).eval()
    ids = torch.tensor([encode_prompt(llm.get_tokenizer(), prompt)])
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=8, min_new_tokens=8)[0, ids.shape[1]:].tolist()
    assert output.token_ids == expected


def test_two_writes_are_identical_byte_for_byte(demo_path, tmp_path):
    again = make_demo_model(tmp_path / "again")
    names = sorted(p.name for p in demo_path.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json"} <= set(names)
    for name in names:
        assert (demo_path / name).read_bytes() == (again / name).read_bytes(), name


def test_another_seed_gives_other_weights_and_the_same_tokenizer(demo_path, tmp_path):
    other = make_demo_model(tmp_path / "seed1", seed=1)
    assert (other / "model.safetensors").read_bytes() != (
        demo_path / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (demo_path / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips_text(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert tokenizer.decode(encode_prompt(tokenizer, text), skip_special_tokens=True) == text


def test_encode_adds_one_bos(tokenizer):
    ids = encode_prompt(tokenizer, "Hello, world")
    assert ids[0] == tokenizer.bos_token_id == tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
    assert ids.count(tokenizer.bos_token_id) == 1
    assert ids[1:] == tokenizer.encode("Hello, world", add_special_tokens=False)
    with pytest.raises(TypeError):
        encode_prompt(tokenizer, ["Hello"])


def test_chat_template_renders_llama3_turns(tokenizer):
    ids = apply_chat_template(tokenizer, CHAT)
    assert tokenizer.decode(ids) == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is a KV cache?<|eot_id|>"
        + ASSISTANT_HEADER)
    header = tokenizer.encode(ASSISTANT_HEADER, add_special_tokens=False)
    assert ids[-len(header):] == header
    assert ids.count(tokenizer.bos_token_id) == 1

    without = apply_chat_template(tokenizer, CHAT, add_generation_prompt=False)
    assert without == ids[:-len(header)]
    assert without[-1] == tokenizer.convert_tokens_to_ids("<|eot_id|>")


def test_special_tokens_typed_by_a_user_are_plain_text(tokenizer):
    import inspect

    if "sanitize_control_tokens" not in inspect.signature(
            tokenizer.apply_chat_template).parameters:
        pytest.skip("this transformers cannot encode control tokens in messages as text")
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    ids = apply_chat_template(tokenizer, [{"role": "user", "content": "hi<|eot_id|>"}])
    assert ids.count(eot) == 1  # the template's own, not the user's


@pytest.mark.parametrize("messages", [
    [],
    "hello",
    [{"role": "user"}],
    [{"content": "hi"}],
    [{"role": "user", "content": None}],
    [{"role": "user", "content": ["hi"]}],
    [{"role": "user<|eot_id|>", "content": "hi"}],
    ["hi"],
])
def test_malformed_messages_are_value_errors(tokenizer, messages):
    with pytest.raises(ValueError, match="messages"):
        apply_chat_template(tokenizer, messages)


def test_no_chat_template_is_a_value_error(demo_path):
    tokenizer = load_tokenizer(demo_path)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(tokenizer, CHAT)


def test_load_tokenizer_of_a_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing")


def test_eos_token_ids_are_end_of_text_and_eot(demo_path, tokenizer):
    expected = {tokenizer.convert_tokens_to_ids(t) for t in ("<|end_of_text|>", "<|eot_id|>")}
    assert eos_token_ids(demo_path, tokenizer) == expected
    assert tokenizer.eos_token_id in expected


@pytest.mark.parametrize(("files", "expected"), [
    ({"generation_config.json": {"eos_token_id": 7}, "config.json": {"eos_token_id": 9}}, {7, 3}),
    ({"generation_config.json": {"eos_token_id": None}}, {3}),
    ({"config.json": {"eos_token_id": [5, 6]}}, {5, 6, 3}),
    ({}, {3}),
])
def test_eos_token_ids_sources(tmp_path, files, expected):
    class Tokenizer:
        eos_token_id = 3

    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    assert eos_token_ids(tmp_path, Tokenizer()) == expected


@pytest.mark.parametrize("content", ['{"eos_token_id": "2"}', '{"eos_token_id": [1, -1]}',
                                     "not json", "[1]"])
def test_eos_token_ids_rejects_bad_configs(tmp_path, content):
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ValueError):
        eos_token_ids(tmp_path, None)


def test_make_demo_model_refuses_a_non_empty_folder_unless_overwrite(demo_path, tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        make_demo_model(target)
    assert make_demo_model(target, overwrite=True) == target
    assert is_demo_model(target) and not (target / "notes.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temporary folders left


def test_default_demo_model_path(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    assert default_demo_model_path() == tmp_path / "cache" / "demo-model"
    monkeypatch.delenv("PDSERVE_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_demo_model_path() == tmp_path / ".cache" / "pdserve" / "demo-model"


def test_ensure_demo_model_writes_once_even_when_threads_race(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    results = []
    threads = [threading.Thread(target=lambda: results.append(ensure_demo_model()))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [tmp_path / "demo-model"] * 2
    assert is_demo_model(results[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-model"]
    weights = results[0] / "model.safetensors"
    mtime_ns = weights.stat().st_mtime_ns
    assert ensure_demo_model() == results[0]
    assert weights.stat().st_mtime_ns == mtime_ns  # found, not rewritten


def test_ensure_demo_model_replaces_a_stale_one_but_not_a_stranger(tmp_path):
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / demo_model.MANIFEST_FILE).write_text('{"format_version": 0}')
    assert ensure_demo_model(stale) == stale and is_demo_model(stale)

    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="not a pdserve demo model"):
        ensure_demo_model(stranger)
    assert sorted(p.name for p in stranger.iterdir()) == ["config.json"]
