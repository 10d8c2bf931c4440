"""DDP's step: time per wrapper, and one profiled step as a timeline (the DDP chapter)."""

from __future__ import annotations

import matplotlib.pyplot as plt

from ..results import hardware_label


def plot_step_times(record: dict, ax=None):
    """Median forward+backward time per variant (bars) with quartiles, from a ddp_step_bench result."""
    ax = ax or plt.subplots(figsize=(7, 3.6))[1]
    rows = record["metrics"]["variants"]
    names = [r["variant"] for r in rows]
    medians = [1e3 * r["time_s"] for r in rows]
    spread = [
        [1e3 * (r["time_s"] - r["time_q1_s"]) for r in rows],
        [1e3 * (r["time_q3_s"] - r["time_s"]) for r in rows],
    ]
    colors = [
        "tab:gray"
        if n.startswith("local")
        else "black"
        if n.startswith("torch")
        else "tab:blue"
        if n.startswith("Naive")
        else "tab:red"
        for n in names
    ]
    bars = ax.barh(names, medians, xerr=spread, color=colors, capsize=3)
    ax.bar_label(bars, labels=[f"{m:.1f} ms" for m in medians], padding=8, fontsize=8)
    ax.set_xlim(0, max(medians) * 1.3)
    ax.invert_yaxis()
    env = record["environment"]
    ax.set(
        xlabel="forward + backward, median of slowest rank (ms)",
        title=(
            f"{record['config']['model']}, batch {record['config']['batch_size']}/rank, {env['world_size']} "
            f"ranks - {hardware_label(env)}"
        ),
    )
    ax.title.set_fontsize(9)
    return ax


def plot_timeline(record: dict, ax=None):
    """The profiled bucketed step: compute and communication intervals on two lanes."""
    ax = ax or plt.subplots(figsize=(9, 2.6))[1]
    lanes = {"compute": (1, "tab:blue"), "communication": (0, "tab:red")}
    for lane, (y, color) in lanes.items():
        spans = [(i["start_ms"], max(i["dur_ms"], 0.05)) for i in record["metrics"]["timeline"] if i["lane"] == lane]
        ax.broken_barh(spans, (y - 0.35, 0.7), facecolors=color, edgecolors="white", linewidth=0.3)
    forward = [i for i in record["metrics"]["timeline"] if i["name"] == "forward"]
    if forward:
        end = forward[0]["start_ms"] + forward[0]["dur_ms"]
        ax.axvline(end, color="gray", ls=":", lw=1)
        ax.text(end, 1.45, " backward starts", fontsize=8, color="gray", va="bottom")
    ax.set_yticks([lanes[lane][0] for lane in lanes], ["compute", "all-reduce"])
    ax.set_ylim(-0.6, 1.8)
    env = record["environment"]
    ax.set(
        xlabel="ms since the step began",
        title=(
            f"one BucketedDDP step ({record['metrics']['timeline_bucket_cap_mb']:g} MB buckets), rank 0 of "
            f"{env['world_size']} - {hardware_label(env)}"
        ),
    )
    ax.title.set_fontsize(9)
    return ax
