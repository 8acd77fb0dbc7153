"""A model-free draft proposer over every sequence it has seen, from all requests.

In the spirit of SuffixDecoding (Oliaro et al., "SuffixDecoding: Extreme Speculative Decoding
for Emerging AI Applications", 2024, arXiv:2411.04975): one index holds the prompts and outputs
of every request the proposer has been shown, so structure that repeats across requests (an
agent's tool calls, a fixed output format) becomes draft tokens for the next request that
reaches the same context.

The index is a trie over *reversed contexts*. Every position ``p >= min_match`` of an indexed
sequence is an event: its context is the ``min(p, max_match)`` tokens before it, read backwards,
and its outcome is the token at ``p``. A node at depth ``d`` stands for one context of ``d``
tokens and counts, per next token, how many events below it have that outcome (and when the
latest of them was indexed). A node that only one event reaches stays an unexpanded leaf that
points into that event's sequence, so text that never repeats costs one leaf per token rather
than ``max_match`` nodes.

A proposal greedily extends the request: find the longest suffix of its tokens (the draft so far
included) of at least ``min_match`` and at most ``max_match`` tokens that the index holds, take
the most frequent next token there (ties: the most recently indexed), append it, repeat up to
``k`` times. A request's own current end is never a match: the token after it is not known yet,
so it is not an event.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

from workers.speculative.proposer import ProposalRequest


class _Seq:
    """One indexed sequence: a copy of the tokens whose events are in the trie."""

    __slots__ = ("request_id", "tokens")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.tokens: list[int] = []


class _Node:
    """A trie node: either an unexpanded leaf (exactly one event, ``children is None``) that
    points at its event ``(seq, pos, stamp)``, or an expanded node with ``children`` and, at
    depth >= ``min_match``, ``counts`` (next token -> ``[events, latest stamp]``)."""

    __slots__ = ("total", "children", "counts", "seq", "pos", "stamp")

    def __init__(self) -> None:
        self.total = 0
        self.children: dict[int, _Node] | None = {}
        self.counts: dict[int, list[int]] | None = None
        self.seq: _Seq | None = None
        self.pos = 0
        self.stamp = 0


def _leaf(seq: _Seq, pos: int, stamp: int) -> _Node:
    node = _Node()
    node.total = 1
    node.children = None
    node.seq, node.pos, node.stamp = seq, pos, stamp
    return node


class SuffixProposer:
    """Draft tokens from a shared index of every sequence (prompt + output) seen so far.

    Each :meth:`propose` call first indexes the tokens of each request not indexed yet (per
    request, only the new tail; a list that got shorter or changed is re-indexed from the first
    differing token, as if it had always been the new list), then proposes for each request.
    :meth:`finish` keeps a finished sequence in the index as corpus for later requests.

    Memory is bounded by ``max_tokens`` indexed tokens: past it, whole finished sequences are
    evicted, the earliest finished first; if only running sequences remain, the least recently
    updated running ones are evicted and not indexed again until they finish (they still get
    proposals). The cap can be exceeded transiently by the tokens one call adds.

    Costs: indexing a token walks the trie as deep as its context repeats (at most
    ``max_match`` + 1 nodes); a proposal costs up to ``k`` walks of at most ``max_match``
    steps. Not thread-safe: call from one thread.

    Args:
        min_match: the shortest context, in tokens, that may produce a proposal (>= 1).
        max_match: the longest context, in tokens, that is matched (>= ``min_match``).
        max_tokens: the most tokens kept in the index (>= 1).

    Raises:
        ValueError: an argument out of range.
    """

    name = "suffix"

    def __init__(self, min_match: int = 2, max_match: int = 16,
                 max_tokens: int = 1_000_000) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.min_match = min_match
        self.max_match = max_match
        self.max_tokens = max_tokens
        self._root = _Node()
        self._stamps = itertools.count(1)
        self._num_tokens = 0
        # Running sequences by request id, least recently updated first.
        self._active: OrderedDict[str, _Seq] = OrderedDict()
        # Finished sequences, earliest finished first; keyed by a serial because request ids
        # may be reused.
        self._finished: OrderedDict[int, _Seq] = OrderedDict()
        self._finish_serial = itertools.count()
        # Running requests evicted for space: not indexed again until they finish.
        self._unindexed: set[str] = set()

    @property
    def num_tokens(self) -> int:
        """Tokens currently indexed, over all sequences."""
        return self._num_tokens

    def propose(self, requests: list[ProposalRequest]) -> list[list[int]]:
        """Index the requests' new tokens, then up to ``k`` draft tokens per request."""
        for request in requests:
            self._ingest(request.request_id, request.token_ids)
        self._evict()
        return [self.propose_one(r.token_ids, r.k) for r in requests]

    def propose_one(self, token_ids: list[int], k: int) -> list[int]:
        """The draft after ``token_ids`` from the index as it stands (indexes nothing)."""
        context = list(token_ids[-self.max_match:])
        draft: list[int] = []
        for _ in range(max(k, 0)):
            node = self._match(context)[1]
            if node is None:
                break
            if node.children is None:
                token = node.seq.tokens[node.pos]
            else:
                # Most events, then the most recently indexed: [events, stamp] order.
                token = max(node.counts.items(), key=lambda item: item[1])[0]
            draft.append(token)
            context.append(token)
        return draft

    def finish(self, request_ids: list[str]) -> None:
        """The requests ended: keep their sequences as evictable corpus, drop their state."""
        for request_id in request_ids:
            self._unindexed.discard(request_id)
            seq = self._active.pop(request_id, None)
            if seq is not None:
                self._finished[next(self._finish_serial)] = seq

    def continuation_counts(self, context: list[int]) -> tuple[int, dict[int, list[int]]]:
        """The longest suffix of ``context`` the index holds and what followed it.

        Returns:
            ``(n, counts)``: the matched suffix length in tokens and, per next token,
            ``[events, latest stamp]`` (a copy); ``counts`` is empty when ``n < min_match``.
        """
        depth, node = self._match(list(context))
        if node is None:
            return depth, {}
        if node.children is None:
            return depth, {node.seq.tokens[node.pos]: [1, node.stamp]}
        return depth, {token: list(entry) for token, entry in node.counts.items()}

    def _match(self, context: list[int]) -> tuple[int, _Node | None]:
        """The longest suffix of ``context`` (<= ``max_match`` tokens) held in the index, and
        its node (a leaf: one event); the node is None when the length is below
        ``min_match``."""
        node, depth = self._root, 0
        limit = min(len(context), self.max_match)
        while depth < limit:
            child = node.children.get(context[-1 - depth])
            if child is None:
                break
            if child.children is None:
                depth = self._extend_leaf_match(child, context, depth + 1, limit)
                node = child
                break
            node, depth = child, depth + 1
        return depth, (node if depth >= self.min_match else None)

    @staticmethod
    def _extend_leaf_match(leaf: _Node, context: list[int], depth: int, limit: int) -> int:
        # One event below: keep matching backwards along its own sequence.
        tokens, pos = leaf.seq.tokens, leaf.pos
        top = min(limit, pos)
        while depth < top and tokens[pos - depth - 1] == context[-1 - depth]:
            depth += 1
        return depth

    # -- indexing ---------------------------------------------------------------------------

    def _ingest(self, request_id: str, token_ids: list[int]) -> None:
        if request_id in self._unindexed:
            return
        if not isinstance(token_ids, list):
            token_ids = list(token_ids)  # a tuple slice never equals the list copy below
        seq = self._active.get(request_id)
        if seq is None:
            seq = self._active[request_id] = _Seq(request_id)
        else:
            self._active.move_to_end(request_id)
        indexed = len(seq.tokens)
        if len(token_ids) < indexed or token_ids[:indexed] != seq.tokens:
            self._truncate(seq, _common_prefix(seq.tokens, token_ids))
        start = len(seq.tokens)
        seq.tokens.extend(token_ids[start:])
        self._num_tokens += len(seq.tokens) - start
        for pos in range(max(start, self.min_match), len(seq.tokens)):
            self._insert(seq, pos)

    def _truncate(self, seq: _Seq, length: int) -> None:
        # Events at positions >= length have a changed outcome or context: remove them first,
        # while seq.tokens still holds what they were indexed with.
        for pos in range(max(length, self.min_match), len(seq.tokens)):
            self._remove(seq, pos)
        self._num_tokens -= len(seq.tokens) - length
        del seq.tokens[length:]

    def _insert(self, seq: _Seq, pos: int) -> None:
        tokens, stamp = seq.tokens, next(self._stamps)
        outcome, limit = tokens[pos], min(pos, self.max_match)
        node, depth = self._root, 0
        while True:
            node.total += 1
            if node.counts is not None:
                entry = node.counts.get(outcome)
                if entry is None:
                    node.counts[outcome] = [1, stamp]
                else:
                    entry[0] += 1
                    entry[1] = stamp
            if depth == limit:
                return
            key = tokens[pos - depth - 1]
            child = node.children.get(key)
            if child is None:
                node.children[key] = _leaf(seq, pos, stamp)
                return
            if child.children is None:
                self._expand(child, depth + 1)
            node, depth = child, depth + 1

    def _expand(self, leaf: _Node, depth: int) -> None:
        # A second event reaches this leaf: turn it into a node holding its one event.
        seq, pos, stamp = leaf.seq, leaf.pos, leaf.stamp
        leaf.seq = None
        leaf.children = {}
        if depth >= self.min_match:
            leaf.counts = {seq.tokens[pos]: [1, stamp]}
        if depth < min(pos, self.max_match):
            leaf.children[seq.tokens[pos - depth - 1]] = _leaf(seq, pos, stamp)

    def _remove(self, seq: _Seq, pos: int) -> None:
        tokens = seq.tokens
        outcome, limit = tokens[pos], min(pos, self.max_match)
        node, depth = self._root, 0
        while True:
            node.total -= 1
            if node.counts is not None:
                entry = node.counts[outcome]
                entry[0] -= 1
                if entry[0] == 0:
                    del node.counts[outcome]
                # A stale "latest stamp" is kept: it only breaks count ties.
            if depth == limit:
                return
            key = tokens[pos - depth - 1]
            child = node.children[key]
            if child.total == 1:
                # This event is the only one below: the whole subtree goes.
                del node.children[key]
                return
            node, depth = child, depth + 1

    # -- eviction ---------------------------------------------------------------------------

    def _evict(self) -> None:
        while self._num_tokens > self.max_tokens:
            if self._finished:
                _, seq = self._finished.popitem(last=False)
            elif self._active:
                _, seq = self._active.popitem(last=False)
                self._unindexed.add(seq.request_id)
            else:
                return
            self._truncate(seq, 0)


