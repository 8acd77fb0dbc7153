"""Adaptive draft length: per request, the k that maximises committed tokens per second.

High acceptance alone does not make speculation pay: verifying ``k`` drafts costs ``k`` more
query rows in the step, and proposing costs draft time. For a request whose draft at position
``i`` is accepted (given all before it were) with probability ``alpha_i``, one verification
step commits in expectation

    E(k) = 1 + sum_{i=1..k} prod_{j<=i} alpha_j  =  1 + sum_{i=1..k} S_i        tokens

(Leviathan et al. 2023, eq. 1, with per-position instead of a single acceptance rate). The
engine counts, per position, how often a draft there was verified and how often it was
committed; a draft is committed only when every draft before it was, so that ratio estimates
the survival ``S_i = prod_{j<=i} alpha_j`` directly. The step takes
``t_step + k * t_row + t_draft`` seconds, where ``t_step`` is the step time of its ``n``
decodes without this request's drafts, ``t_row`` the measured marginal cost of one more query
row and ``t_draft`` the request's share of the draft call. Those seconds delay every decode in
the step, not only this one, so the controller picks ``k`` in ``[0, k_max]`` maximising the
step's committed tokens per second, ``(n - 1 + E(k)) / time(k)``: the batch's goodput, as
SmartSpec does (Liu et al. 2024), rather than the request's own rate, which at 16 decodes
would buy one request's drafts with fifteen others' time. Alone (``n = 1``) the two are the
same. ``k = 0`` (no speculation) is chosen when nothing beats plain decoding;
such a request probes again with ``k_max`` after ``probe_interval`` steps (doubling while
probes keep failing), since acceptance changes along a request (a model starts copying). A
request that has not verified a draft yet probes at once: the prior is no measurement of it,
and a request shorter than ``probe_interval`` tokens would otherwise never be measured. A
probe the proposer had no draft for measured nothing, so it does not double the interval.

Costs are measured on this machine as the engine runs: step time is fitted as ``a + b * rows``
over recent decode/verify steps (exponentially weighted least squares), draft time as an
exponentially weighted mean per call.
"""

from __future__ import annotations

from contract.request import SpecUsage
from workers.step_time import COST_DECAY, StepCostModel

PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 2.0
"""Prior of the conditional acceptance per position: ``PRIOR_WEIGHT`` pseudo-verifications
at ``PRIOR_ACCEPTANCE``."""

class DraftLengthController:
    """Chooses each speculating request's draft length.

    Args:
        k_max: the most draft tokens per step.
        adaptive: False always proposes ``k_max``.
        probe_interval: steps a request stays off before probing again (doubled per failed
            probe, up to 16x).
        steps: the engine's fitted decode step time (the engine observes it); None makes one
            of its own.
    """

    def __init__(self, k_max: int, adaptive: bool = True, probe_interval: int = 16,
                 steps: StepCostModel | None = None):
        self.k_max = k_max
        self.adaptive = adaptive
        self.probe_interval = probe_interval
        self.steps = steps or StepCostModel()
        self.draft_call_s = 0.0
        self._draft_calls = 0
        self._off_since: dict[str, tuple[int, int]] = {}  # request id -> (steps off, probes)

    def observe_draft(self, seconds: float) -> None:
        """One batched draft call took ``seconds``."""
        d = COST_DECAY if self._draft_calls else 0.0
        self.draft_call_s = d * self.draft_call_s + (1 - d) * seconds
        self._draft_calls += 1

    def choose(self, request_id: str, usage: SpecUsage, num_decodes: int) -> int:
        """Draft length for this request's next step.

        Args:
            request_id: the sequence.
            usage: its acceptance so far (per position).
            num_decodes: sequences decoding in the step, this one included: one query row
                each without drafts, each committing at least one token, and sharing the
                draft call.

        Returns:
            k in ``[0, k_max]``.
        """
        if not self.adaptive or not self.steps.known:
            return self.k_max
        best_k = self._best_k(usage, num_decodes)
        if best_k:
            self._off_since.pop(request_id, None)
            return best_k
        unmeasured = (self.probe_interval, 0) if not usage.verification_steps else (0, 0)
        off, probes = self._off_since.get(request_id, unmeasured)
        if off >= self.probe_interval << min(probes, 4):
            self._off_since[request_id] = (0, probes + 1)
            return self.k_max
        self._off_since[request_id] = (off + 1, probes)
        return 0

    def no_draft(self, request_id: str) -> None:
        """The proposer had no draft for ``request_id``'s step: a probe then measured
        nothing and does not count as a failed one."""
        off, probes = self._off_since.get(request_id, (0, 0))
        if off == 0 and probes:
            self._off_since[request_id] = (0, probes - 1)

    def forget(self, request_id: str) -> None:
        self._off_since.pop(request_id, None)

    def expected_tokens(self, usage: SpecUsage, k: int) -> float:
        """E(k): expected committed tokens of a step verifying ``k`` drafts."""
        return 1.0 + sum(_survival(usage, k))

    def _best_k(self, usage: SpecUsage, num_decodes: int) -> int:
        base = self.steps.time(num_decodes)
        per_row = self.steps.per_row()
        draft = self.draft_call_s / max(1, num_decodes)
        others = max(0, num_decodes - 1)
        best_k, best_rate = 0, (others + 1.0) / base
        for k in range(1, self.k_max + 1):
            rate = (others + self.expected_tokens(usage, k)) / (base + k * per_row + draft)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k


def _survival(usage: SpecUsage, k: int) -> list[float]:
    """Smoothed ``S_i`` for positions ``0 .. k-1``: P(the draft at position i is committed).

    Each position's prior is the previous position's estimate times
    :data:`PRIOR_ACCEPTANCE`, weighted :data:`PRIOR_WEIGHT` pseudo-verifications, so an
    unmeasured position is expected to do a little worse than the one before it; estimates
    never increase with the position (a later draft cannot be committed more often).
    """
    survival, previous = [], 1.0
    for i in range(k):
        proposed = accepted = 0
        if i < len(usage.proposed_by_position):
            proposed, accepted = usage.proposed_by_position[i], usage.accepted_by_position[i]
        prior = previous * PRIOR_ACCEPTANCE
        previous = min(previous, (accepted + prior * PRIOR_WEIGHT) / (proposed + PRIOR_WEIGHT))
        survival.append(previous)
    return survival
