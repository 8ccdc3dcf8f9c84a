"""What `mha tune` writes: the chosen settings as config.env (MHA_* variables, read unchanged by
`mha serve`, the kustomize base's ConfigMap generator and the Helm chart's `tuned` value), the
table of every candidate in Markdown, and p99 against req/s as a PNG with the target and the
Pareto front marked."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def config_env(settings: Mapping[str, str], names: Mapping[str, str], summary: Mapping[str, Any]) -> str:
    best = summary["chosen"]["best"] or {}
    verdict = "meets" if summary["meets_target"] else "does NOT meet"
    lines = [
        "# Written by `mha tune`: the settings that served the most requests per second with p99 under",
        f"# {summary['target_p99_ms']:g} ms, for shapes {', '.join('x'.join(map(str, s)) for s in summary['shapes'])}",
        f"# (measured: {best.get('throughput_rps', 0):.0f} req/s, p99 {best.get('p99_ms', 0):.2f} ms at "
        f"{best.get('concurrency', '?')} clients; it {verdict} the target).",
        "# Serve with them: `env $(grep -v '^#' config.env | xargs) mha serve ...`, or kustomize's",
        "# configMapGenerator (behavior: merge, envs: [config.env]), or helm --set-file tuned=config.env.",
    ]
    lines += [f"{names[name]}={value}" for name, value in settings.items()]
    return "\n".join(lines) + "\n"


def pareto(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (req/s, p99) points no other beats on both (more req/s and lower p99), by req/s."""
    front = [
        (rps, p99)
        for rps, p99 in points
        if not any(o_rps >= rps and o_p99 <= p99 and (o_rps, o_p99) != (rps, p99) for o_rps, o_p99 in points)
    ]
    return sorted(set(front))


def _settings_cell(settings: Mapping[str, str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in settings.items())


def markdown(summary: Mapping[str, Any]) -> str:
    target = summary["target_p99_ms"]
    lines = [
        f"# mha tune: p99 target {target:g} ms",
        "",
        "Each point is the worse of one shared channel and a connection per client.",
        "",
        "| settings | clients | req/s | p50 ms | p99 ms | within target |",
        "|---|---|---|---|---|---|",
    ]
    for row in summary["candidates"]:
        cell = _settings_cell(row["settings"])
        if row["error"]:
            lines.append(f"| {cell} | - | - | - | - | {row['error'][:120]} |")
        for p in row["points"]:
            within = "yes" if p["p99_ms"] <= target else "no"
            lines.append(
                f"| {cell} | {p['concurrency']} | {p['throughput_rps']:.0f} | {p['p50_ms']:.2f} | "
                f"{p['p99_ms']:.2f} | {within} |"
            )
    chosen = summary["chosen"]
    lines += ["", f"Chosen: {_settings_cell(chosen['settings'])}."]
    if (c := summary["confirmation"]) is not None:
        lines.append(
            f"The search's best, {_settings_cell(c['settings'])}, measured again beside the defaults, "
            f"{len(c['rounds'])} interleaved rounds at {c['concurrency']} clients: {c['rps_ratio']:.2f}x the "
            f"defaults' req/s, {c['p99_ratio']:.2f}x their p99"
            + ("." if c["holds"] else ": not better, so the defaults are kept.")
        )
    return "\n".join(lines) + "\n"


def plot(summary: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    points = [(p["throughput_rps"], p["p99_ms"]) for row in summary["candidates"] for p in row["points"]]
    front = pareto(points)
    best = summary["chosen"]["best"]
    fig, axes = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    axes.scatter([r for r, _ in points], [p for _, p in points], s=14, color="tab:gray", label="candidates")
    axes.plot([r for r, _ in front], [p for _, p in front], "o-", color="tab:blue", label="Pareto front")
    axes.axhline(summary["target_p99_ms"], color="tab:red", linestyle="--", label="p99 target")
    if best is not None:
        axes.scatter([best["throughput_rps"]], [best["p99_ms"]], s=120, marker="*", color="tab:orange", label="chosen")
    axes.set(xlabel="requests / s", ylabel="p99 (ms)", title="mha tune: p99 against req/s")
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    axes.legend()
    fig.savefig(path, dpi=100)
    plt.close(fig)
