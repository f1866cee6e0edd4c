"""The demo model: a small random-weight Llama checkpoint with a real byte-level BPE tokenizer.

``pdserve serve`` and ``pdserve generate`` use it when no ``--model`` is given (docs/architecture.md,
Launch), and tests use it wherever a real tokenizer matters. The folder has the layout of a
Hugging Face hub checkpoint, so transformers loads it as it loads any Llama 3 model::

    config.json  generation_config.json  model.safetensors      (transformers' save_pretrained)
    tokenizer.json  tokenizer_config.json  special_tokens_map.json
    pdserve_demo_model.json                                      (format version, seed)

Every file is the same byte for byte on every run with the same ``seed`` (and the same torch
and transformers versions, which write the weights and ``config.json``): the weights come from
transformers' own init under a fixed seed, and the tokenizer from ``tokenizers``' BPE trainer on
the corpus shipped in ``engine/data/demo_corpus.txt``, which is deterministic (its merges are
ordered by count, ties broken by pair ids, the alphabet sorted).

The weights are float32: random weights give nearly flat logits, so bfloat16 rounding would
flip greedy near-ties between two implementations, and the demo model is what compares pdserve
with transformers token for token. ``--dtype bfloat16`` still runs it in bfloat16.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from importlib import resources
from pathlib import Path

import torch

# Bump when the files change, so caches written by an older pdserve are rebuilt.
DEMO_MODEL_FORMAT_VERSION = 2
MANIFEST_FILE = "pdserve_demo_model.json"

VOCAB_SIZE = 2048
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
EOT_TOKEN = "<|eot_id|>"
# Llama 3's order, placed after the learned tokens as in Llama 3.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, "<|start_header_id|>", "<|end_header_id|>", EOT_TOKEN)

MODEL_SIZES = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
               "num_attention_heads": 8, "num_key_value_heads": 4,
               "max_position_embeddings": 2048}

# Llama 3's pre-tokenizer split: contractions, words with one leading non-letter, digits in
# runs of at most three, punctuation runs, newlines, other whitespace.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Llama 3 style; content is trimmed as Llama 3's template does, but for the assistant's:
# a reply sent back is the text the model wrote, so its KV is reused (router/history.py).
# With tools (Llama 3.1's
# JSON tool calling, read by the llama3_json parser): a system turn lists them; an
# assistant's calls are written as {"name": ..., "parameters": ...} joined by "; "; a tool's
# result is an "ipython" turn. Without tools a chat renders as it always did.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'To call a function, answer with only {\"name\": function name, \"parameters\": "
    "its arguments as a JSON object}. The functions:\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] is defined "
    "and message['tool_calls'] %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if not loop.first %}{{- '; ' }}{%- endif %}"
    "{{- {'name': call['function']['name'], 'parameters': call['function']['arguments']}"
    " | tojson }}"
    "{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + ('ipython' if message['role'] == 'tool' else message['role'])"
    " + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] if message['role'] == 'assistant' else message['content'] | trim }}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

# NOTE: transformers initialises weights from torch's global generator; this lock keeps two
# threads of this process from interleaving their seeded draws.
_SEEDED_INIT_LOCK = threading.Lock()


def default_demo_model_path() -> Path:
    """Where ``ensure_demo_model`` keeps the demo model: ``$PDSERVE_CACHE_DIR/demo-model``,
    or ``~/.cache/pdserve/demo-model`` when that variable is unset or empty."""
    cache_dir = os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve"
    return Path(cache_dir).expanduser() / "demo-model"


def ensure_demo_model(path: str | os.PathLike | None = None) -> Path:
    """Return the demo model's folder, writing it first if it is missing or stale.

    ``path`` defaults to ``default_demo_model_path()``. Safe when processes race: each writes
    its own temporary copy and the first rename wins; the others use the winner's. A demo
    model of another format version (from an older pdserve) is replaced; any other non-empty
    folder is left alone.

    Raises:
        FileExistsError: ``path`` is a non-empty folder (or a file) that is no demo model.
        OSError: the folder cannot be written.
    """
    path = Path(path) if path is not None else default_demo_model_path()
    if is_demo_model(path):
        return path
    try:
        return make_demo_model(path, overwrite=(path / MANIFEST_FILE).is_file())
    except FileExistsError:
        if is_demo_model(path):  # another process finished first
            return path
        raise FileExistsError(f"{path} exists and is not a pdserve demo model; remove it or "
                              "point PDSERVE_CACHE_DIR elsewhere") from None


def is_demo_model(path: str | os.PathLike) -> bool:
    """True when ``path`` holds a complete demo model of the current format version."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    required = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return (isinstance(manifest, dict)
            and manifest.get("format_version") == DEMO_MODEL_FORMAT_VERSION
            and all((path / name).is_file() for name in required))


