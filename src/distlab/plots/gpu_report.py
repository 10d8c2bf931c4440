"""A GPU report's figures: the collectives' bus bandwidth over sizes, and each strategy's step against the
course's models. Every figure is titled with what it was measured on, from the report's own environment."""

from __future__ import annotations

from pathlib import Path

import matplotlib

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
    """Each strategy's measured step next to the cost model calibrated on the same run; None without a sweep."""
    rows = report.get("summary", {}).get("sweep", [])
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.2))
    labels = [f"{r['model']} {r['variant']}" for r in rows]
    y = range(len(rows))
    ax.barh([i - 0.2 for i in y], [1e3 * r["measured_s"] for r in rows], 0.4, label="measured", color="tab:green")
    ax.barh(
        [i + 0.2 for i in y],
        [0.0 if r["model_s"] is None else 1e3 * r["model_s"] for r in rows],  # the FSDP2 point has no calibration
        0.4,
        label="cost model (this run's inputs)",
        color="white",
        edgecolor="black",
        hatch="//",
    )
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="ms per optimizer step", title=f"Measured on {report_label(report)}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


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
