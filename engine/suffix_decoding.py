"""SuffixDecoding's proposals (Oliaro et al. 2024, https://arxiv.org/abs/2411.04975):
continuations of the request's latest tokens, found in its own prompt and output and in
the outputs of recent requests, chosen by how often each continuation followed.
The tree's depth bounds a match and its continuation together, so matches are at most
``max_tree_depth - k`` tokens long.

Each sequence is indexed in a trie of its substrings up to ``max_tree_depth`` tokens long
(a suffix tree cut at that depth), with a count on every node: how many times that
substring occurred. To propose, the longest suffix of the request's tokens (at most
``max_tree_depth - 1``) that occurs is matched; from its node the most frequent next
token is taken while its frequency among the node's continuations is at least
``min_token_prob``, for at most ``max_spec_factor`` times the match's length (and ``k``)
tokens. Two indexes are searched: the request's own (its prompt, then each output token
as it is appended) and a global one over the last ``max_cached_requests`` finished
requests' prompts and outputs (an agent loop's requests repeat each other); the proposal
whose expected number of accepted tokens (the sum of its running probability products) is
larger wins.

Worked example (depth 4): the request's tokens ``a b c a b`` index ``a``, ``a b``,
``a b c``, ... with ``a b`` counted twice; its latest tokens ``a b`` match with ``c``
following once (probability 1), then ``a``: proposals ``c a``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0


class SuffixIndex:
    """The substrings of some token sequences, up to ``depth`` tokens, with counts.

    ``extend(seq_id, tokens)`` appends to a sequence (O(depth) per token),
    ``remove(seq_id)`` takes a whole sequence out, ``match(context)`` finds the node of
    the longest suffix of ``context`` that occurs.
    """

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node()
        # per sequence: its tokens, and the nodes of its substrings still growing (those
        # starting at its last depth - 1 positions)
        self._sequences: dict[object, list[int]] = {}
        self._open: dict[object, list[_Node]] = {}

    def extend(self, seq_id: object, tokens: list[int]) -> None:
        """Append ``tokens`` to sequence ``seq_id`` (a new one if unseen)."""
        stored = self._sequences.setdefault(seq_id, [])
        open_nodes = self._open.setdefault(seq_id, [])
        for token in tokens:
            stored.append(token)
            grown = []
            for node in [*open_nodes, self.root]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += 1
                grown.append(child)
            # NOTE: a substring that reached depth tokens grows no further
            self._open[seq_id] = open_nodes = grown[-(self.depth - 1):] if self.depth > 1 else []

    def remove(self, seq_id: object) -> None:
        """Take sequence ``seq_id`` out: every count it added is taken back."""
        tokens = self._sequences.pop(seq_id, None)
        self._open.pop(seq_id, None)
        if tokens is None:
            return
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start:start + self.depth]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    del node.children[token]
                    break
                node = child

    def match(self, context: list[int], max_length: int | None = None
              ) -> tuple[_Node | None, int]:
        """The node of the longest suffix of ``context`` (at most ``max_length`` tokens,
        and ``depth - 1``, so a continuation can follow) that occurs, and its length;
        ``(None, 0)`` if none does."""
        longest = min(len(context), self.depth - 1, max_length or self.depth)
        for length in range(longest, 0, -1):
            node = self.root
            for token in context[len(context) - length:]:
                node = node.children.get(token)
                if node is None:
                    break
            else:
                return node, length
        return None, 0


def _continue(node: _Node, limit: int, min_prob: float) -> tuple[list[int], float]:
    """The most frequent path from ``node``, while each step's frequency is at least
    ``min_prob``, up to ``limit`` tokens; with its score (the sum of the running products
    of those frequencies: the expected number of them accepted)."""
    tokens, prob, score = [], 1.0, 0.0
    while len(tokens) < limit and node.children:
        total = sum(child.count for child in node.children.values())
        token, child = max(node.children.items(), key=lambda item: item[1].count)
        step = child.count / total
        if step < min_prob:
            break
        prob *= step
        score += prob
        tokens.append(token)
        node = child
    return tokens, score


@dataclass(frozen=True, slots=True)
class SuffixSettings:
    """vLLM's ``suffix_decoding_*`` keys: ``max_tree_depth`` (tokens indexed per
    substring; matches are one shorter), ``max_cached_requests`` (finished requests in
    the global index; 0: none), ``max_spec_factor`` (proposals per matched token),
    ``min_token_prob`` (the least frequency a proposed token may have)."""

    max_tree_depth: int = 24
    max_cached_requests: int = 10000
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1


class SuffixProposer:
    """Per-request and global suffix indexes, kept as requests run and finish (call from
    the engine thread only)."""

    def __init__(self, settings: SuffixSettings) -> None:
        self.settings = settings
        self.global_index = SuffixIndex(settings.max_tree_depth)
        self._cached: OrderedDict[str, None] = OrderedDict()  # finished requests, oldest first
        self._local: dict[str, SuffixIndex] = {}
        self._indexed: dict[str, int] = {}  # tokens of each running request indexed

    def propose(self, request_id: str, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` proposals after ``tokens`` (the request's prompt and output)."""
        local = self._local.get(request_id)
        if local is None:
            local = self._local[request_id] = SuffixIndex(self.settings.max_tree_depth)
            self._indexed[request_id] = 0
        done = self._indexed[request_id]
        # NOTE: the latest token is not indexed yet when matched, so the match is an
        # earlier occurrence, whose continuation is known
        if len(tokens) - 1 > done:
            local.extend(request_id, tokens[done:len(tokens) - 1])
            self._indexed[request_id] = len(tokens) - 1
        best, best_score = [], 0.0
        # NOTE: a substring holds at most max_tree_depth tokens, match and continuation
        # together: a match of depth - k leaves room for k
        max_match = max(1, self.settings.max_tree_depth - k)
        for index in (local, self.global_index):
            node, length = index.match(tokens, max_match)
            if node is None:
                continue
            limit = min(k, max(1, int(self.settings.max_spec_factor * length)))
            proposal, score = _continue(node, limit, self.settings.min_token_prob)
            if score > best_score:
                best, best_score = proposal, score
        return best

    def finish(self, request_id: str, tokens: list[int]) -> None:
        """A request ended: drop its own index, and put its tokens in the global one
        (the oldest cached request leaves past ``max_cached_requests``)."""
        self._local.pop(request_id, None)
        self._indexed.pop(request_id, None)
        if not tokens or self.settings.max_cached_requests == 0 or request_id in self._cached:
            return
        self.global_index.extend(request_id, tokens)
        self._cached[request_id] = None
        while len(self._cached) > self.settings.max_cached_requests:
            oldest, _ = self._cached.popitem(last=False)
            self.global_index.remove(oldest)
