"""What an engine step costs on this machine, measured as the engine runs, and how many prompt
tokens a step may take under its time limits.

On a CPU a prompt token costs a sizeable part of a whole small decode step, so a step that
takes a GPU-sized token budget of prompt tokens (vLLM's ``max_num_batched_tokens``, 2,048)
holds everyone else for seconds: the running streams (3.8 s in ``benchmarks/interference.py``
on a 2-core Zen 4, bf16; docs/performance.md, "A step-time target"), and any request that
arrives meanwhile, which is not even scheduled before the step ends (7 s for a chunk deep in
an 8,000-token prompt, one Zen 4 core; "A step-time cap"). :class:`StepTimeTarget` budgets a
step's prompt tokens in seconds instead, with two limits:

- a target while sequences decode: the decodes always run, and prompt chunks fill what the
  target leaves (Sarathi-Serve's stall-free batching, Agrawal et al. 2024, with its token
  budget derived from the time-between-tokens target by measurement, here online rather than
  by an offline profile);
- a cap on the chunks of a prompt longer than the token budget, with or without decodes, so
  a request arriving during a long prompt's prefill waits about that long for the step in
  progress, and is admitted beside the prompt's next chunk (``workers.scheduler`` says which
  prompts it cuts).

A prompt token's cost grows with the keys it attends to: one Zen 4 core took 2.8 s for the
first 2,048 tokens of a prompt and 7.0 s for tokens 6,144-8,000. :class:`PromptCostModel`
fits it against that depth, so a chunk deep in a long prompt is cut shorter than its first.
"""

from __future__ import annotations

import math

COST_DECAY = 0.97
"""Weight of the previous estimate per observed step (about a 33-step window)."""

AUTO = "auto"
"""A step-time limit chosen by the worker's weights and device (:func:`auto_target_s`,
:func:`auto_cap_s`)."""

DENSE_CPU_TARGET_S = 0.25
"""``auto``'s target on a CPU worker with dense weights. Through HTTP on a Zen 4 EPYC (dense
bf16, 2 workers of one thread, 16 concurrent requests, three rounds alternating, twice), with
it against without: output tokens/s 1.02x and 1.07x, ITL p99 0.49x and 0.48x. A dense decode step is
bound by reading the weights, so prompt tokens that share it ride along nearly free. Weights
kept as stored (Q4_1) are not: their step is bound by arithmetic, as the prompt tokens are, and
the same target cost them 0.80-0.83x the throughput (docs/performance.md, "A step-time
target")."""

STORED_CPU_TARGET_S = 0.5
"""``auto``'s target on a CPU worker with weights kept as stored (GGUF, int8), applied to the
chunks of prompts longer than the token budget only (:attr:`StepTimeTarget.long_prompts_only`).
A prompt the budget holds whole is not cut: applied to every prompt, a target of 250 ms cost
16 concurrent streams of 256-token prompts 0.80-0.83x their throughput (the note on
:data:`DENSE_CPU_TARGET_S`). A long prompt is chunked anyway, by the cap. Four streams decoding
on one Zen 4 core (Q4_1) while a 6,000-token prompt arrived (``benchmarks/interference.py
--quantization gguf --threads 1 --cap-ms 1000``, three runs,
``benchmarks/results/epyc-avx512bf16/stored-long-target-3c6153e/``): under the cap alone their
ITL p99 was 1,058-1,116 ms; with this target 524-546 ms, the prompt's TTFT 1.01-1.09x; with
250 ms 283-298 ms, its TTFT 1.13-1.17x (docs/performance.md, "A step-time target")."""

CPU_CAP_S = 1.0
"""``auto``'s step-time cap on a CPU worker. A lone 8,000-token prompt on one Zen 4 core
(``benchmarks/arrival_wait.py``; docs/performance.md, "A step-time cap") took 1.7% longer
(Q4_1) and 1.5% (bf16) in chunks of 512 tokens than of 2,048, and 4-5% in chunks of 256: a
step's fixed cost is small beside a second of prompt tokens."""


