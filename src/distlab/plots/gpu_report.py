"""A GPU report's figures: the collectives' bus bandwidth over sizes, and each strategy's step against the
course's models. Every figure is titled with what it was measured on, from the report's own environment."""

from __future__ import annotations

from pathlib import Path

import matplotlib

from ..predict.gpu_predictions import COMPUTE_DOMINATED
from ..results import read_result


def _pyplot():
    import matplotlib.pyplot as plt

    return plt


def report_label(report: dict) -> str:
    """What a report measured on, as every figure and line of the book names it: the GPUs, or the CPU and "no GPU"."""
    env = report["environment"]
    if env["device_kind"] != "cuda":
        return f"CPU ({env.get('cpu', 'unknown')}), {report.get('ranks', 2)} gloo ranks: no GPU"
    return f"{env['gpu_count']} x {env['gpus'][0]}"


def plot_report_bandwidth(report: dict):
    """Bus bandwidth over message size, each collective and implementation a line; None without collectives."""
    part = next((p for p in report["parts"] if p["name"] == "collectives" and p["status"] == "ran"), None)
    if part is None:
        return None
    rows = read_result(Path(report["folder"]) / part["files"][0])["metrics"]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for key in sorted({(r["collective"], r["impl"]) for r in rows}):
        mine = sorted((r for r in rows if (r["collective"], r["impl"]) == key), key=lambda r: r["bytes"])
        ax.plot([r["bytes"] for r in mine], [r["busbw_GBps"] for r in mine], marker="o", label=f"{key[0]} ({key[1]})")
    ax.set(
        xscale="log", xlabel="bytes per rank", ylabel="bus bandwidth, GB/s", title=f"Measured on {report_label(report)}"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_report_sweep(report: dict):
    """Each strategy's measured step next to the cost model with that point left out of its fit (the model's test,
    where the run has enough points) and the same model fitted to every point (a fit, labelled so), all from the
    same run's inputs; each point's label carries its tokens and its regime. None without a sweep."""
    rows = report.get("summary", {}).get("sweep", [])
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.4))
    labels = [f"{r['model']} {r.get('tokens_per_rank') or ''} {r['variant']}{_regime(r)}" for r in rows]
    y = range(len(rows))
    bars = (
        ("measured", "measured_s", {"color": "tab:green"}),
        ("cost model, this point left out of its fit", "left_out_s", {"color": "white", "edgecolor": "black",
                                                                       "hatch": "//"}),
        ("fit: every point in it, this one too", "model_s", {"color": "0.85", "edgecolor": "0.5"}),
    )  # fmt: skip
    for k, (name, key, style) in enumerate(bars):
        values = [0.0 if r.get(key) is None else 1e3 * r[key] for r in rows]  # none: too few points, or none at all
        ax.barh([i + (k - 1) * 0.27 for i in y], values, 0.27, label=name, **style)
    ax.set_yticks(list(y), labels, fontsize=7)
    ax.invert_yaxis()
    ranks = {r["ranks"] for r in rows}
    sent = ", 1 rank: nothing sent between ranks" if ranks == {1} else f", {'/'.join(map(str, sorted(ranks)))} ranks"
    ax.set(xlabel="ms per optimizer step", xscale="log")
    ax.set_title(f"Measured on {report_label(report)}{sent}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def regime(row: dict) -> str:
    """A GPU report's sweep row's regime, from its predicted compute over its fixed costs (``compute_over_fixed``)
    and the label its run gave the point: "launch-bound" where the run sized it so or the fixed costs are predicted
    to outweigh the arithmetic (it measures the host: Python, launches, hooks), "host may show" between that and
    ``COMPUTE_DOMINATED``, "compute-dominated" above, "unknown" without a prediction (no cited GPU)."""
    ratio = row.get("compute_over_fixed")
    if row.get("point") == "launch-bound" or (ratio is not None and ratio < 1):
        return "launch-bound"
    if ratio is None:
        return "unknown"
    return "host may show" if ratio < COMPUTE_DOMINATED else "compute-dominated"


def _regime(row: dict) -> str:
    return " (launch-bound)" if regime(row) == "launch-bound" else ""


def save_pictures(report: dict, folder: Path) -> list[str]:
    """Write the report's figures as PNGs into its folder; their names."""
    matplotlib.use("Agg", force=False)
    plt = _pyplot()
    names = []
    for name, draw in (("bandwidth.png", plot_report_bandwidth), ("sweep.png", plot_report_sweep)):
        fig = draw(report)
        if fig is not None:
            fig.savefig(folder / name, dpi=90)
            plt.close(fig)
            names.append(name)
    return names
