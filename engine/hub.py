"""``--model`` and ``--tokenizer`` as vLLM takes them: a local path, or a Hugging Face hub
id (``org/name``) that ``huggingface_hub`` downloads into its cache.

Resolution happens once per node, before any worker starts (``pdserve serve``; the
offline ``LLM`` resolves its own): the workers get the snapshot's local folder, never a
hub id, so N workers never download N times. ``huggingface_hub`` does the rest as
everywhere else: the cache is ``--download-dir`` or ``$HF_HOME/hub``; ``HF_HUB_OFFLINE=1``
resolves from the cache alone; the token comes from ``$HF_TOKEN`` or the file that
``hf auth login`` writes; each file shows a progress bar while it downloads.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

# What a checkpoint folder needs: configs, weights, tokenizer files, a chat template.
MODEL_FILES = ("*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.txt", "*.tiktoken")
TOKENIZER_FILES = ("*.json", "tokenizer.model", "*.jinja", "*.txt", "*.tiktoken")


class ModelNotFoundError(FileNotFoundError):
    """``--model`` (or ``--tokenizer``) is neither a local path nor a hub repository that
    can be had (not cached while offline, missing, gated, unreachable)."""


def looks_like_hub_id(name: str) -> bool:
    """Whether ``name`` has the form of a hub repository id (``name`` or ``org/name``, of
    letters, digits, ``-``, ``_``, ``.``), as ``huggingface_hub`` validates it."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def resolve_model(model: str, *, revision: str | None = None, download_dir: str | None = None,
                  patterns: tuple[str, ...] = MODEL_FILES, flag: str = "--model") -> str:
    """The local path of ``model``: itself when it exists here, else the folder of the
    hub repository ``model``'s snapshot at ``revision`` (a branch, tag or commit; default
    ``main``), downloaded into the cache unless it is there already.

    Only the files matching ``patterns`` are fetched (safetensors weights, configs and
    tokenizer files by default; ``*.bin`` and ``*.gguf`` files never).

    Raises:
        ModelNotFoundError: no such local path and not a hub id; or the repository or
            revision is not on the hub, gated without a token, unreachable, or not
            cached while ``HF_HUB_OFFLINE=1``. The message names ``flag`` and the cache.
    """
    local = Path(model).expanduser()
    if local.exists():
        return str(local)
    if not looks_like_hub_id(model):
        raise ModelNotFoundError(f"{flag} {model}: no such file or folder, and not a Hugging "
                                 "Face hub id (org/name)")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    cache = download_dir or constants.HF_HUB_CACHE
    logger.info("resolving %s %s (revision %s) in %s", flag, model, revision or "main", cache)
    try:
        path = snapshot_download(model, revision=revision, cache_dir=download_dir,
                                 allow_patterns=list(patterns))
    except LocalEntryNotFoundError as e:
        why = ("HF_HUB_OFFLINE=1 forbids downloading it" if constants.HF_HUB_OFFLINE
               else "the hub could not be reached")
        raise ModelNotFoundError(f"{flag} {model} (revision {revision or 'main'}) is not in "
                                 f"the Hugging Face cache {cache}, and {why}") from e
    except (HfHubHTTPError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelNotFoundError(f"{flag} {model} (revision {revision or 'main'}): {first}") from e
    return path


def resolve_tokenizer(tokenizer: str, *, revision: str | None = None,
                      download_dir: str | None = None) -> str:
    """``resolve_model`` for ``--tokenizer``: a local folder or GGUF file, or a hub id of
    which only the tokenizer's files are fetched.

    Raises: as ``resolve_model``, naming ``--tokenizer``.
    """
    return resolve_model(tokenizer, revision=revision, download_dir=download_dir,
                         patterns=TOKENIZER_FILES, flag="--tokenizer")


def is_local(path: str | os.PathLike) -> bool:
    """Whether ``path`` names an existing local file or folder."""
    return Path(path).expanduser().exists()