def auto_target_s(device: str, quantization: str) -> float | None:
    """The step-time target ``auto`` stands for, in seconds: on a CPU (``device``)
    :data:`DENSE_CPU_TARGET_S` with dense weights (``quantization`` ``none``), else
    :data:`STORED_CPU_TARGET_S`; None (off) on a GPU, where it was not measured."""
    if device != "cpu":
        return None
    return DENSE_CPU_TARGET_S if quantization == "none" else STORED_CPU_TARGET_S


def auto_target_long_prompts_only(quantization: str) -> bool:
    """Whether the target ``auto`` stands for applies to long prompts' chunks only: for
    weights kept as stored (:data:`STORED_CPU_TARGET_S`)."""
    return quantization != "none"


def auto_cap_s(device: str) -> float | None:
    """The step-time cap ``auto`` stands for, in seconds: :data:`CPU_CAP_S` on a CPU
    (``device``), else None (off: a GPU computes a whole token budget in about 0.1 s)."""
    return CPU_CAP_S if device == "cpu" else None


class LinearCost:
    """``y = a + b * x``, fitted by exponentially weighted least squares (weight
    :data:`COST_DECAY` per older observation).

    Args:
        min_spread: the variance of ``x`` below which the slope is taken as 0 (the fit has
            not seen ``x`` vary enough to tell it).
    """

    def __init__(self, min_spread: float):
        self.min_spread = min_spread
        self._n = self._x = self._y = self._xx = self._xy = 0.0

    def add(self, x: float, y: float) -> None:
        d = COST_DECAY
        self._n = d * self._n + 1
        self._x = d * self._x + x
        self._y = d * self._y + y
        self._xx = d * self._xx + x * x
        self._xy = d * self._xy + x * y

    @property
    def observations(self) -> float:
        """The decayed count of observations (0 before the first)."""
        return self._n

    def slope(self) -> float:
        """``b``, at least 0 (0 until ``x`` has spread)."""
        var = self._xx / self._n - (self._x / self._n) ** 2 if self._n else 0.0
        if var < self.min_spread:
            return 0.0
        cov = self._xy / self._n - (self._x / self._n) * (self._y / self._n)
        return max(0.0, cov / var)

    def at(self, x: float) -> float:
        """Predicted ``y`` at ``x`` (at least 1e-6; 0 before any observation)."""
        if not self._n:
            return 0.0
        mean_x, mean_y = self._x / self._n, self._y / self._n
        return max(1e-6, mean_y + self.slope() * (x - mean_x))


class StepCostModel(LinearCost):
    """Decode step time as ``a + b * rows`` seconds, fitted over recent decode and
    verification steps.

    Only steps of at most ``max_rows`` query rows are fitted: prefill chunks cost differently
    per row. The speculation controller weighs a draft's extra rows with it, and
    :class:`StepTimeTarget` what the decodes leave of a step's target.
    """

    def __init__(self, max_rows: int = 256):
        super().__init__(min_spread=0.25)
        self.max_rows = max_rows

    def observe(self, rows: int, seconds: float) -> None:
        """A decode or verification step of ``rows`` query rows took ``seconds``."""
        if rows <= self.max_rows:
            self.add(rows, seconds)

    @property
    def known(self) -> bool:
        return self.observations >= 3

    def per_row(self) -> float:
        """``b``: seconds per extra query row (0 until the fit has spread in rows)."""
        return self.slope()

    def time(self, rows: int) -> float:
        """Predicted seconds for a step of ``rows`` query rows."""
        return self.at(rows)


