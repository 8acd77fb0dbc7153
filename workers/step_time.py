"""What an engine step costs on this machine, measured as the engine runs, and how many prompt
tokens fit beside the running decodes under a step-time target.

On a CPU a prompt token costs a sizeable part of a whole small decode step, so a step that
takes a GPU-sized token budget of prompt tokens (vLLM's ``max_num_batched_tokens``, 2,048)
beside the decodes holds every running stream for seconds: 3.8 s in
``benchmarks/interference.py`` on a 2-core Zen 4 (bf16; docs/performance.md, "A step-time
target"). :class:`StepTimeTarget` budgets the prompt tokens of a step in seconds instead: the
decodes always run, and prompt chunks fill what the target leaves (Sarathi-Serve's stall-free
batching, Agrawal et al. 2024, with its token budget derived from the time-between-tokens
target by measurement, here online rather than by an offline profile).
"""

from __future__ import annotations

from collections.abc import Callable

COST_DECAY = 0.97
"""Weight of the previous estimate per observed step (about a 33-step window)."""

AUTO = "auto"
"""The step-time target chosen by :func:`auto_target_s` for the worker's weights and device."""

DENSE_CPU_TARGET_S = 0.25
"""``auto``'s target on a CPU worker with dense weights. Through HTTP on a Zen 4 EPYC (dense
bf16, 2 workers of one thread, 16 concurrent requests, three rounds alternating, twice), with
it against without: output tokens/s 1.02x and 1.07x, ITL p99 0.49x and 0.48x. A dense decode step is
bound by reading the weights, so prompt tokens that share it ride along nearly free. Weights
kept as stored (Q4_1) are not: their step is bound by arithmetic, as the prompt tokens are, and
the same target cost them 0.80-0.83x the throughput (docs/performance.md, "A step-time
target")."""


def auto_target_s(device: str, quantization: str) -> float | None:
    """The step-time target ``auto`` stands for, in seconds: :data:`DENSE_CPU_TARGET_S` on a
    CPU (``device``) with dense weights (``quantization`` ``none``), else None (off: not
    measured on a GPU)."""
    return DENSE_CPU_TARGET_S if device == "cpu" and quantization == "none" else None


class StepCostModel:
    """Decode step time as ``a + b * rows`` seconds, fitted by exponentially weighted least
    squares over recent decode and verification steps.

    Only steps of at most ``max_rows`` query rows are fitted: prefill chunks cost differently
    per row. The speculation controller weighs a draft's extra rows with it, and
    :class:`StepTimeTarget` what the decodes leave of a step's target.
    """

    def __init__(self, max_rows: int = 256):
        self.max_rows = max_rows
        self._n = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        """A decode or verification step of ``rows`` query rows took ``seconds``."""
        if rows > self.max_rows:
            return
        d = COST_DECAY
        self._n = d * self._n + 1
        self._x = d * self._x + rows
        self._y = d * self._y + seconds
        self._xx = d * self._xx + rows * rows
        self._xy = d * self._xy + rows * seconds

    @property
    def known(self) -> bool:
        return self._n >= 3

    def per_row(self) -> float:
        """``b``: seconds per extra query row (0 until the fit has spread in rows)."""
        var = self._xx / self._n - (self._x / self._n) ** 2 if self._n else 0.0
        if var < 0.25:
            return 0.0
        cov = self._xy / self._n - (self._x / self._n) * (self._y / self._n)
        return max(0.0, cov / var)

    def time(self, rows: int) -> float:
        """Predicted seconds for a step of ``rows`` query rows."""
        if not self._n:
            return 0.0
        b = self.per_row()
        mean_x, mean_y = self._x / self._n, self._y / self._n
        return max(1e-6, mean_y + b * (rows - mean_x))


class StepTimeTarget:
    """How many prompt tokens a step may add to its decodes and stay within ``seconds``.

    Args:
        seconds: the target step time while sequences are decoding (the inter-token latency
            a prompt's arrival may cause).
        decode_steps: the fitted decode step time.
        prefill_s_per_token: the measured seconds of one prompt token (None until measured).
        min_tokens: prompt tokens a step always gets, so prompts advance however long the
            decodes alone take.

    Raises:
        ValueError: ``seconds`` is not positive or ``min_tokens`` is below 1.
    """

    def __init__(self, seconds: float, decode_steps: StepCostModel,
                 prefill_s_per_token: Callable[[], float | None], min_tokens: int):
        if seconds <= 0 or min_tokens < 1:
            raise ValueError("a step-time target needs seconds > 0 and min_tokens >= 1")
        self.seconds = seconds
        self.decode_steps = decode_steps
        self.prefill_s_per_token = prefill_s_per_token
        self.min_tokens = min_tokens

    def prompt_tokens(self, decode_rows: int) -> int | None:
        """Prompt tokens that fit beside ``decode_rows`` decode and draft rows; None while
        the prompt tokens' cost is unmeasured (then only the token budget applies). While the
        decodes' cost is unmeasured it counts as none: a worker that has prefilled without
        pause since it started (a long prompt beside short requests) has seen no step of
        decodes alone to measure it, and waiting for one left each of its steps the whole
        token budget (seconds on a CPU core) while the short requests decoded a token a
        step."""
        per_token = self.prefill_s_per_token()
        if per_token is None:
            return None
        decodes_s = self.decode_steps.time(decode_rows) if self.decode_steps.known else 0.0
        left = self.seconds - decodes_s
        return max(self.min_tokens, int(left / per_token))