def make_demo_model(path: str | os.PathLike, *, seed: int = 0, overwrite: bool = False) -> Path:
    """Write the demo checkpoint into the folder ``path`` and return it (as a ``Path``).

    The files are written into a temporary folder beside ``path`` and renamed into place, so
    ``path`` never holds a half-written model. An existing empty folder is replaced silently.
    With ``overwrite`` an existing model is swapped out (the old folder is renamed away, the
    new one renamed in, the old one deleted), so ``path`` is briefly absent.

    Args:
        path: the output folder; its parents are created.
        seed: the torch seed for the random weights (the tokenizer does not depend on it).
        overwrite: replace a non-empty ``path``.

    Raises:
        FileExistsError: ``path`` exists, is not an empty folder, and ``overwrite`` is false.
        OSError: the files cannot be written.
    """
    path = Path(path)
    if path.exists() and not overwrite and not _is_empty_dir(path):
        raise FileExistsError(f"{path} already exists; pass overwrite=True (pdserve "
                              "make-demo-model --overwrite) to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        _write_demo_files(tmp, seed)
        # NOTE: mkdtemp (and transformers, for the weights) make private files; the model is
        # meant to be read by other users and containers too.
        os.chmod(tmp, 0o755)
        for file in tmp.iterdir():
            os.chmod(file, 0o644)
        _publish(tmp, path, overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def _publish(tmp: Path, path: Path, overwrite: bool) -> None:
    """Rename the finished folder ``tmp`` to ``path`` (replacing it when ``overwrite``)."""
    try:
        os.rename(tmp, path)  # replaces an empty folder, fails on a non-empty one
        return
    except OSError:
        if not path.exists():
            raise
        if not overwrite and not _is_empty_dir(path):
            raise FileExistsError(f"{path} appeared while the demo model was being written"
                                  ) from None
    old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
    try:
        os.rename(path, old / path.name)
        try:
            os.rename(tmp, path)
        except OSError:
            os.rename(old / path.name, path)  # put the old one back
            raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


def _write_demo_files(out_dir: Path, seed: int) -> None:
    tokenizer = train_demo_tokenizer()
    special_ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    _write_model(out_dir, seed, special_ids)
    _write_tokenizer(out_dir, tokenizer)
    manifest = {"format_version": DEMO_MODEL_FORMAT_VERSION, "seed": seed}
    _write_json(out_dir / MANIFEST_FILE, manifest)


def _write_json(path: Path, obj: dict) -> None:
    text = json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    path.write_text(text, encoding="utf-8")


def read_demo_corpus() -> str:
    """The shipped tokenizer corpus, ``engine/data/demo_corpus.txt`` (``\\n`` line ends)."""
    corpus = resources.files("pdserve.engine").joinpath("data", "demo_corpus.txt")
    return corpus.read_text(encoding="utf-8")


def train_demo_tokenizer(vocab_size: int = VOCAB_SIZE):
    """Train the demo's byte-level BPE on the shipped corpus; returns a ``tokenizers.Tokenizer``.

    The 256 byte symbols and the learned merges (each pair seen at least twice) fill
    ``vocab_size - len(SPECIAL_TOKENS)`` ids, the special tokens the last ids; should the
    corpus ever yield fewer merges, ``<|reserved_special_token_N|>`` tokens (as in Llama 3)
    fill the gap, so the vocabulary always has exactly ``vocab_size`` ids. Encoding adds BOS.
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS), min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(read_demo_corpus().splitlines(keepends=True), trainer)
    specials = list(SPECIAL_TOKENS)
    num_reserved = vocab_size - tokenizer.get_vocab_size() - len(specials)
    specials += [f"<|reserved_special_token_{i}|>" for i in range(num_reserved)]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)])
    assert tokenizer.get_vocab_size() == vocab_size, tokenizer.get_vocab_size()
    return tokenizer


def _write_tokenizer(out_dir: Path, tokenizer) -> None:
    """``tokenizer.json`` + the configs transformers (4.51+ and 5) and other tools read."""
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=True)
    special_tokens_map = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}
    _write_json(out_dir / "special_tokens_map.json", special_tokens_map)
    _write_json(out_dir / "tokenizer_config.json", {
        **special_tokens_map,
        # NOTE: the BOS comes from tokenizer.json's post-processor; these say the same thing
        # for readers that rebuild it from the flags.
        "add_bos_token": True,
        "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
        # NOTE: the cleanup would turn " ." into "." and break decode(encode(text)) == text.
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": MODEL_SIZES["max_position_embeddings"],
        # NOTE: a plain tokenizers-backed class; "LlamaTokenizer" would make transformers 5
        # rebuild a SentencePiece-style pipeline instead of loading tokenizer.json as it is.
        "tokenizer_class": "PreTrainedTokenizerFast",
    })


def _write_model(out_dir: Path, seed: int, special_ids: dict[str, int]) -> None:
    """``config.json``, ``generation_config.json`` and ``model.safetensors`` via transformers."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **MODEL_SIZES, vocab_size=VOCAB_SIZE, rope_theta=10000.0, rms_norm_eps=1e-5,
        hidden_act="silu", tie_word_embeddings=False, dtype="float32",
        bos_token_id=special_ids[BOS_TOKEN], eos_token_id=special_ids[EOS_TOKEN])
    with _SEEDED_INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=special_ids[BOS_TOKEN],
        eos_token_id=[special_ids[EOS_TOKEN], special_ids[EOT_TOKEN]])
    model.save_pretrained(out_dir)  # safetensors: the default in transformers 4.35+ and 5
