"""A step's structured-output masks, computed on a helper thread while the forward pass runs,
where a core is free for it.

A constrained row's mask depends only on the tokens its sequence has committed and the drafts
it verifies, all known once the step is scheduled, so it need not wait for the logits.
llguidance computes a mask without holding the GIL (two Python threads computed twice the
masks in the time of one), and the forward pass's kernels release it too, so the two proceed
side by side, as vLLM and SGLang overlap their grammar masks with a GPU's forward pass. Masks
are not cheap next to a CPU decode step: about 68 µs each for an order schema (a pattern, an
array of objects, an enum) against a 7-9 ms step of 4 rows on an AMX Xeon.

Only where a core is free: on a CPU whose every core computes the forward pass, the helper
thread takes turns with the pass's own threads, and the step, which waits for its slowest
thread, came out slower (``benchmarks/structured.py --masks``; docs/performance.md, "Masks
beside the forward pass").

While the job runs, nothing else may touch the step's matchers: the engine waits for it before
it samples, verifies or aborts any of them.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

from workers.structured.grammar import GrammarMatcher
from workers.structured.masks import PositionMask

MaskJob = dict[int, tuple[GrammarMatcher, list[int], int]]
"""Per row of a step (its index in the batch): the matcher, the drafts it verifies (none for a
plain decode) and the tokens its sequence may still produce."""


class StepMasks:
    """Computes a step's masks, on one helper thread (started on first use) where the step
    leaves a core to it, else in the caller's thread.

    Attributes:
        beside: None decides per step (the ``beside`` argument of :meth:`start`); True or
            False forces it (benchmarks compare the two).
    """

    def __init__(self) -> None:
        self.beside: bool | None = None
        self._thread: ThreadPoolExecutor | None = None

    def start(self, job: MaskJob, beside: Callable[[], bool]
              ) -> Future[dict[int, list[PositionMask] | Exception]] | None:
        """Starts computing the masks of ``job``'s rows; None when it has none. The future's
        result maps each row to :meth:`GrammarMatcher.masks_along` of its drafts: ``len(drafts)
        + 1`` position masks, or to the exception its matcher raised.

        Args:
            job: the step's constrained rows.
            beside: whether a core is free for the helper thread while the forward pass runs
                (asked only for a step with constrained rows). Where none is, the thread would
                take turns with the forward pass's own threads, and a step that waits on its
                slowest thread would wait the longer.
        """
        if not job:
            return None
        if self.beside if self.beside is not None else beside():
            if self._thread is None:
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="nalar-masks")
            return self._thread.submit(_masks, job)
        done: Future[dict[int, list[PositionMask] | Exception]] = Future()
        done.set_result(_masks(job))
        return done

    @staticmethod
    def settle(pending: Future | None) -> None:
        """Waits for ``pending`` to end, raising nothing: a forward pass that failed must
        not abort the step's sequences while the job still moves their matchers."""
        if pending is not None:
            wait([pending])


def _masks(job: MaskJob) -> dict[int, list[PositionMask] | Exception]:
    masks: dict[int, list[PositionMask] | Exception] = {}
    for row, (matcher, drafts, budget) in job.items():
        try:
            masks[row] = matcher.masks_along(drafts, budget)
        except Exception as exc:  # this row fails alone; the step's others go on
            masks[row] = exc
    return masks
