"""Incremental detokenization and stop strings with real tokenizers: the demo model's
byte-level BPE and a Llama-2-style byte-fallback SentencePiece BPE built here."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pdserve.engine.demo_model import BOS_TOKEN, EOS_TOKEN, train_demo_tokenizer
from pdserve.router.detokenizer import IncrementalDetokenizer, StopChecker, fast_decoder

CORPUS = ["The KV cache holds keys and values for every token of the prompt.",
          "Paged attention reads the cache through a block table, one block at a time.",
          "Hello world! Prefill computes the prompt; decode streams the answer."] * 20
TEXT = "Hello 世界! naïve café 🙂👍🏽 — 日本語のテキスト and 🚀 done."


@pytest.fixture(scope="module")
def byte_bpe() -> PreTrainedTokenizerFast:
    """The demo model's byte-level BPE (Llama 3 style): CJK and emoji fall apart into
    several byte tokens."""
    return PreTrainedTokenizerFast(tokenizer_object=train_demo_tokenizer(), bos_token=BOS_TOKEN,
                                   eos_token=EOS_TOKEN, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def llama_style() -> PreTrainedTokenizerFast:
    """Llama-style: '▁' for spaces, <0xNN> byte fallback, a decoder that strips the first
    space of a decode (so context matters for the first output token)."""
    chars = sorted(set("".join(CORPUS).replace(" ", "")))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", *chars, "▁t", "he", "▁the", "▁a"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a")]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def word_level() -> PreTrainedTokenizerFast:
    """Whole words joined by spaces, with ``clean_up_tokenization_spaces``: ``decode``
    turns "world ," into "world," (transformers applies the clean-up to non-BPE models)."""
    words = ["[UNK]", "</s>", "hello", "world", ",", ".", "!", "'s", "n't", "it", "do"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>",
                                   clean_up_tokenization_spaces=True)


class DecodeOnly:
    """A tokenizer offering nothing but ``decode``: the detokenizer's general path."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def decode(self, token_ids, skip_special_tokens=False) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, token_ids: list[int], chunk_sizes=None) -> list[str]:
    """Feed ``token_ids`` in chunks (default one at a time); the deltas, flush included."""
    deltas, i = [], 0
    sizes = iter(chunk_sizes or [])
    while i < len(token_ids):
        n = next(sizes, 1)
        deltas.append(detok.add_tokens(token_ids[i:i + n]))
        i += n
    deltas.append(detok.flush())
    return deltas


