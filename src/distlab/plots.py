"""Every figure the book and the labs draw. Each takes result records
(as :func:`distlab.results.read_result` returns them) and labels the
hardware from the records' own environment."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

from .bench.allreduce import predict_time
from .bench.transfer import MODES
from .config import TrainConfig
from .results import hardware_label


def run_label(record: dict) -> str:
    """A training run as a legend entry: strategy, ranks, and what differs from the defaults."""
    cfg, default = record["config"], TrainConfig()
    ranks = record["environment"]["world_size"]
    extras = [cfg["data"]["loader"]]
    if cfg["training"]["batch_size"] != default.training.batch_size:
        extras.append(f"batch {cfg['training']['batch_size']}")
    if cfg["precision"]["dtype"] != default.precision.dtype:
        extras.append(cfg["precision"]["dtype"])
    return f"{cfg['parallel']['strategy']} ({ranks} rank{'s' if ranks > 1 else ''}, {', '.join(extras)})"


def _hardware_title(records: Sequence[dict]) -> str:
    labels = sorted({hardware_label(r["environment"]) for r in records})
    return "measured on " + "; ".join(labels)


def plot_loss_curves(records: Sequence[dict], ax=None, smooth: int = 1):
    """Training loss per optimizer step, one line per run, epochs joined."""
    ax = ax or plt.subplots(figsize=(7, 4))[1]
    for record, style in zip(records, ["-", "--", ":", "-."] * len(records)):
        losses = [loss for epoch in record["metrics"]["epochs"] for loss in epoch["step_loss"]]
        if smooth > 1:
            losses = [
                sum(losses[max(0, i - smooth + 1) : i + 1]) / len(losses[max(0, i - smooth + 1) : i + 1])
                for i in range(len(losses))
            ]
        ax.plot(range(1, len(losses) + 1), losses, style, label=run_label(record))  # styles keep identical runs visible
    ax.set(xlabel="optimizer step", ylabel="training loss (mean over ranks)", yscale="log")
    ax.set_title(_hardware_title(records), fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    return ax


def plot_throughput(records: Sequence[dict], ax=None):
    """Samples per second of each run's last epoch, as bars with the value written on them."""
    ax = ax or plt.subplots(figsize=(7, 3.5))[1]
    names = [run_label(r) for r in records]
    values = [r["metrics"]["epochs"][-1]["samples_per_s"] for r in records]
    bars = ax.barh(names, values, color="tab:blue")
    ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], padding=3)
    ax.set(xlabel="training samples / s (last epoch)")
    ax.set_xlim(0, max(values) * 1.25)
    ax.invert_yaxis()
    ax.set_title(_hardware_title(records), fontsize=9)
    return ax


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
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("bus bandwidth (GB/s)")
    axes[0].legend(fontsize=8)
    axes[0].figure.suptitle(_hardware_title(records), fontsize=9)
    axes[0].figure.tight_layout()
    return axes


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


def plot_copy_bandwidth(record: dict, rank: int = 0, axes=None):
    """GB/s against copy size, host-to-device and device-to-host, one line per memory mode."""
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    measured = record["metrics"]["ranks"][rank]
    for ax, direction in zip(axes, ("h2d", "d2h")):
        for mode in MODES:
            color, style = LINE_STYLES[mode]
            rows = [r for r in measured["bandwidth"] if r["direction"] == direction and r["mode"] == mode]
            ax.plot([r["bytes"] for r in rows], [r["GBps"] for r in rows], style, color=color, label=mode, ms=4)
        ax.set(
            xscale="log", xlabel="bytes per copy", title={"h2d": "host to device", "d2h": "device to host"}[direction]
        )
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("GB/s (median, CUDA events)")
    axes[0].legend(fontsize=8)
    axes[0].figure.suptitle(f"rank {rank}: {measured['gpu']} - {hardware_label(record['environment'])}", fontsize=9)
    axes[0].figure.tight_layout()
    return axes


def plot_overlap_timeline(record: dict, rank: int = 0, axes=None):
    """Copy and compute intervals per batch: serial above, overlapped below."""
    overlap = record["metrics"]["ranks"][rank]["overlap"]
    if axes is None:
        _, axes = plt.subplots(2, 1, figsize=(10, 3.6), sharex=True)
    for ax, key in zip(axes, ("serial", "overlapped")):
        for lane, y, color in (("copy", 1, "tab:orange"), ("compute", 0, "tab:blue")):
            spans = [(i["start_ms"], i["dur_ms"]) for i in overlap["timeline"][key] if i["lane"] == lane]
            ax.broken_barh(spans, (y - 0.35, 0.7), facecolors=color, edgecolors="white")
        ax.set_yticks([1, 0], ["copy H2D", "compute"])
        ax.set_title(
            f"{key}: {overlap[f'{key}_s'] * 1e3:.1f} ms for {overlap['batches']} batches of "
            f"{overlap['batch_bytes'] >> 20} MB",
            fontsize=9,
        )
    axes[-1].set_xlabel("ms (CUDA events)")
    axes[0].figure.tight_layout()
    return axes
