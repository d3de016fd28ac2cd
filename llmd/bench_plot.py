"""`llmd bench --plot FILE.png`: the run's latency distributions and its throughput over time.

Four panels: time to first token and inter-token latency (histograms with p50/p99 marked),
end-to-end latency per request (sorted), and output tokens per second over the run with the number
of requests in flight. matplotlib is an optional dependency (``pip install 'llmd[bench]'``);
:func:`check_plot_path` says so before the run starts rather than after it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from llmd.errors import LlmdError

if TYPE_CHECKING:
    from llmd.bench import BenchRun, RequestRecord

FORMATS = (".png", ".svg", ".pdf")


def check_plot_path(path: str) -> Path:
    """The plot's path, checked before the run: a known format, an existing folder, matplotlib here.

    Raises:
        LlmdError: with what to do.
    """
    out = Path(path).expanduser()
    if out.suffix.lower() not in FORMATS:
        raise LlmdError(f"--plot {path}: the file must end in {', '.join(FORMATS)}")
    if not out.parent.is_dir():
        raise LlmdError(f"--plot {path}: the folder {out.parent} does not exist")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise LlmdError("--plot needs matplotlib: pip install 'llmd[bench]' (or pip install matplotlib)") from None
    return out


def throughput_over_time(records: list[RequestRecord], t0: float, duration: float, bin_s: float
                         ) -> tuple[list[float], list[float], list[int]]:
    """Per bin of ``bin_s`` seconds from ``t0``: the bin's start, output tokens per second received
    in it, and requests in flight at its start (sent, not yet finished). The tokens of all bins add
    up to every token received (a token landing exactly at the end goes in the last bin)."""
    num_bins = max(1, int(duration / bin_s + 0.999999))
    counts = [0] * num_bins
    for r in records:
        for t in r.token_times:
            counts[min(num_bins - 1, max(0, int((t - t0) / bin_s)))] += 1
    starts = [i * bin_s for i in range(num_bins)]
    in_flight = [sum(1 for r in records if r.sent - t0 <= s < (r.end - t0)) for s in starts]
    return starts, [c / bin_s for c in counts], in_flight


def plot(run: BenchRun, path: Path) -> None:
    """Draw ``run`` into ``path`` (format from its suffix)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display is needed or wanted
    import matplotlib.pyplot as plt

    report, ok = run.report, [r for r in run.records if r.error is None]
    ttfts = [1000 * (r.token_times[0] - r.sent) for r in ok if r.token_times]
    itls = [1000 * (b - a) for r in ok for a, b in zip(r.token_times, r.token_times[1:])]
    e2es = sorted(r.end - r.sent for r in ok)
    # NOTE: bins of several decode steps: tokens arrive a step at a time, and bins near one step wide
    # alternate between one and two steps' tokens (a saw-tooth that is only aliasing).
    bin_s = max(0.5, report.duration_s / 30)
    starts, tok_s, in_flight = throughput_over_time(run.records, run.t0, report.duration_s, bin_s)

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), constrained_layout=True)
    fig.suptitle(f"llmd bench {report.workload}: {report.num_requests} requests, "
                 f"{report.output_tokens_per_s:.1f} output tok/s, {report.request_throughput:.2f} req/s")
    _histogram(axes[0][0], ttfts, "time to first token (ms)", report.ttft_p50, report.ttft_p99)
    _histogram(axes[0][1], itls, "inter-token latency (ms)", report.itl_p50, report.itl_p99)
    ax = axes[1][0]
    ax.plot(range(1, len(e2es) + 1), e2es, marker=".", linestyle="-")
    ax.set_xlabel("request (sorted by latency)")
    ax.set_ylabel("end-to-end latency (s)")
    ax.grid(alpha=0.3)
    ax = axes[1][1]
    ax.step(starts, tok_s, where="post", label="output tok/s")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel(f"output tok/s ({bin_s:.2g} s bins)")
    ax.grid(alpha=0.3)
    twin = ax.twinx()
    twin.step(starts, in_flight, where="post", color="tab:orange", alpha=0.7, label="requests in flight")
    twin.set_ylabel("requests in flight")
    twin.set_ylim(bottom=0)
    handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], loc="lower right")
    try:
        fig.savefig(path, dpi=100)
    except OSError as e:
        raise LlmdError(f"--plot {path}: cannot write the file ({e.strerror or e})") from None
    finally:
        plt.close(fig)


def _histogram(ax, values_ms: list[float], label: str, p50_s: float | None, p99_s: float | None) -> None:
    if values_ms:
        ax.hist(values_ms, bins=min(50, max(5, len(values_ms) // 4)), color="tab:blue", alpha=0.8)
    for value, name, style in ((p50_s, "p50", "--"), (p99_s, "p99", ":")):
        if value is not None:
            ax.axvline(1000 * value, color="black", linestyle=style, label=f"{name} {1000 * value:.0f} ms")
    ax.set_xlabel(label)
    ax.set_ylabel("count")
    ax.grid(alpha=0.3)
    if p50_s is not None:
        ax.legend()