class ScopedSuffixProposer:
    """A :class:`SuffixProposer` per scope (``ProposalRequest.scope``: the adapter's content
    digest, empty for the base model), so text generated under one LoRA adapter never becomes
    the drafts of another's requests, nor the base model's. Each scope's index is bounded by
    ``max_tokens`` on its own. Not thread-safe: call from one thread.

    Args:
        **index: :class:`SuffixProposer`'s arguments, for every scope's index.
    """

    name = "suffix"

    def __init__(self, **index) -> None:
        SuffixProposer(**index)  # arguments checked now, not at the first request
        self._index = index
        self._indexes: dict[str, SuffixProposer] = {}
        self._scope_of: dict[str, str] = {}

    def propose(self, requests: list[ProposalRequest]) -> list[list[int]]:
        """Each request's drafts from its own scope's index (indexing it there first)."""
        drafts: list[list[int]] = [[] for _ in requests]
        by_scope: dict[str, list[int]] = {}
        for position, request in enumerate(requests):
            self._scope_of[request.request_id] = request.scope
            by_scope.setdefault(request.scope, []).append(position)
        for scope, positions in by_scope.items():
            index = self._indexes.get(scope)
            if index is None:
                index = self._indexes[scope] = SuffixProposer(**self._index)
            answers = index.propose([requests[p] for p in positions])
            for position, answer in zip(positions, answers, strict=True):
                drafts[position] = answer
        return drafts

    def finish(self, request_ids: list[str]) -> None:
        """The requests ended: each scope's index keeps them as corpus."""
        by_scope: dict[str, list[str]] = {}
        for request_id in request_ids:
            scope = self._scope_of.pop(request_id, None)
            if scope is not None:
                by_scope.setdefault(scope, []).append(request_id)
        for scope, ids in by_scope.items():
            self._indexes[scope].finish(ids)

    def index(self, scope: str = "") -> SuffixProposer | None:
        """The index of ``scope`` (None before its first request)."""
        return self._indexes.get(scope)


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
