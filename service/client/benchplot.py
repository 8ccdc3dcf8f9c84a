"""The PNG of `mha bench --plot`: latency percentiles and throughput against concurrency.

matplotlib is an optional dependency (`pip install 'mha-serve[plot]'`), imported only here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from service.client.loadgen import CONNECTIONS


def plot_sweep(results: Sequence[Any], path: Path, title: str) -> None:
    """Two panels over concurrency: p50/p90/p99 in ms (log scale), and req/s; a line each for
    the clients on one channel and for the clients with a connection each, where both ran."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    clients = sorted({r.concurrency for r in results})
    fig, (latency, throughput) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for mode, color in zip(CONNECTIONS, ("tab:blue", "tab:green"), strict=True):
        runs = [r for r in results if r.connections == mode]
        if not runs:
            continue
        x = [r.concurrency for r in runs]
        for key, style in (("p50_ms", "o-"), ("p90_ms", "s--"), ("p99_ms", "^:")):
            label = f"{key.replace('_ms', '')}, {mode}"
            latency.plot(x, [getattr(r, key) for r in runs], style, color=color, label=label)
        throughput.plot(x, [r.throughput_rps for r in runs], "o-", color=color, label=mode)
    latency.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="latency (ms)", title="latency")
    latency.legend(fontsize="small")
    throughput.set(xscale="log", xlabel="concurrent clients", ylabel="requests / s", title="throughput")
    throughput.set_ylim(bottom=0)
    throughput.legend(fontsize="small")
    for axes in (latency, throughput):
        axes.set_xticks(clients, [str(c) for c in clients])
        axes.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
    plt.close(fig)
