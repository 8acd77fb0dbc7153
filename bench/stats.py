"""Summary statistics of a run's records, under ``vllm bench serve``'s definitions and key
names where it has one.

* Latency distributions (TTFT, TPOT, ITL, E2E latency) cover successful requests only; ITL
  pools every gap of every request. Percentiles interpolate linearly (numpy's default), the
  standard deviation is the population one (``np.std``), as in vLLM.
* Throughputs divide by the phase's duration (first send to last answer).
* Goodput counts the successful requests meeting every SLO given (``value <= SLO``, in ms; a
  request with one output token has TPOT 0 for this purpose, as in vLLM).
* The prefix reuse ratio is token-weighted: Σ cached / Σ prompt tokens over successes that
  report cached tokens.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from bench.records import RequestRecord

PERCENTILES = (50, 90, 99)
"""Percentiles reported for each latency (p50 is reported as ``median``)."""

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
"""Metrics an SLO may bound (vLLM's ``--goodput`` names)."""


def parse_goodput(specs: Iterable[str]) -> dict[str, float]:
    """SLOs from ``metric:milliseconds`` strings (``["ttft:500", "tpot:50"]``).

    Raises:
        ValueError: a malformed item, an unknown metric or a value that is not a positive
            number.
    """
    slos: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"goodput SLO {spec!r}: expected METRIC:MS with METRIC one of "
                             f"{', '.join(GOODPUT_METRICS)}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {spec!r}: {value!r} is not a number") from None
        if not slos[name] > 0:
            raise ValueError(f"goodput SLO {spec!r} must be positive")
    return slos


def distribution(name: str, values_s: Sequence[float]) -> dict[str, float | None]:
    """``mean_/median_/std_/p90_/p99_{name}_ms`` of latencies given in seconds (None when
    there are none)."""
    values_ms = np.asarray(values_s, dtype=float) * 1000
    empty = values_ms.size == 0
    result = {f"mean_{name}_ms": None if empty else float(values_ms.mean()),
              f"median_{name}_ms": None if empty else float(np.percentile(values_ms, 50)),
              f"std_{name}_ms": None if empty else float(values_ms.std())}
    for q in PERCENTILES[1:]:
        result[f"p{q}_{name}_ms"] = None if empty else float(np.percentile(values_ms, q))
    return result