def test_byte_level_split_characters_are_never_emitted_broken(byte_bpe):
    ids = encode(byte_bpe, TEXT)
    # The fixture really splits characters: some single tokens are partial UTF-8.
    assert any("\ufffd" in byte_bpe.decode([t]) for t in ids)
    deltas = stream(IncrementalDetokenizer(byte_bpe), ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == byte_bpe.decode(ids) == TEXT
    assert any("🚀" in d for d in deltas)  # the 4-byte emoji comes out whole, in one delta
    assert deltas.count("") >= 3  # tokens that completed no character emitted nothing


def test_chunked_input_gives_the_same_text(byte_bpe):
    ids = encode(byte_bpe, TEXT)
    rng = random.Random(0)
    for _ in range(5):
        sizes = [rng.randint(1, 4) for _ in ids]
        assert "".join(stream(IncrementalDetokenizer(byte_bpe), ids, sizes)) == TEXT


def test_prompt_context_does_not_leak_into_the_output(byte_bpe):
    prompt = encode(byte_bpe, "Question: 世界?")
    output = encode(byte_bpe, " 日本語 🙂!")
    detok = IncrementalDetokenizer(byte_bpe, prompt)
    assert "".join(stream(detok, output)) == byte_bpe.decode(output) == " 日本語 🙂!"
    assert detok.output_token_ids == output
    assert detok.output_text == " 日本語 🙂!"


def test_incomplete_tail_is_held_until_flush(byte_bpe):
    partial = encode(byte_bpe, "ok 🚀")[:-2]  # the rocket's last two bytes are missing
    assert byte_bpe.decode(partial) == "ok \ufffd"
    detok = IncrementalDetokenizer(byte_bpe)
    assert "".join(detok.add_tokens([t]) for t in partial) == "ok"
    assert detok.flush() == " \ufffd"
    assert detok.output_text == byte_bpe.decode(partial)


def test_skip_special_tokens(byte_bpe):
    ids = encode(byte_bpe, "Hello world") + [byte_bpe.eos_token_id]
    assert "".join(stream(IncrementalDetokenizer(byte_bpe), ids)) == "Hello world"
    kept = IncrementalDetokenizer(byte_bpe, skip_special_tokens=False)
    assert "".join(stream(kept, ids)) == "Hello world" + EOS_TOKEN


def test_llama_style_leading_space_comes_from_context(llama_style):
    prompt = llama_style.encode("the cache")
    output = llama_style.encode("the 世界 block 🙂", add_special_tokens=False)
    assert any(llama_style.convert_ids_to_tokens(t).startswith("<0x") for t in output)
    expected = llama_style.decode(prompt + output, skip_special_tokens=True)[
        len(llama_style.decode(prompt, skip_special_tokens=True)):]
    assert expected == " the 世界 block 🙂"  # the first token's space survives ...
    assert llama_style.decode(output) == "the 世界 block 🙂"  # ... which alone it loses
    deltas = stream(IncrementalDetokenizer(llama_style, prompt), output)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == expected


@pytest.mark.parametrize("name", ["byte_bpe", "llama_style", "word_level"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_backend_decode_gives_the_deltas_of_tokenizer_decode(request, name,
                                                             skip_special_tokens):
    tokenizer = request.getfixturevalue(name)
    text = "hello world , it 's ! do n't . " if name == "word_level" else TEXT
    ids = encode(tokenizer, text) + [tokenizer.eos_token_id] + encode(tokenizer, text)
    prompt = encode(tokenizer, text)[:7]

    def deltas(tok) -> list[str]:
        return stream(IncrementalDetokenizer(tok, prompt,
                                             skip_special_tokens=skip_special_tokens), ids)
    assert deltas(tokenizer) == deltas(DecodeOnly(tokenizer))
    decode = fast_decoder(tokenizer, skip_special_tokens)
    for size in (1, 2, 5):
        for start in range(len(ids) - size + 1):
            window = ids[start:start + size]
            assert decode(window) == tokenizer.decode(
                window, skip_special_tokens=skip_special_tokens)


def test_backend_decode_skips_the_python_wrapper(byte_bpe, word_level, monkeypatch):
    calls = []
    for tokenizer in (byte_bpe, word_level):
        decode = tokenizer.decode
        monkeypatch.setattr(tokenizer, "decode", lambda *a, decode=decode, **k:
                            calls.append(a) or decode(*a, **k))
    assert fast_decoder(byte_bpe, True)(encode(byte_bpe, TEXT)) == TEXT
    assert fast_decoder(word_level, True)(encode(word_level, "hello world")) == "hello world"
    assert calls == []
    # Where the clean-up changes the text, transformers' own decode decides.
    assert fast_decoder(word_level, True)(encode(word_level, "world !")) == "world!"
    assert len(calls) == 1


def run_stops(checker: StopChecker, deltas: list[str]) -> str:
    out = []
    for delta in deltas:
        result = checker.process(delta)
        out.append(result.text)
        if result.stopped:
            return "".join(out)
    return "".join(out) + checker.flush()


def test_stop_string_across_deltas_is_never_emitted_then_retracted():
    checker = StopChecker(["###"])
    assert checker.process("Hello #").text == "Hello "
    assert checker.held_text == "#"
    assert checker.process("# and").text == "## and"
    assert checker.process(" ##").text == " "
    result = checker.process("#!")
    assert (result.text, result.stopped, result.stop_str) == ("", True, "###")
    assert checker.process("more").text == ""


def test_held_partial_stop_is_released_at_the_end():
    checker = StopChecker(["END"])
    assert checker.process("the EN").text == "the "
    assert checker.flush() == "EN"


def test_include_stop_str_in_output_and_earliest_completion():
    assert run_stops(StopChecker(["world"], include_stop_str_in_output=True),
                     ["hello wor", "ld and more"]) == "hello world"
    # "b" completes before "abc" does, however the text is split.
    for deltas in (["xabc"], ["x", "a", "b", "c"], ["xa", "bc"]):
        checker = StopChecker(["abc", "b"])
        assert run_stops(checker, deltas) == "xa"
        assert checker.stop_str == "b"


def test_stop_string_split_across_tokens_of_real_text(byte_bpe):
    text = "Answer: 日本語のテキスト and more text"
    ids = encode(byte_bpe, text)
    detok, checker = IncrementalDetokenizer(byte_bpe), StopChecker(["のテ", "zzz"])
    emitted = run_stops(checker, [detok.add_tokens([t]) for t in ids])
    assert emitted == "Answer: 日本語"
    assert checker.stop_str == "のテ"


def test_stop_result_does_not_depend_on_how_text_is_split():
    text = "a ## b ### c #### d"
    rng = random.Random(1)
    for stops in (["###"], ["# c", "b #"], ["x"], ["## b", "#"]):
        bulk = run_stops(StopChecker(stops), [text])
        for _ in range(20):
            cuts = sorted(rng.sample(range(1, len(text)), 4))
            pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
            assert run_stops(StopChecker(stops), pieces) == bulk
    assert run_stops(StopChecker(["###"]), [text]) == "a ## b "


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="empty"):
        StopChecker(["ok", ""])
