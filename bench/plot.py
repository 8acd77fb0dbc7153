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

THROUGHPUT_BINS = 30
"""Points of the throughput-over-time curve (the bin width follows the run's length)."""


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
    bin_s = max(duration_s, 1e-3) / THROUGHPUT_BINS
    series = throughput_over_time(done, duration_s, bin_s=bin_s)
    tokens_axis = axes[1, 1]
    tokens_line = tokens_axis.plot(series["time_s"], series["output_tokens_per_s"],
                                   marker=".", label="output tokens/s")
    tokens_axis.set(title=f"Throughput over time ({bin_s:.2g} s bins)",
                    xlabel="s since start", ylabel="output tokens/s")
    requests_axis = tokens_axis.twinx()
    requests_line = requests_axis.plot(series["time_s"], series["requests_per_s"],
                                       color="tab:orange", marker=".",
                                       label="completed requests/s")
    requests_axis.set_ylabel("requests/s")
    tokens_axis.legend(handles=tokens_line + requests_line, loc="upper right", fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
