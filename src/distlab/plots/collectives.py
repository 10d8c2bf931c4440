"""Collectives: bus bandwidth by implementation, the alpha-beta model against the medians, the
shard collectives next to all-reduce (the ring and FSDP chapters).
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

from ..predict.alphabeta import predict_time
from .common import _hardware_title


def _by_impl(rows: Sequence[dict]) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = {}
    for row in rows:
        grouped.setdefault(row["impl"], []).append(row)
    return grouped


# (colour, line style) of every curve the book draws: all-reduce implementations and host memory modes
LINE_STYLES = {
    "ring": ("tab:red", "o-"),
    "torch": ("black", "s--"),
    "naive_ring": ("tab:blue", "^-"),
    "reduce_broadcast": ("tab:green", "v-"),
    "pageable": ("tab:gray", "o--"),
    "pageable+non_blocking": ("tab:brown", "x:"),
    "pinned": ("tab:blue", "s-"),
    "pinned+non_blocking": ("tab:red", "^-"),
}


def _finish_panels(axes, records: Sequence[dict], ylabel: str):
    """A row of panels, one per result file: grids, the shared y label and legend, the hardware."""
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel(ylabel)
    axes[0].legend(fontsize=7)
    axes[0].figure.suptitle(_hardware_title(records), fontsize=9)
    axes[0].figure.tight_layout()
    return axes


def plot_busbw(records: Sequence[dict], axes=None):
    """Bus bandwidth against message size, one panel per bench result file."""
    if axes is None:
        _, axes = plt.subplots(1, len(records), figsize=(4.6 * len(records), 3.8), sharey=True, squeeze=False)
        axes = axes[0]
    for ax, record in zip(axes, records):
        for impl, rows in _by_impl(record["metrics"]).items():
            color, style = LINE_STYLES.get(impl, (None, "o-"))
            ax.plot([r["bytes"] for r in rows], [r["busbw_GBps"] for r in rows], style, color=color, label=impl, ms=4)
        env = record["environment"]
        ax.set(xscale="log", xlabel="message size (bytes)", title=f"{env['world_size']} ranks, {env['backend']}")
    return _finish_panels(axes, records, "bus bandwidth (GB/s)")


def plot_time_model(record: dict, fit: dict, impl: str = "ring", ax=None):
    """Measured median time of one implementation against the fitted alpha-beta model."""
    ax = ax or plt.subplots(figsize=(5, 3.8))[1]
    rows = _by_impl(record["metrics"])[impl]
    sizes = [r["bytes"] for r in rows]
    n = record["environment"]["world_size"]
    ax.errorbar(
        sizes,
        [r["time_s"] for r in rows],
        yerr=[[r["time_s"] - r["time_q1_s"] for r in rows], [r["time_q3_s"] - r["time_s"] for r in rows]],
        fmt="o",
        color="tab:red",
        label=f"{impl}: measured median (quartiles)",
    )
    model = [predict_time(fit, s, n) for s in sizes]
    ax.plot(
        sizes,
        model,
        "-",
        color="gray",
        label=f"model: alpha={fit['alpha_s'] * 1e6:.0f} us, B={fit['bandwidth_Bps'] / 1e9:.2f} GB/s",
    )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="message size (bytes)",
        ylabel="time (s)",
        title=f"{n} ranks: t = 2(n-1) alpha + 2(n-1)/n S/B",
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return ax


def plot_shard_collectives(records: Sequence[dict], axes=None):
    """Time of reduce-scatter and all-gather (torch's and the ring's) against all-reduce, by size."""
    if axes is None:
        _, axes = plt.subplots(1, len(records), figsize=(5.5 * len(records), 3.8), squeeze=False, sharey=True)
        axes = axes[0]
    styles = {
        ("all_reduce", "torch"): ("black", "s-"),
        ("reduce_scatter", "torch"): ("tab:red", "o--"),
        ("reduce_scatter", "ring"): ("tab:red", "o-"),
        ("all_gather", "torch"): ("tab:blue", "^--"),
        ("all_gather", "ring"): ("tab:blue", "^-"),
    }
    for ax, record in zip(axes, records):
        for (collective, impl), (color, style) in styles.items():
            rows = [r for r in record["metrics"] if r["collective"] == collective and r["impl"] == impl]
            ax.plot(
                [r["bytes"] for r in rows],
                [1e3 * r["time_s"] for r in rows],
                style,
                color=color,
                label=f"{collective} ({impl})",
            )
        env = record["environment"]
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="bytes of the full tensor",
            title=f"{env['world_size']} ranks, {env['backend']}",
        )
    return _finish_panels(axes, records, "median time (ms)")