def is_good(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """Whether a successful request meets every SLO (milliseconds)."""
    if not record.ok:
        return False
    values_s = {"ttft": record.ttft_s, "tpot": record.tpot_s or 0.0, "e2el": record.e2e_s}
    return all(values_s[name] is not None and values_s[name] * 1000 <= slo
               for name, slo in slos_ms.items())


def prefix_reuse_ratio(records: Iterable[RequestRecord]) -> float | None:
    """Σ cached / Σ prompt tokens over successes that report cached tokens; None if none do."""
    reporting = [r for r in records if r.ok and r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in reporting)
    return sum(r.cached_tokens for r in reporting) / prompt if prompt else None


def worker_requests(records: Iterable[RequestRecord]) -> dict[str, int]:
    """Successful requests per serving worker (``unknown`` when the server did not say)."""
    counts = Counter(r.worker or "unknown" for r in records if r.ok)
    return dict(sorted(counts.items()))


def worker_share(records: Iterable[RequestRecord]) -> dict[str, float]:
    """Each worker's fraction of the successful requests."""
    counts = worker_requests(records)
    total = sum(counts.values())
    return {worker: count / total for worker, count in counts.items()}


def load_imbalance(records: Iterable[RequestRecord], workers: int | None = None) -> float | None:
    """Busiest / least busy worker's successful requests.

    Args:
        workers: how many workers the server has, when known: fewer seen means one served
            nothing, and the ratio is infinite. Unknown (None), only the workers seen count,
            and the ratio is None with fewer than two.
    """
    counts = list(worker_requests(records).values())
    if workers is not None and len(counts) < workers:
        return math.inf
    return max(counts) / min(counts) if len(counts) >= 2 else None


def spec_acceptance(records: Iterable[RequestRecord]) -> dict[str, Any]:
    """Speculative draft tokens accepted and rejected, and the acceptance rate
    accepted / (accepted + rejected); the rate is None when no request reported drafts."""
    reporting = [r for r in records if r.ok and r.accepted_prediction_tokens is not None]
    accepted = sum(r.accepted_prediction_tokens for r in reporting)
    rejected = sum(r.rejected_prediction_tokens or 0 for r in reporting)
    proposed = accepted + rejected
    return {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": rejected,
            "spec_acceptance_rate": accepted / proposed if proposed else None}


def valid_outputs(done: Sequence[RequestRecord]) -> dict[str, Any]:
    """Of the successful requests that asked for a ``response_format``: how many outputs
    parsed and validated (``valid_outputs``), out of ``checked_outputs``, and the fraction
    (None when none asked)."""
    checked = [r.valid_output for r in done if r.valid_output is not None]
    return {"checked_outputs": len(checked), "valid_outputs": sum(checked),
            "valid_output_fraction": sum(checked) / len(checked) if checked else None}


def summarize(records: Sequence[RequestRecord], duration_s: float,
              slos_ms: dict[str, float] | None = None) -> dict[str, Any]:
    """The run's summary (see the module docstring for the definitions).

    Args:
        records: every measured request, failures included.
        duration_s: the phase's wall time, seconds (> 0).
        slos_ms: goodput SLOs; without them ``request_goodput`` is None.
    """
    done = [r for r in records if r.ok]
    total_input = sum(r.prompt_tokens for r in done)
    total_output = sum(r.completion_tokens for r in done)
    good = sum(is_good(r, slos_ms) for r in done) if slos_ms else None
    summary: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(records) - len(done),
        "failures": dict(Counter(r.failure for r in records if not r.ok)),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "total_cached_tokens": sum(r.cached_tokens or 0 for r in done),
        "request_throughput": len(done) / duration_s,
        "request_goodput": None if good is None else good / duration_s,
        "good_requests": good,
        "goodput_slos_ms": slos_ms or None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "usage_reported_fraction": (sum(r.usage_reported for r in done) / len(done)
                                    if done else None),
    }
    summary |= valid_outputs(done)
    summary |= distribution("ttft", [r.ttft_s for r in done if r.ttft_s is not None])
    summary |= distribution("tpot", [r.tpot_s for r in done if r.tpot_s is not None])
    summary |= distribution("itl", [gap for r in done for gap in r.itl_s])
    summary |= distribution("e2el", [r.e2e_s for r in done])
    summary |= {"prefix_reuse_ratio": prefix_reuse_ratio(done),
                "worker_requests": worker_requests(done), "worker_share": worker_share(done),
                "worker_load_imbalance": load_imbalance(done)}
    summary |= spec_acceptance(done)
    return summary


def throughput_over_time(records: Sequence[RequestRecord], duration_s: float,
                         bin_s: float = 1.0) -> dict[str, list[float]]:
    """Output tokens/s and completed requests/s in consecutive bins of ``bin_s`` seconds.

    A request's completion tokens are spread evenly over its output chunks (a chunk may carry
    several tokens and the stream does not say how many); a request counts as completed in
    the bin where its stream ended.
    """
    bins = max(1, math.ceil(duration_s / bin_s))
    tokens = np.zeros(bins)
    completed = np.zeros(bins)
    for record in records:
        if not record.ok:
            continue
        times = record.chunk_times_s()
        for time_s in times:
            tokens[min(bins - 1, int(time_s / bin_s))] += record.completion_tokens / len(times)
        end_s = record.start_s + record.e2e_s
        completed[min(bins - 1, int(end_s / bin_s))] += 1
    return {"time_s": [i * bin_s for i in range(bins)],
            "output_tokens_per_s": list(tokens / bin_s),
            "requests_per_s": list(completed / bin_s)}
