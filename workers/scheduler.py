"""Continuous batching: which sequences run in the next step, and with how many tokens.

One unified step in the manner of vLLM v1's scheduler: every sequence has tokens whose KV is not
yet computed (a whole prompt, the rest of a prompt, or one decode token), and each step hands
out a token budget (``max_num_batched_tokens``) in this order:

1. decodes: running sequences with one uncomputed token, oldest first, so inter-token latency
   does not depend on how many prompts arrive; a speculating decode also computes its draft
   tokens (a verification block), cut to the budget, and dropped rather than preempting another
   sequence for their blocks;
2. running partial prefills (prompts already being chunked), oldest first, so a prompt that
   started is finished before new ones start;
3. waiting requests, in the order of the scheduling policy.

Step-time limits (``step_target``, off unless configured) budget a step's prompt tokens in
seconds as well as tokens, by the step costs measured on this machine
(``workers.step_time``): a target while sequences decode (Sarathi-Serve's stall-free batching,
Agrawal et al. 2024), and a cap with or without decodes, so a request that arrives during a
long prefill waits for a short step, not a long chunk. The decodes are scheduled first and uncut;
each prompt chunk then gets the tokens that fit in the seconds left at its depth in its
prompt (a deep token attends to more keys and costs more), the step's chunks at least one
block together. A newly admitted prompt that what is left of the step's token budget holds
whole is not cut by the cap (the target still applies): the step then gives it its first
token, and a burst of short prompts computed together rather than split kept its throughput.
A target may cover long prompts only, as the cap does (the server's default for weights kept
as stored, whose prompt tokens do not ride along a decode step nearly free).

Chunked prefill without starvation. A prompt longer than what is left of the budget is
prefilled in chunks. At most ``max_num_partial_prefills`` prompts are mid-prefill at once (vLLM's
name and default, 1): a waiting prompt that would stay mid-prefill waits while the limit is
reached, but a shorter one behind it whose whole prompt fits in this step's budget is admitted
ahead of it (as in vLLM's partial-prefill scheduling); the long one stays at the head and is
next once a slot frees. And a prompt being chunked advances at most
``long_prefill_token_threshold`` tokens per step (vLLM v1's per-request chunk cap; default half
the budget) when what that leaves could admit a waiting request this step: any one while a
partial-prefill slot is free, otherwise one whose whole prompt fits in the rest. So a long
prompt never takes the whole budget from a prompt that could run beside it, and it never
leaves budget idle for prompts that could not (vLLM applies its cap by default only with
several partial prefills; with one, a second long prompt could not start anyway).

Policies. ``fcfs`` admits in arrival order. ``prefix`` admits the request with the longest
cached prefix first (most reuse per computed token, as in SGLang's longest-prefix-match policy),
ties in arrival order; with aging, so nothing starves: a request that has waited
``aging_steps`` scheduling steps, or one that was preempted, goes before every fresh one, in
arrival order. Under both policies a request that lacks KV blocks blocks the ones behind it
(head-of-line), so a large request is never starved by a stream of small ones.

Shared prompts are computed once. A waiting request whose next uncached block is being computed
right now by a running prompt (the same digest, so the same tokens at the same positions under
the same identity) waits for it instead of computing it again, and reuses it as a cached
prefix once that block is committed. A burst of requests sharing a new system prompt, or the
``n`` choices of one request, then prefills the shared part once, not once per request. This is
SGLang's in-batch prefix caching; the wait is bounded by the running prompt's prefill, which
is scheduled ahead of every admission.

Preemption by recompute (vLLM's default): when a running sequence needs a block and none is
free, the newest running sequence is preempted (taken out of this step's batch if it was
already in it); its blocks go back to the pool and it is recomputed later, ahead of every
request that has not run yet. Recomputed tokens are never counted as prefix-cache hits.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from workers.block_manager import BlockManager
from workers.sequence import Sequence, SequenceStatus
from workers.step_time import StepTimeTarget

SchedulingPolicy = Literal["fcfs", "prefix"]
SCHEDULING_POLICIES: tuple[str, ...] = ("fcfs", "prefix")
DEFAULT_AGING_STEPS = 64
"""Scheduling steps after which a waiting request outranks every fresh one (policy ``prefix``)."""
PROMPT_LOGPROBS_CHUNK_TOKENS = 512
"""Most prompt tokens a request asking for prompt logprobs computes per step: each needs a row
of vocabulary logits (``[512, V]`` float32 is 100 MB for a 49k vocabulary), where a prompt
otherwise needs one."""


@dataclass
class SchedulerCounters:
    """Monotonic counts, in tokens or events, since the engine started.

    Attributes:
        prefix_query_tokens: prompt tokens looked up in the prefix cache (once per request).
        prefix_hit_tokens: of those, tokens reused (once per request, at first admission).
        tier_hit_tokens: of those, tokens loaded from the second KV tier after their
            eviction here.
        transfer_hit_tokens: of those, tokens fetched from another worker.
        preemptions: sequences preempted for lack of blocks.
        shared_prefix_waits: steps in which a waiting request was held back because a running
            prompt was computing its next block (counted per request and step).
    """

    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    tier_hit_tokens: int = 0
    transfer_hit_tokens: int = 0
    preemptions: int = 0
    shared_prefix_waits: int = 0


@dataclass
class ScheduledBatch:
    """The work of one step: ``num_new_tokens[i]`` tokens of ``seqs[i]`` to compute."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_tokens)

    def remove(self, seq: Sequence) -> None:
        index = self.seqs.index(seq)
        del self.seqs[index], self.num_new_tokens[index]

    def scheduled(self, seq: Sequence) -> int:
        """Tokens of ``seq`` in this batch (0 if it is not in it)."""
        for other, num_tokens in zip(self.seqs, self.num_new_tokens, strict=True):
            if other is seq:
                return num_tokens
        return 0

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    """Decides each step's batch under a token budget and the KV block supply.

    Args:
        block_manager: owns the block tables.
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: most tokens (prefill + decode) computed in one step.
        max_num_partial_prefills: most prompts mid-prefill (being chunked) at once.
        long_prefill_token_threshold: most tokens a prompt being chunked computes per step
            while other requests wait; None means half of ``max_num_batched_tokens``.
        policy: ``fcfs`` or ``prefix`` (see the module docstring).
        aging_steps: steps after which a waiting request outranks fresh ones (``prefix``).
        step_target: the seconds a step's prompt chunks may take (see the module
            docstring); None applies the token budget alone.

    Raises:
        ValueError: an unknown policy or a non-positive limit.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_num_partial_prefills: int = 1,
                 long_prefill_token_threshold: int | None = None,
                 policy: SchedulingPolicy = "fcfs", aging_steps: int = DEFAULT_AGING_STEPS,
                 step_target: StepTimeTarget | None = None):
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {SCHEDULING_POLICIES}, "
                             f"not {policy!r}")
        if min(max_num_seqs, max_num_batched_tokens, max_num_partial_prefills) < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and "
                             "max_num_partial_prefills must be at least 1")
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_partial_prefills = max_num_partial_prefills
        self.long_prefill_token_threshold = (long_prefill_token_threshold
                                             or max(1, max_num_batched_tokens // 2))
        self.policy = policy
        self.aging_steps = aging_steps
        self.step_target = step_target
        self._target_s: float | None = None  # seconds left for prompts under the target
        self._cap_s: float | None = None  # and under the cap
        self._prompt_tokens = 0  # prompt tokens in this step so far
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.counters = SchedulerCounters()
        self._step = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        seq.queued_at_step = self._step

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's sequences; may preempt running ones when blocks run out."""
        self._step += 1
        self._prompt_tokens = 0
        batch = ScheduledBatch()
        preempted = self._schedule_running(batch)
        if not preempted:  # the pool is tight: let the preempted ones back first
            self._admit_waiting(batch)
        return batch

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and return its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)

    def _budget_left(self, batch: ScheduledBatch) -> int:
        return self.max_num_batched_tokens - batch.num_tokens

    def _schedule_running(self, batch: ScheduledBatch) -> bool:
        """Decodes first, then partial prefills; returns whether anything was preempted."""
        decodes = [seq for seq in self.running if not _in_prefill(seq)]
        prefills = [seq for seq in self.running if _in_prefill(seq)]
        preempted = self._schedule_each(decodes, batch)
        self._target_s, self._cap_s = (
            (None, None) if self.step_target is None
            else self.step_target.seconds_left(batch.num_tokens))
        return self._schedule_each(prefills, batch) or preempted

    def _prompt_room(self, depth: int, budget: int, capped: bool = True) -> int:
        """Tokens of a prompt chunk from position ``depth`` that fit in ``budget`` tokens and
        the seconds this step has left for prompts: under the target (for a target of long
        prompts only, where ``capped``), and under the cap where ``capped``; the step's
        chunks get at least ``min_tokens`` together, so prompts advance however long the
        decodes take."""
        long_only = self.step_target is not None and self.step_target.long_prompts_only
        target = self._target_s if capped or not long_only else None
        limits = [s for s in (target, self._cap_s if capped else None) if s is not None]
        if not limits:
            return budget
        room = self.step_target.prompt_costs.tokens_within(min(limits), depth)
        return min(budget, max(room, self.step_target.min_tokens - self._prompt_tokens))

    def _spend(self, depth: int, num_tokens: int) -> None:
        """Account for a prompt chunk of ``num_tokens`` from position ``depth``."""
        self._prompt_tokens += num_tokens
        if self.step_target is not None:
            seconds = self.step_target.prompt_costs.seconds(depth, num_tokens)
            self._target_s = None if self._target_s is None else self._target_s - seconds
            self._cap_s = None if self._cap_s is None else self._cap_s - seconds

    def _schedule_each(self, seqs: list[Sequence], batch: ScheduledBatch) -> bool:
        """Adds each running sequence of ``seqs`` with its next tokens, while budget lasts;
        returns whether anything was preempted."""
        preempted = False
        for seq in seqs:
            budget = self._budget_left(batch)
            if budget <= 0:
                break
            if seq not in self.running:  # preempted for an older sequence this step
                continue
            prefill = _in_prefill(seq)
            if prefill:
                budget = self._prompt_room(seq.num_computed_tokens, budget)
                if budget <= 0:
                    break  # the step's seconds are spent
            num_tokens = min(seq.num_uncomputed_tokens + len(seq.spec_token_ids), budget)
            if prefill:
                partial = sum(1 for other in self.running if _in_prefill(other))
                num_tokens = _logit_rows_cap(seq, self._chunk(seq, num_tokens, budget, partial))
            if seq.spec_token_ids:
                num_tokens = self._fit_drafts(seq, num_tokens)
            fits, preempted_now = self._reserve(seq, num_tokens, batch)
            preempted |= preempted_now
            if fits:
                batch.add(seq, num_tokens)
                if prefill:
                    self._spend(seq.num_computed_tokens, num_tokens)
        return preempted

    def _fit_drafts(self, seq: Sequence, num_tokens: int) -> int:
        """Cut ``seq``'s draft tokens to the budget; drop them all rather than preempt another
        sequence for their blocks. Returns the tokens to schedule (decode token + drafts)."""
        del seq.spec_token_ids[num_tokens - 1:]
        if seq.spec_token_ids and not self.blocks.reserve(seq, num_tokens):
            seq.spec_token_ids.clear()
        return 1 + len(seq.spec_token_ids)

    def _reserve(self, seq: Sequence, num_tokens: int,
                 batch: ScheduledBatch) -> tuple[bool, bool]:
        """Find blocks for ``num_tokens`` more tokens of ``seq``, preempting the newest running
        sequences as needed. Returns (``seq`` got its blocks, something was preempted)."""
        preempted = False
        while not self.blocks.reserve(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim, batch)
            preempted = True
            if victim is seq:
                return False, preempted
        return True, preempted

    def _chunk(self, seq: Sequence, num_tokens: int, budget: int, partial: int) -> int:
        """``seq``'s prefill chunk of ``num_tokens`` out of ``budget``, cut to
        ``long_prefill_token_threshold`` (under a step-time limit, also to half of
        ``budget``, the tokens the seconds left hold) when the rest could admit another
        waiting request this step. ``partial``: prompts mid-prefill once ``seq`` runs, ``seq``
        included. A waiting prompt's size is taken without its cached prefix, so a cut is
        never made for a request that cannot use it.

        Half, rather than what the waiting prompts need: a step that gives someone their first
        token should be short. Leaving only what they need made that step the whole cap:
        short requests' TTFT p50 1.4 s against 0.8 s beside an 8,000-token prompt under a
        1 s cap (``benchmarks/arrival_wait.py``, Q4_1, one Zen 4 core; that variant was
        tried, not committed), for a long prompt 1% sooner."""
        cap = self.long_prefill_token_threshold
        if self._target_s is not None or self._cap_s is not None:
            cap = min(cap, max(1, budget // 2))
        seats = self.max_num_seqs - len(self.running) - (seq not in self.running)
        if num_tokens <= cap or seats <= 0:
            return num_tokens
        slot_free = partial < self.max_num_partial_prefills
        rest = budget - cap
        if any(slot_free or other.num_uncomputed_tokens <= rest
               for other in self.waiting if other is not seq):
            return cap
        return num_tokens

    def _num_partial_after(self, batch: ScheduledBatch) -> int:
        """Running prompts still mid-prefill once this batch is computed."""
        return sum(1 for seq in self.running if _in_prefill(seq)
                   and seq.num_computed_tokens + batch.scheduled(seq) < seq.num_tokens)

    def _admit_waiting(self, batch: ScheduledBatch) -> None:
        if not self.waiting:
            return  # the common decode step: no blocks in flight to collect
        partial = self._num_partial_after(batch)
        in_flight = {digest for seq in self.running for digest in _blocks_in_flight(seq)}
        for seq in self._waiting_in_order():
            budget = self._budget_left(batch)
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                return
            # looked up now, not when ordering: admitting another may have evicted a block
            hits = self.blocks.cached_prefix(seq)
            if _next_block(seq, len(hits)) in in_flight:
                self.counters.shared_prefix_waits += 1
                continue  # a running prompt computes it: reuse it next step
            depth = len(hits) * self.blocks.block_size
            remaining = seq.num_tokens - depth
            # a prompt that the token budget holds whole runs past the cap: the step gives it
            # its first token (a burst of short prompts is not split), where a long prompt's
            # chunk gives nobody one
            budget = self._prompt_room(depth, budget, capped=remaining > budget)
            if budget <= 0:
                return  # the step's seconds are spent
            num_tokens = _logit_rows_cap(seq, min(remaining, budget))
            chunked = num_tokens < remaining
            if chunked:
                if partial >= self.max_num_partial_prefills:
                    continue  # a shorter request behind it may still finish its prompt now
                num_tokens = self._chunk(seq, num_tokens, budget, partial + 1)
            if not self.blocks.can_admit(seq, hits, num_tokens):
                return  # out of blocks: the ones behind it wait too (no starvation by size)
            self._admit(seq, hits, num_tokens, batch)
            self._spend(depth, num_tokens)
            in_flight.update(_blocks_in_flight(seq))
            partial += chunked

    def _admit(self, seq: Sequence, hits: list, num_tokens: int,
               batch: ScheduledBatch) -> None:
        self.waiting.remove(seq)
        self.blocks.admit(seq, hits, num_tokens)
        self._count_first_lookup(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        batch.add(seq, num_tokens)

    def _waiting_in_order(self) -> list[Sequence]:
        """Waiting sequences in admission order (see the module docstring)."""
        if self.policy == "fcfs":
            return list(self.waiting)
        aged = [seq for seq in self.waiting if self._is_aged(seq)]
        fresh = [seq for seq in self.waiting if not self._is_aged(seq)]
        cached = {seq.request_id: len(self.blocks.cached_prefix(seq)) for seq in fresh}
        fresh.sort(key=lambda seq: cached[seq.request_id], reverse=True)  # stable sort: ties
        return aged + fresh  # stay in arrival order

    def _is_aged(self, seq: Sequence) -> bool:
        """Preempted sequences and those waiting ``aging_steps`` outrank fresh ones."""
        waited = self._step - seq.queued_at_step
        return seq.admitted or waited >= self.aging_steps

    def _count_first_lookup(self, seq: Sequence) -> None:
        """Hits count once per request; recomputation after preemption is not a hit."""
        if seq.admitted:
            return
        seq.admitted = True
        seq.num_cached_tokens = seq.num_computed_tokens
        self.counters.prefix_query_tokens += seq.num_prompt_tokens
        self.counters.prefix_hit_tokens += seq.num_cached_tokens
        self.counters.tier_hit_tokens += seq.num_tier_tokens
        self.counters.transfer_hit_tokens += seq.num_transfer_tokens

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        if batch.scheduled(seq):
            batch.remove(seq)
        seq.spec_token_ids.clear()
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.counters.preemptions += 1


def _logit_rows_cap(seq: Sequence, num_tokens: int) -> int:
    """``num_tokens`` cut to :data:`PROMPT_LOGPROBS_CHUNK_TOKENS` while ``seq`` computes prompt
    logprobs."""
    if seq.wants_prompt_logprobs:
        return min(num_tokens, PROMPT_LOGPROBS_CHUNK_TOKENS)
    return num_tokens


def _in_prefill(seq: Sequence) -> bool:
    """More than one uncomputed token: a prompt (or a preempted sequence's recompute)."""
    return seq.num_uncomputed_tokens > 1


def _blocks_in_flight(seq: Sequence) -> list[bytes]:
    """Digests of the full blocks of ``seq``'s tokens whose KV is not computed yet (a
    running prompt computes them in this step or the next ones)."""
    first = seq.num_computed_tokens // seq.block_size
    return [seq.digest(index) for index in range(first, seq.num_tokens // seq.block_size)]


def _next_block(seq: Sequence, num_hits: int) -> bytes | None:
    """The digest of the block after ``seq``'s cached prefix of ``num_hits`` blocks, or None
    when no further block could be a hit (the last token is always computed)."""
    if num_hits >= seq.num_reusable_blocks:
        return None
    return seq.digest(num_hits)
