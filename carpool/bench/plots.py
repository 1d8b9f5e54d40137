"""``carpool bench``'s figures, drawn with matplotlib (an optional dependency): output
throughput against TTFT and ITL p99 over the runs of a sweep, request throughput per
run, each run's TTFT and ITL distributions, and output throughput second by second."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(results: list[dict[str, Any]], folder: Path) -> list[Path]:
    """Write the figures into ``folder``; their paths. Raises RuntimeError without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import NullFormatter
    except ImportError:
        raise RuntimeError("--plot-dir needs matplotlib: pip install matplotlib") from None
    folder.mkdir(parents=True, exist_ok=True)
    labels = [r["label"] for r in results]
    written = []

    def save(figure: Any, path: Path) -> Path:
        figure.tight_layout()
        figure.savefig(path, dpi=120)
        plt.close(figure)
        return path

    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    # One line per server when results say which (a side-by-side comparison).
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault(str(r.get("server", "")), []).append(r)
    for axis, metric in zip(axes, ("ttft", "itl"), strict=True):
        for server, runs in groups.items():
            axis.plot(
                [r[f"p99_{metric}_ms"] for r in runs],
                [r["output_throughput"] for r in runs],
                "o-",
                label=server or None,
            )
        for label, r in zip(labels, results, strict=True):
            axis.annotate(label, (r[f"p99_{metric}_ms"], r["output_throughput"]), fontsize=7)
        axis.set_xlabel(f"{metric.upper()} p99 (ms)")
        axis.set_ylabel("output tokens/s")
        axis.set_xscale("log")
        axis.xaxis.set_minor_formatter(NullFormatter())  # crowded on a short log range
        axis.grid(alpha=0.3)
        if len(groups) > 1:
            axis.legend(fontsize=7)
    figure.suptitle("throughput against latency")
    written.append(save(figure, folder / "throughput_vs_latency.png"))

    figure, axis = plt.subplots(figsize=(8, 4))
    axis.bar(labels, [r["request_throughput"] for r in results])
    axis.set_ylabel("requests/s")
    axis.set_title("request throughput per run")
    written.append(save(figure, folder / "request_throughput.png"))

    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for axis, key, name in zip(axes, ("ttfts_ms", "itls_ms"), ("TTFT", "ITL"), strict=True):
        for r in results:
            if r[key]:
                axis.hist(r[key], bins=40, histtype="step", label=r["label"])
        axis.set_xlabel(f"{name} (ms)")
        axis.set_ylabel("requests" if name == "TTFT" else "gaps between streamed pieces")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    figure.suptitle("latency distributions")
    written.append(save(figure, folder / "latency_distributions.png"))

    figure, axis = plt.subplots(figsize=(8, 4))
    for r in results:
        axis.plot(r["output_throughput_per_s"], label=r["label"])
    axis.set_xlabel("second of the run")
    axis.set_ylabel("output tokens/s")
    axis.set_title("output throughput over each run")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    written.append(save(figure, folder / "throughput_over_time.png"))
    return written