class PromptCostModel(LinearCost):
    """Seconds per prompt token as ``a + b * depth``, where ``depth`` is the position the
    token sits at (the keys it attends to), fitted over recent prefill steps.

    A step's time is spread over all its tokens (decodes beside the prompt chunks included),
    so the fit slightly overstates a prompt token beside many decodes.
    """

    def __init__(self):
        super().__init__(min_spread=1.0)

    def observe(self, chunks: list[tuple[int, int]], seconds: float, num_tokens: int) -> None:
        """A step of ``num_tokens`` tokens took ``seconds``; ``chunks`` are its prompt chunks
        as ``(first position, tokens)``."""
        prompt_tokens = sum(n for _, n in chunks)
        if not prompt_tokens:
            return
        depth = sum(n * (start + n / 2) for start, n in chunks) / prompt_tokens
        self.add(depth, seconds / num_tokens)

    @property
    def known(self) -> bool:
        return self.observations > 0

    def seconds(self, start: int, tokens: int) -> float:
        """Predicted seconds of a chunk of ``tokens`` prompt tokens from position ``start``."""
        return tokens * self.at(start + tokens / 2)

    def tokens_within(self, seconds: float, start: int) -> int:
        """Most prompt tokens from position ``start`` whose predicted cost is within
        ``seconds`` (0 when it is not positive)."""
        if seconds <= 0:
            return 0
        slope = self.slope()
        per_token = self.at(start)  # a token's cost at the chunk's first position
        # tokens * (per_token + slope * tokens / 2) = seconds, solved for tokens in the form
        # that stays exact as the slope goes to 0
        root = math.sqrt(per_token * per_token + 2 * slope * seconds)
        return int(2 * seconds / (per_token + root) + 1e-9)


class StepTimeTarget:
    """How many seconds a step's prompt chunks may take, and how many prompt tokens fit.

    Args:
        seconds: the target step time while sequences are decoding (the inter-token latency
            a prompt's arrival may cause); None: no target.
        cap_s: the longest a step with a long prompt's chunk may take (what a request
            arriving during a long prefill waits for the step in progress); None: no cap.
        decode_steps: the fitted decode step time.
        prompt_costs: the fitted prompt-token cost by depth.
        min_tokens: prompt tokens a step always gets, so prompts advance however long the
            decodes alone take.
        long_prompts_only: the target applies, as the cap does, only to the chunks of
            prompts longer than the step's token budget; a prompt the budget holds whole runs
            whole beside the decodes.

    Raises:
        ValueError: neither limit is set, one is not positive, or ``min_tokens`` is below 1.
    """

    def __init__(self, seconds: float | None, cap_s: float | None,
                 decode_steps: StepCostModel, prompt_costs: PromptCostModel, min_tokens: int,
                 long_prompts_only: bool = False):
        limits = [s for s in (seconds, cap_s) if s is not None]
        if not limits or min(limits) <= 0 or min_tokens < 1:
            raise ValueError("a step-time limit needs a target or a cap, each > 0 seconds, "
                             "and min_tokens >= 1")
        self.seconds = seconds
        self.cap_s = cap_s
        self.decode_steps = decode_steps
        self.prompt_costs = prompt_costs
        self.min_tokens = min_tokens
        self.long_prompts_only = long_prompts_only

    def seconds_left(self, decode_rows: int) -> tuple[float | None, float | None]:
        """Seconds a step's prompt chunks may take beside ``decode_rows`` decode and draft
        rows: ``(under the target, under the cap)``, each None where it does not apply (the
        target applies only with decodes; either may be unset) and both None while the prompt
        tokens' cost is unmeasured. While the decodes' cost is unmeasured it counts as none: a
        worker that has prefilled without pause since it started (a long prompt beside short
        requests) has seen no step of decodes alone to measure it, and waiting for one left
        each of its steps the whole token budget (seconds on a CPU core) while the short
        requests decoded a token a step."""
        if not self.prompt_costs.known:
            return None, None
        decodes_s = (self.decode_steps.time(decode_rows)
                     if decode_rows and self.decode_steps.known else 0.0)
        target = None if self.seconds is None or not decode_rows else self.seconds - decodes_s
        cap = None if self.cap_s is None else self.cap_s - decodes_s
        return target, cap
