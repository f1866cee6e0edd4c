"""Chat history tokenized as it was generated, so that the next turn reuses the reply's KV.

A chat client sends the assistant's reply back as text in the next turn. Re-encoding that
text often gives other token ids than the model generated (a tokenizer has many ways to
spell one text, and a model does not always pick the canonical one), and the block hashes
of the prompt then part from those the decode worker cached while it generated the reply:
the reply's KV is computed again. ``ReplyTokens`` remembers the token ids of recent replies
by their text, and ``splice`` puts them back where the chat template wrote that text.

A reply is put back only where the prompt holds exactly the canonical encoding of its
text, and only when those ids decode to the same text, so the prompt's text never changes:
only which of its spellings the model reads, the one it wrote itself.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence

MAX_REPLY_TOKENS = 8192  # longer replies are not remembered


def _key(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


def _find(haystack: Sequence[int], needle: Sequence[int], start: int) -> int:
    """The first index >= ``start`` where ``needle`` occurs in ``haystack``; -1 if none."""
    n = len(needle)
    first = needle[0]
    for i in range(start, len(haystack) - n + 1):
        if haystack[i] == first and list(haystack[i:i + n]) == list(needle):
            return i
    return -1


class ReplyTokens:
    """An LRU of ``text -> token ids`` for the last ``max_entries`` chat replies
    (thread-safe). ``tokenizer`` is the router's (Hugging Face) tokenizer."""

    def __init__(self, tokenizer, max_entries: int = 4096) -> None:
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()
        self.num_spliced = 0  # replies put back into prompts, for tests and metrics

    def _canonical(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def remember(self, text: str, token_ids: Sequence[int]) -> None:
        """Remember a finished reply: ``text`` as the client received it, ``token_ids`` as
        generated (a trailing stop token is dropped when the text lacks it). Skipped when
        the ids do not decode to the text (a stop string cut it) or are already the
        canonical encoding (nothing to put back)."""
        if not text or not token_ids or len(token_ids) > MAX_REPLY_TOKENS:
            return
        ids = list(token_ids)
        if len(ids) > 1 and self.tokenizer.decode(ids[:-1]) == text:
            ids = ids[:-1]  # the stop token, which the text leaves out
        elif self.tokenizer.decode(ids) != text:
            return
        if ids == self._canonical(text):
            return
        with self._lock:
            self._entries[_key(text)] = tuple(ids)
            self._entries.move_to_end(_key(text))
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def splice(self, prompt_ids: list[int], replies: Sequence[str]) -> list[int]:
        """``prompt_ids`` with each remembered reply among ``replies`` (the assistant
        messages' contents, in order) written as it was generated. A reply whose canonical
        encoding is not found after the previous one is left as it is."""
        found = []
        with self._lock:
            for text in replies:
                ids = self._entries.get(_key(text))
                if ids is not None:
                    self._entries.move_to_end(_key(text))
                found.append(ids)
        if not any(found):
            return prompt_ids
        out, pos = list(prompt_ids), 0
        for text, ids in zip(replies, found, strict=True):
            if ids is None:
                continue
            canonical = self._canonical(text)
            at = _find(out, canonical, pos)
            if at < 0:
                continue
            out[at:at + len(canonical)] = ids
            pos = at + len(ids)
            self.num_spliced += 1
        return out
