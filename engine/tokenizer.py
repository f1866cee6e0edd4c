"""Tokenizer loading, prompt encoding, the chat template and end-of-sequence ids.

One place for these so the router (which tokenizes every request once, docs/architecture.md, A
request's path) and the offline ``LLM`` encode the same text to the same token ids. The
tokenizer itself is transformers' (``AutoTokenizer``), read from the checkpoint folder only,
never from the hub (``engine/hub.py`` downloads a hub id's files first).
"""

from __future__ import annotations

import inspect
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# A role is inserted between header tokens by the template: keep it a plain word.
_ROLE_PATTERN = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _gguf_file(path: Path) -> Path | None:
    """The GGUF file ``path`` names: itself, or a folder's one ``.gguf`` when the folder has
    no tokenizer files of its own."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not any((path / n).is_file() for n in TOKENIZER_FILES):
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    return None


def has_tokenizer(model_path: str | os.PathLike) -> bool:
    """Whether the local model carries a tokenizer: a folder's tokenizer files, or a GGUF
    file's ``tokenizer.ggml.*`` metadata (checkpoints written by ``save_pretrained`` on a
    bare model have none: they take token ids only)."""
    path = Path(model_path)
    gguf = _gguf_file(path)
    if gguf is not None:
        from gguf import GGUFReader

        return "tokenizer.ggml.tokens" in GGUFReader(str(gguf)).fields
    return any((path / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(model_path: str | os.PathLike, *, trust_remote_code: bool = False,
                   chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """Load the tokenizer of the local model ``model_path``: a folder of tokenizer files
    (a checkpoint's, or ``--tokenizer``'s), or a ``.gguf`` file (or a folder holding
    one), whose metadata transformers builds the tokenizer from.

    Goes through ``transformers.AutoTokenizer.from_pretrained(..., local_files_only=True)``,
    so ``tokenizer.json``, ``tokenizer_config.json`` (with its chat template) and
    ``chat_template.jinja`` are read as transformers reads them; nothing is downloaded.

    Args:
        model_path: a folder holding the tokenizer files, or a GGUF file.
        trust_remote_code: allow a tokenizer class defined in the checkpoint's own Python
            files (``auto_map``); off by default because it runs that code.
        chat_template: a Jinja chat template replacing the tokenizer's own
            (``read_chat_template`` reads ``--chat-template``).

    Raises:
        FileNotFoundError: ``model_path`` does not exist.
        OSError, ValueError: transformers cannot find or parse the tokenizer files.
    """
    from transformers import AutoTokenizer

    path = Path(model_path)
    gguf = _gguf_file(path)
    if gguf is not None:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                  local_files_only=True)
    elif path.is_dir():
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True,
                                                  trust_remote_code=trust_remote_code)
    else:
        raise FileNotFoundError(f"tokenizer folder {path} does not exist")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


_JINJA_CHARS = "{}\n"


def read_chat_template(value: str | None) -> str | None:
    """The chat template ``--chat-template`` gives, as vLLM reads it: the text of the file
    it names, or the value itself when it is no file and looks like a template (holds
    ``{``, ``}`` or a newline). None stays None (the tokenizer's own template).

    Raises:
        ValueError: ``value`` looks like a path (no template characters) but cannot be
            read, naming ``--chat-template``.
    """
    if value is None:
        return None
    try:
        return Path(value).read_text(encoding="utf-8")
    except (OSError, ValueError) as e:
        if any(c in value for c in _JINJA_CHARS):
            return value
        raise ValueError(f"--chat-template {value!r} looks like a file path, but it cannot "
                         f"be read: {e}") from e


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str,
                  add_special_tokens: bool = True) -> list[int]:
    """Token ids of a completion prompt, with the tokenizer's own special tokens added
    (unless ``add_special_tokens`` is false, vLLM's request field of that name).

    For Llama-style tokenizers (the demo model's included) that is a leading BOS. Special
    tokens written in ``prompt`` (``<|eot_id|>``) are encoded as special tokens, as in
    vLLM's completions API.

    Raises:
        TypeError: ``prompt`` is not a string.
    """
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, not {type(prompt).__name__}")
    return list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))


def bad_word_sequences(tokenizer: PreTrainedTokenizerBase, words: Sequence[str]
                       ) -> list[list[int]]:
    """vLLM's ``bad_words`` as token sequences for ``SamplingParams.bad_words_token_ids``:
    each word (leading spaces stripped) as it is tokenized at a text's start, and, where
    the tokenizer spells it differently after a space with as many tokens (a new first
    token), that spelling too. Empty words are left out."""
    sequences: list[list[int]] = []
    for word in words:
        bare = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not bare:
            continue
        sequences.append(bare)
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            sequences.append(spaced)
    return sequences


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict], *,
                        add_generation_prompt: bool = True, tools: list[dict] | None = None,
                        template_kwargs: Mapping[str, Any] | None = None,
                        continue_final_message: bool = False,
                        documents: list[dict] | None = None,
                        chat_template: str | None = None) -> list[int]:
    """Token ids of a chat rendered with the checkpoint's chat template.

    ``messages`` is OpenAI-shaped: ``[{"role": "system" | "user" | "assistant" | "tool" |
    ..., "content": str}, ...]``; an assistant message with ``tool_calls`` (arguments as
    dicts) may have ``content`` None. ``tools`` (OpenAI's ``[{"type": "function",
    "function": {...}}]``) reach the template as transformers passes them, and
    ``template_kwargs`` as extra template variables (vLLM's ``chat_template_kwargs``), and
    ``documents`` (``[{"title": ..., "text": ...}]``, for retrieval-augmented templates)
    as transformers passes them. ``chat_template`` replaces the tokenizer's template for
    this call.
    The template writes BOS and the turn markers itself, so no special tokens are added on
    top. With ``add_generation_prompt`` the ids end with the assistant's header, ready for
    the model to answer; with ``continue_final_message`` (transformers' and vLLM's
    option) they end inside the last message, without its end-of-turn, so the model goes
    on writing it (exclusive with ``add_generation_prompt``). Where transformers supports
    it (5.x), special tokens typed inside message contents are encoded as plain text, so
    a user cannot end their turn early by writing ``<|eot_id|>``.

    Raises:
        ValueError: the tokenizer has no chat template; ``messages`` is not a non-empty list
            of dicts, each with a word-like ``role`` and a str ``content``; or the template
            rejects the conversation (a Jinja ``raise_exception`` or error, an error its
            expressions raise on the messages, such as a str plus an int, or, with
            ``continue_final_message``, a last message it does not write out as given).
    """
    _check_messages(messages)
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        name = getattr(tokenizer, "name_or_path", "") or "this tokenizer"
        raise ValueError(f"{name} has no chat template (tokenizer_config.json 'chat_template' "
                         "or chat_template.jinja); send a completion prompt instead")
    kwargs: dict[str, Any] = dict(template_kwargs or {})
    if continue_final_message:
        kwargs["continue_final_message"] = True
    if tools:
        kwargs["tools"] = tools
    if documents:
        kwargs["documents"] = documents
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    if "sanitize_control_tokens" in inspect.signature(tokenizer.apply_chat_template).parameters:
        kwargs["sanitize_control_tokens"] = True
    from jinja2 import TemplateError

    try:
        ids = tokenizer.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
            tokenize=True, return_dict=False, **kwargs)
    except TemplateError as e:
        raise ValueError(f"the chat template rejected the messages: {e}") from e
    except (TypeError, LookupError, ArithmeticError, RecursionError) as e:
        # NOTE: what a template's own expressions raise on data they do not expect (a
        # str plus an int, a missing key, 1 / 0, a macro calling itself), not Jinja's kinds
        raise ValueError(f"the chat template failed on the messages: "
                         f"{type(e).__name__}: {e}") from e
    return [int(i) for i in ids]


def _check_messages(messages: Any) -> None:
    # NOTE: ValueError even for wrong types: a malformed chat is bad request data, which
    # callers (the router answers 400) catch as ValueError.
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(  # noqa: TRY004
                f"messages[{i}] must be a dict, not {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not _ROLE_PATTERN.fullmatch(role):
            raise ValueError(f"messages[{i}]['role'] must be a word such as 'user', got {role!r}")
        if content is None and role == "assistant" and message.get("tool_calls"):
            continue
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}]['content'] must be a str, "  # noqa: TRY004
                             f"not {type(content).__name__}")


def eos_token_ids(model_path: str | os.PathLike,
                  tokenizer: PreTrainedTokenizerBase | None = None,
                  generation_config: str = "auto") -> set[int]:
    """The ids that end a sequence: the model's ``eos_token_id`` and the tokenizer's.

    The model's come from the ``generation_config.json`` that ``--generation-config``
    names (``engine.generation_config.generation_config_file``: the model's own for
    ``auto``, none for ``vllm``, a folder's), an int or a list, as Llama 3 lists
    ``<|end_of_text|>`` and ``<|eot_id|>``; from ``config.json`` when there is no such
    file, which is transformers' own fallback. A GGUF file's come with its tokenizer. A
    missing or null value adds nothing; the result may be empty.

    Raises:
        ValueError: a config file is not valid JSON, or its ``eos_token_id`` is not an int
            or a list of ints (each >= 0); a bad ``generation_config`` mode.
    """
    from pdserve.engine.generation_config import generation_config_file

    path = Path(model_path)
    ids: set[int] = set()
    for file in (generation_config_file(path, generation_config), path / "config.json"):
        if file is not None and file.is_file():
            ids |= _eos_ids_from_config(file)
            break
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if eos is not None:
        ids.add(int(eos))
    return ids


def _eos_ids_from_config(file: Path) -> set[int]:
    try:
        value = json.loads(file.read_text(encoding="utf-8")).get("eos_token_id")
    except (ValueError, AttributeError) as e:
        raise ValueError(f"{file} is not a JSON object: {e}") from e
    if value is None:
        return set()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{file}: eos_token_id must be an int or a list of ints, got {value!r}")
    return set(values)
