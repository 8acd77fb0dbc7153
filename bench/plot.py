"""The PNG of a run: latency CDFs (TTFT, ITL, E2E latency) and throughput over time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

from bench.records import RequestRecord  # noqa: E402
from bench.stats import throughput_over_time  # noqa: E402


def _cdf(axis, values_s: Sequence[float], title: str) -> None:
    values_ms = np.sort(np.asarray(values_s, dtype=float) * 1000)
    if values_ms.size:
        axis.step(values_ms, np.arange(1, values_ms.size + 1) / values_ms.size, where="post")
    axis.set(title=f"{title} CDF (n={values_ms.size})", xlabel="ms", ylabel="fraction",
             ylim=(0, 1.02))
    axis.grid(alpha=0.3)


def plot_run(records: Sequence[RequestRecord], duration_s: float, path: str | Path,
             title: str = "") -> Path:
    """Writes a 2x2 figure of the successful requests to ``path`` (PNG); returns the path."""
    done = [r for r in records if r.ok]
    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    _cdf(axes[0, 0], [r.ttft_s for r in done if r.ttft_s is not None], "TTFT")
    _cdf(axes[0, 1], [gap for r in done for gap in r.itl_s], "ITL")
    _cdf(axes[1, 0], [r.e2e_s for r in done], "E2E latency")
    series = throughput_over_time(done, duration_s, bin_s=max(1.0, duration_s / 60))
    tokens_axis = axes[1, 1]
    tokens_axis.plot(series["time_s"], series["output_tokens_per_s"], label="output tokens/s")
    tokens_axis.set(title="Throughput over time", xlabel="s since start",
                    ylabel="output tokens/s")
    requests_axis = tokens_axis.twinx()
    requests_axis.plot(series["time_s"], series["requests_per_s"], color="tab:orange",
                       label="completed requests/s")
    requests_axis.set_ylabel("requests/s")
    figure.legend(loc="lower right")
    figure.suptitle(title)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
