"""Every figure the book and the labs draw. Each takes result records
(as :func:`distlab.results.read_result` returns them) and labels the
hardware from the records' own environment."""

from __future__ import annotations

import re
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


# -- the host side, measured on a CPU, and the stream model's predictions ----------------------------------------

# colour of every kind of interval the stream model draws
STREAM_COLORS = {
    "work": "tab:green",
    "api": "black",
    "stage": "tab:purple",
    "wait": "#dddddd",
    "copy": "tab:orange",
    "kernel": "tab:blue",
}


def plot_host_costs(record: dict, axes=None):
    """A :mod:`distlab.bench.host` result: page-locking cost per size (left) and
    host copy rates (right), labelled with the CPU that measured them."""
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    metrics = record["metrics"]
    rows = metrics["page_lock"]
    kinds = [
        ("first_touch", "first touch (page faults)", "tab:gray"),
        ("first_lock", "mlock, first call (faults + lock)", "tab:red"),
        ("steady_lock", "mlock, steady state (lock only)", "tab:blue"),
        ("unlock", "munlock", "tab:cyan"),
    ]
    width = 0.8 / len(kinds)
    for k, (key, label, color) in enumerate(kinds):
        xs = [i + (k - 1.5) * width for i, row in enumerate(rows) if key in row]
        present = [row for row in rows if key in row]
        if not present:
            continue
        ms = [1e3 * r[key]["time_s"] for r in present]
        err = [
            [1e3 * (r[key]["time_s"] - r[key]["time_q1_s"]) for r in present],
            [1e3 * (r[key]["time_q3_s"] - r[key]["time_s"]) for r in present],
        ]
        axes[0].bar(xs, ms, width, yerr=err, color=color, label=label, capsize=2)
    axes[0].set_xticks(range(len(rows)), [f"{r['bytes'] >> 20} MiB" for r in rows])
    axes[0].set(yscale="log", ylabel="ms (median, quartiles)", title="page-locking a buffer")
    axes[0].legend(fontsize=7)
    axes[0].grid(alpha=0.3, axis="y", which="both")
    staging = metrics["staging_copy"]
    chunk_mib = [r["chunk_bytes"] / (1 << 20) for r in staging]
    axes[1].plot(chunk_mib, [r["GBps"] for r in staging], "o-", color="tab:purple", label="into one staging buffer")
    plain = metrics["memory_copy"]
    axes[1].axhline(plain["GBps"], color="black", ls="--", label=f"buffer to buffer, {plain['bytes'] >> 20} MiB")
    axes[1].set(
        xscale="log",
        xlabel="staging buffer",
        ylabel="GB/s copied (median)",
        title=f"memcpy of {staging[0]['bytes'] >> 20} MiB on one thread",
    )
    axes[1].set_xticks(chunk_mib, [f"{m:g} MiB" if m >= 1 else f"{m * 1024:g} KiB" for m in chunk_mib])
    axes[1].minorticks_off()
    axes[1].set_ylim(0, max(max(r["GBps"] for r in staging), plain["GBps"]) * 1.25)
    axes[1].legend(fontsize=8)
    axes[1].grid(alpha=0.3, which="both")
    where = hardware_label(record["environment"]).removesuffix(" (no backend)")
    axes[0].figure.suptitle("measured on " + where, fontsize=9)
    axes[0].figure.tight_layout()
    return axes


def plot_stream_timeline(timeline, ax=None, xlim: float | None = None, label_min: float = 0.06):
    """One scenario of the stream model (:class:`distlab.streams.Timeline`) as a Gantt chart:
    a row per lane, a bar per interval, coloured by kind; the host's reads marked."""
    ax = ax or plt.subplots(figsize=(10, 2.2))[1]
    lanes = timeline.lanes
    rows = {lane: len(lanes) - 1 - i for i, lane in enumerate(lanes)}
    span = xlim or timeline.end * 1e3
    for interval in timeline.intervals:
        y = rows[interval.lane]
        start, width = interval.start * 1e3, interval.duration * 1e3
        color = STREAM_COLORS.get(interval.kind, "tab:gray")
        ax.broken_barh([(start, width)], (y - 0.35, 0.7), facecolors=color, edgecolors="white", linewidth=0.4)
        if width > label_min * span and interval.kind != "api":
            text = interval.label if interval.kind != "wait" else "wait"
            ax.text(start + width / 2, y, text, ha="center", va="center", fontsize=7, clip_on=True)
    for read in timeline.reads:
        color = "tab:red" if read.stale else "tab:green"
        y = rows["host"]
        ax.plot([read.time * 1e3] * 2, [y - 0.45, y + 0.45], color=color, lw=2)
        ax.text(read.time * 1e3, y + 0.5, f"read: {'stale' if read.stale else 'up to date'}", color=color, fontsize=7)
    ax.set_yticks([rows[lane] for lane in lanes], lanes)
    ax.set_ylim(-0.6, len(lanes) - 0.2)
    ax.set_xlim(0, span * 1.02)
    ax.set_title(timeline.title, fontsize=9, loc="left")
    ax.grid(alpha=0.3, axis="x")
    return ax


def stream_legend(fig) -> None:
    """The colour key of :func:`plot_stream_timeline`, along the bottom of the figure."""
    from matplotlib.patches import Patch

    names = {
        "work": "host work",
        "api": "API call",
        "stage": "host staging copy",
        "wait": "host blocked",
        "copy": "DMA copy",
        "kernel": "kernel",
    }
    handles = [Patch(color=STREAM_COLORS[k], label=v) for k, v in names.items()]
    fig.legend(handles=handles, fontsize=7, ncol=6, loc="lower center", frameon=False)


def plot_stream_timelines(timelines: Sequence, caption: str = "", shared: bool = True, height: float = 1.6):
    """Several scenarios of the stream model stacked, on one time axis, under one caption
    (which should say *predicted by the model* and name its inputs)."""
    import textwrap

    lines = textwrap.wrap(caption, 150) if caption else []
    total = height * len(timelines) + 0.75 + 0.15 * len(lines)
    fig, axes = plt.subplots(len(timelines), 1, figsize=(10, total), sharex=shared, squeeze=False)
    axes = axes[:, 0]
    span = max(t.end for t in timelines) * 1e3 if shared else None
    for ax, timeline in zip(axes, timelines):
        plot_stream_timeline(timeline, ax=ax, xlim=span)
    axes[-1].set_xlabel("ms (predicted)")
    stream_legend(fig)
    if lines:
        fig.suptitle("\n".join(lines), fontsize=8)
    fig.tight_layout(rect=(0, 0.3 / total, 1, 1))
    return axes


def plot_speedup_curves(
    xs: Sequence[float],
    curves: dict,
    band=(1.10, 1.20),
    ax=None,
    caption: str = "",
    xlabel: str = "copy time of one batch over compute time of one step",
    xscale: str = "log",
    ylabel: str = "speed-up over the baseline",
    styles: Sequence[tuple[str, str]] = (
        (":", "tab:gray"),
        ("--", "tab:brown"),
        ("-", "tab:blue"),
        ("-", "tab:red"),
        ("-", "tab:green"),
    ),
):
    """Predicted speed-ups against one scenario parameter (by default the copy/compute ratio),
    one line per input pipeline, with the band a claim states (the notes' 10-20 %) shaded."""
    import textwrap

    ax = ax or plt.subplots(figsize=(8, 4))[1]
    for (name, values), (style, color) in zip(curves.items(), list(styles) * 2):
        ax.plot(xs, values, style, color=color, label=name, lw=1.6)
    if band:
        low, high = (100 * (b - 1) for b in band)
        ax.axhspan(*band, color="gold", alpha=0.35, label=f"{low:.0f}-{high:.0f} % faster")
    ax.set(xscale=xscale, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    title = "predicted by the model" + (": " + caption if caption else "")
    ax.set_title("\n".join(textwrap.wrap(title, 110)), fontsize=8)
    return ax


def plot_measured_vs_predicted_bandwidth(record: dict, predicted: Sequence[dict], rank: int = 0, caption: str = ""):
    """Host-to-device GB/s (left) and the time the call blocked the host (right) against
    copy size: a GPU result's measurements as markers, the model's predictions as lines."""
    import textwrap

    _, axes = plt.subplots(1, 2, figsize=(11, 4))
    measured = record["metrics"]["ranks"][rank]
    for mode in MODES:
        color, style = LINE_STYLES[mode]
        rows = [r for r in measured["bandwidth"] if r["direction"] == "h2d" and r["mode"] == mode]
        guess = [r for r in predicted if r["mode"] == mode]
        for ax, key in zip(axes, ("GBps", "host_blocked_s")):
            ax.plot(
                [r["bytes"] for r in rows],
                [r[key] for r in rows],
                style[0],
                color=color,
                ms=5,
                ls="none",
                label=f"{mode}: measured",
            )
            ax.plot(
                [r["bytes"] for r in guess],
                [r[key] for r in guess],
                "-",
                color=color,
                alpha=0.6,
                lw=1.2,
                label=f"{mode}: predicted",
            )
    axes[0].set(xscale="log", xlabel="bytes per copy", ylabel="GB/s (CUDA events)", title="host to device")
    axes[1].set(
        xscale="log",
        yscale="log",
        xlabel="bytes per copy",
        ylabel="s the call blocked the host",
        title="how long the call blocked",
    )
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=6, ncol=2)
    head = f"rank {rank}: {measured['gpu']} - measured on {hardware_label(record['environment'])}"
    text = head + ("; lines predicted by the model: " + caption if caption else "")
    axes[0].figure.suptitle("\n".join(textwrap.wrap(text, 160)), fontsize=8)
    axes[0].figure.tight_layout()
    return axes


def animate_copy_compute_ratio(inputs, ratios: Sequence[float], batch_bytes: int, steps: int = 4, dpi: int = 60):
    """A slider over copy time / compute time: the model's timelines of three input pipelines
    at each ratio (a ``FuncAnimation``; ``.to_jshtml()`` plays it on a static page)."""
    import textwrap

    from matplotlib import animation as mpl_animation

    from . import streams

    fig, axes = plt.subplots(3, 1, figsize=(9, 5), sharex=True, dpi=dpi)
    copy_s = batch_bytes / (inputs.link_GBps * 1e9)
    variants = [
        ("pageable", dict(pinned=False, non_blocking=False)),
        ("pinned + non_blocking, one stream", dict(pinned=True, non_blocking=True)),
        ("pinned + non_blocking, side stream", dict(pinned=True, non_blocking=True, side_stream=True)),
    ]

    def draw(i: int):
        ratio = ratios[i]
        timelines = [
            streams.training_loop(
                inputs, batch_bytes=batch_bytes, compute_s=copy_s / ratio, steps=steps, title=name, **options
            )
            for name, options in variants
        ]
        span = max(t.end for t in timelines) * 1e3
        base = timelines[0].end
        for ax, timeline in zip(axes, timelines):
            ax.clear()
            timeline.title = (
                f"{timeline.title}: {steps} steps in {timeline.end * 1e3:.1f} ms ({base / timeline.end:.2f}x)"
            )
            plot_stream_timeline(timeline, ax=ax, xlim=span, label_min=0.08)
        axes[-1].set_xlabel("ms (predicted)")
        inputs_line = "\n".join(textwrap.wrap("inputs: " + inputs.describe(), 140))
        fig.suptitle(f"predicted by the model: copy / compute = {ratio:.2g}\n{inputs_line}", fontsize=8)
        return []

    draw(0)
    fig.tight_layout()
    anim = mpl_animation.FuncAnimation(fig, draw, frames=len(ratios), interval=700, blit=False)
    plt.close(fig)
    return anim


def plot_transfer_against_model(record: dict, rank: int = 0) -> tuple[list, str]:
    """A GPU result of :mod:`distlab.bench.transfer` next to the stream model's predictions from
    inputs measured in that same result: the figures, and a Markdown summary that labels every
    number measured or predicted."""
    from . import streams

    prediction = streams.predict_transfer_result(record, rank)
    measured_on = hardware_label(record["environment"])
    if prediction is None:
        return [], f"*{measured_on}: this result holds no host-to-device bandwidth rows to compare with.*"
    inputs = prediction["inputs"]
    figures = [plot_measured_vs_predicted_bandwidth(record, prediction["bandwidth"], rank, inputs.describe())[0].figure]
    gpu = record["metrics"]["ranks"][rank]
    lines = [f"**{gpu['gpu']}, rank {rank}** (measured on {measured_on}; predicted from: {inputs.describe()})", ""]
    if "overlap" in prediction:
        o = prediction["overlap"]
        figures.append(plot_overlap_timeline(record, rank)[0].figure)
        caption = (
            f"predicted by the model from the measured copy ({o['copy_s'] * 1e3:.2f} ms) and compute "
            f"({o['compute_s'] * 1e3:.2f} ms) of one batch"
        )
        figures.append(plot_stream_timelines([o["serial"], o["overlapped"]], caption=caption)[0].figure)
        lines.append(
            f"- side-stream overlap: measured {o['measured_speedup']:.2f}x, predicted {o['predicted_speedup']:.2f}x"
        )
    if "hazard" in prediction:
        h = prediction["hazard"]
        word = lambda stale: "stale" if stale else "up to date"
        lines.append(
            f"- early device-to-host read: measured {word(h['measured_stale'])}, predicted {word(h['predicted_stale'])}"
        )
    cost = max(gpu.get("pinning_cost") or [], key=lambda r: r["bytes"], default=None)
    if cost and "first_pin_memory_s" in cost:
        lines.append(
            f"- `pin_memory()` of {cost['bytes'] >> 20} MiB, measured: {cost['first_pin_memory_s'] * 1e3:.1f} ms on "
            f"the first call, {cost['cached_pin_memory_s'] * 1e3:.1f} ms from the cache, against "
            f"{cost['pageable_clone_s'] * 1e3:.1f} ms for a pageable clone"
        )
    loader = record["metrics"].get("loader") or []
    if loader:
        base = next(r for r in loader if r["variant"] == "pin_memory off, non_blocking off")["samples_per_s"]
        predicted = prediction.get("loader", {}).get("predicted", {})
        names = {
            "pin_memory off, non_blocking on": "pageable + non_blocking",
            "pin_memory on, non_blocking off": "pinned",
            "pin_memory on, non_blocking on": "pinned + non_blocking",
        }
        lines += [
            "",
            "| input pipeline | measured samples/s | measured speed-up | predicted speed-up |",
            "|---|---|---|---|",
        ]
        for row in loader:
            guess = predicted.get(names.get(row["variant"], ""))
            guessed = "" if guess is None else f"{guess:.2f}x"
            lines.append(
                f"| {row['variant']} | {row['samples_per_s']:,.0f} | {row['samples_per_s'] / base:.2f}x | {guessed} |"
            )
    return figures, "\n".join(lines)


MEMORY_COLORS = {
    "parameters": "tab:blue",
    "gradients": "tab:orange",
    "optimizer_state": "tab:green",
    "gathered": "tab:red",
    "activations": "tab:purple",
    "other": "tab:gray",
}


def _variant(record: dict, name: str) -> dict:
    """A step-bench row by strategy, or an options-bench row by variant."""
    return next(row for row in record["metrics"]["variants"] if row.get("strategy", row.get("variant")) == name)


def plot_memory_timeline(record: dict, strategy: str, rank: int = 0, ax=None, title: str | None = None, legend=True):
    """One observed optimizer step of ``strategy`` from a step-bench result: the bytes
    this rank holds by category, stacked, at every sample of the tracker."""
    ax = ax or plt.subplots(figsize=(7, 3.8))[1]
    timeline = _variant(record, strategy)["memory"]["ranks"][rank]["timeline"]
    stacks = [[sample[name] / 2**20 for sample in timeline] for name in MEMORY_COLORS]
    labels = [name.replace("_", " ") for name in MEMORY_COLORS]
    ax.stackplot(range(len(timeline)), stacks, labels=labels, colors=list(MEMORY_COLORS.values()), step="post")
    for i, sample in enumerate(timeline):
        starts_phase = i > 0 and sample["phase"] != timeline[i - 1]["phase"]
        if starts_phase and sample["phase"] in ("forward", "backward", "optimizer"):
            ax.axvline(i, color="black", lw=0.6, ls=":")
            ax.text(i, 0.98, f" {sample['phase']}", fontsize=7, va="top", transform=ax.get_xaxis_transform())
    n = record["environment"]["world_size"]
    ax.set(xlabel="samples in order (every allocation peak and phase change)", ylabel="MiB held by this rank")
    ax.set_title(title or f"{strategy}, rank {rank} of {n}", fontsize=9)
    if legend:
        ax.legend(fontsize=7, loc="center right")
    return ax


def plot_state_per_rank(records_by_ranks: dict, strategies: Sequence[str], predict, ax=None):
    """Bytes of parameters + gradients + optimizer state per rank against the number of
    ranks: measured (points, rank 0) and ``predict(strategy, n)`` (lines)."""
    ax = ax or plt.subplots(figsize=(7, 4))[1]
    ranks = sorted(records_by_ranks)
    for strategy, color in zip(strategies, plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        measured = []
        for n in ranks:
            held = _variant(records_by_ranks[n], strategy)["memory"]["ranks"][0]
            measured.append((held["parameters"] + held["gradients"] + held["optimizer_state"]) / 2**20)
        predicted = [sum(predict(strategy, n).values()) / 2**20 for n in ranks]
        ax.plot(ranks, predicted, "-", color=color, alpha=0.6)
        ax.plot(ranks, measured, "o", color=color, label=strategy)
    ax.set(xlabel="ranks", ylabel="MiB per rank (parameters + gradients + optimizer state)", xticks=ranks)
    env = records_by_ranks[ranks[0]]["environment"]
    ax.set_title(f"measured (points) and predicted (lines) - {hardware_label(env)}", fontsize=8)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
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


def plot_fsdp_options(records: Sequence[dict], baseline: str = "fsdp"):
    """For each FSDP2 option (an ``fsdp_options`` result per world size): rank 0's
    peak memory, split by what it held at that moment, and the step time
    (median, quartiles as whiskers), each variant against ``baseline``."""
    fig, axes = plt.subplots(len(records), 2, figsize=(13, 0.45 * 11 * len(records) + 0.6), squeeze=False)
    for (ax_memory, ax_time), record in zip(axes, records):
        rows = record["metrics"]["variants"]
        names = [row["variant"] for row in rows]
        positions = list(range(len(rows)))[::-1]
        left = [0.0] * len(rows)
        for category, color in MEMORY_COLORS.items():
            values = [row["memory"]["ranks"][0]["peak_by_category"].get(category, 0) / 2**20 for row in rows]
            ax_memory.barh(positions, values, left=left, color=color, label=category.replace("_", " "))
            left = [a + b for a, b in zip(left, values)]
        medians = [1e3 * row["time_s"] for row in rows]
        whiskers = [
            [m - 1e3 * row["time_q1_s"] for m, row in zip(medians, rows)],
            [1e3 * row["time_q3_s"] - m for m, row in zip(medians, rows)],
        ]
        colors = ["tab:gray" if name in ("ddp", "zero3") else "tab:blue" for name in names]
        ax_time.barh(positions, medians, xerr=whiskers, color=colors, capsize=2)
        label_at = {ax_memory: left, ax_time: [1e3 * row["time_q3_s"] for row in rows]}
        for ax, values in ((ax_memory, left), (ax_time, medians)):
            base = values[names.index(baseline)] if baseline in names else None
            ax.set_yticks(positions, names, fontsize=8)
            if base:
                ax.axvline(base, color="black", lw=0.7, ls=":")
                for y, value, x in zip(positions, values, label_at[ax]):
                    ax.text(x, y, f" {value / base:.2f}x", va="center", fontsize=7)
        env = record["environment"]
        ax_memory.set(xlabel="MiB held by rank 0 at its peak")
        ax_time.set(xlabel="step time (ms), slowest rank, median and quartiles")
        ax_memory.set_title(f"{env['world_size']} ranks: peak memory per rank", fontsize=9)
        ax_time.set_title(f"{env['world_size']} ranks: time of one optimizer step", fontsize=9)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=len(labels))
    fig.suptitle(f"measured on {hardware_label(records[0]['environment'])}", fontsize=9)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig


def jshtml(animation, default_mode: str = "once") -> str:
    """An animation as HTML and JavaScript that plays on a static page, offline.
    matplotlib's player links Font Awesome 4.4 from a CDN for its button icons;
    the book's theme ships Font Awesome 6, which draws them, so the link goes."""
    html = animation.to_jshtml(default_mode=default_mode)
    return re.sub(r'<link rel="stylesheet"\s+href="https://[^"]*font-awesome[^"]*">', "", html)


SWEEP_COLORS = {"ddp": "C0", "zero1": "C1", "zero2": "C2", "zero3": "C3", "fsdp": "C4", "fsdp-no-reshard": "C5"}


def plot_sweep(records: Sequence[dict]):
    """The sweep, measured: step time, peak memory per rank and bytes sent per rank per step,
    for every strategy and preset, one column per world size (one result file each)."""
    records = sorted(records, key=lambda r: r["environment"]["world_size"])
    fig, axes = plt.subplots(3, len(records), figsize=(4.2 * len(records), 8.5), squeeze=False)
    measures = (
        ("step time (ms, slowest rank)", lambda row: 1e3 * row["time_s"]),
        ("peak memory per rank (MiB)", lambda row: max(r["peak"] for r in row["memory"]["ranks"]) / 2**20),
        ("MiB sent per rank per step", lambda row: sum(t["bytes_sent"] for t in row["traffic"].values()) / 2**20),
    )
    for column, record in zip(axes.T, records):
        presets = record["metrics"]["presets"]
        variants = [row["variant"] for row in presets[0]["variants"]]
        width = 0.8 / len(variants)
        for ax, (label, value) in zip(column, measures):
            for i, variant in enumerate(variants):
                heights = [value(next(r for r in p["variants"] if r["variant"] == variant)) for p in presets]
                xs = [k + (i - (len(variants) - 1) / 2) * width for k in range(len(presets))]
                ax.bar(xs, heights, width, color=SWEEP_COLORS.get(variant), label=variant)
            ax.set_xticks(range(len(presets)), [p["model"] for p in presets], fontsize=8)
            if any(patch.get_height() > 0 for patch in ax.patches):
                ax.set_yscale("log")
            else:
                ax.text(0.5, 0.5, "nothing to send on one rank", transform=ax.transAxes, ha="center", fontsize=8)
            ax.set_ylabel(label, fontsize=8)
            ax.grid(alpha=0.3, axis="y")
        column[0].set_title(f"{record['environment']['world_size']} rank(s)", fontsize=9)
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.suptitle(_hardware_title(records), fontsize=9)
    fig.tight_layout()
    return fig


def plot_model_against_sweep(rows: Sequence[dict], time_band: float = 0.15, memory_band: float = 0.05):
    """The cost model's step time and peak memory (y) against the measured ones (x), every point of the
    sweep; the shaded bands are the model's goals (within 15 % in time, 5 % in memory)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    markers = {1: "o", 2: "s", 4: "^", 8: "D"}
    for ax, (measured, predicted, band, scale, unit) in zip(
        axes,
        (("measured_s", "predicted_s", time_band, 1e3, "step time (ms)"),
         ("measured_peak", "predicted_peak", memory_band, 2**-20, "peak memory per rank (MiB)")),
    ):  # fmt: skip
        xs = [r[measured] * scale for r in rows]
        low, high = min(xs) / 1.5, max(xs) * 1.5
        line = [low, high]
        ax.fill_between(line, [v * (1 - band) for v in line], [v * (1 + band) for v in line], color="0.9")
        ax.plot(line, line, color="0.5", lw=0.8)
        for r, x in zip(rows, xs):
            ax.scatter(
                x,
                r[predicted] * scale,
                color=SWEEP_COLORS.get(r["variant"]),
                marker=markers.get(r["world_size"], "x"),
                s=22,
            )
        ax.set(xscale="log", yscale="log", xlabel=f"measured {unit}", ylabel=f"predicted {unit}", xlim=line, ylim=line)
        ax.set_title(f"within {band:.0%}: shaded", fontsize=9)
        ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], color=c, marker="o", ls="", label=v) for v, c in SWEEP_COLORS.items()]
    handles += [plt.Line2D([], [], color="0.3", marker=m, ls="", label=f"{n} rank(s)") for n, m in markers.items()
                if any(r["world_size"] == n for r in rows)]  # fmt: skip
    axes[1].legend(handles=handles, fontsize=7, ncol=2, loc="upper left")
    fig.tight_layout()
    return fig


def plot_gpu_predictions(rows: Sequence[dict]):
    """PREDICTED, from cited specifications: tokens per second (a bar from no overlap to the best
    overlap) and memory per GPU against what the GPU holds, per system, preset and strategy."""
    systems = list(dict.fromkeys(r["system"] for r in rows))
    fig, axes = plt.subplots(2, len(systems), figsize=(4.4 * len(systems), 6.5), squeeze=False)
    for column, system in zip(axes.T, systems):
        mine = [r for r in rows if r["system"] == system]
        models = list(dict.fromkeys(r["model"] for r in mine))
        variants = list(dict.fromkeys(r["variant"] for r in mine))
        width = 0.8 / len(variants)
        for i, variant in enumerate(variants):
            chosen = [next(r for r in mine if r["model"] == m and r["variant"] == variant) for m in models]
            xs = [k + (i - (len(variants) - 1) / 2) * width for k in range(len(models))]
            low = [r["tokens_per_s_no_overlap"] for r in chosen]
            high = [r["tokens_per_s_best_overlap"] for r in chosen]
            color = SWEEP_COLORS.get(variant)
            column[0].bar(xs, [h - lo for h, lo in zip(high, low)], width, bottom=low, color=color, label=variant)
            column[0].scatter(xs, low, color=color, marker="_", s=60)
            column[1].bar(xs, [r["peak_bytes"] / 2**30 for r in chosen], width, color=color, hatch="//", alpha=0.8)
        usable = mine[0]["usable_memory_bytes"] / 2**30
        column[1].axhline(usable, color="k", lw=1, ls="--", label=f"{usable:.1f} GiB per GPU")
        for ax in column:
            ax.set_xticks(range(len(models)), models, fontsize=8)
            ax.grid(alpha=0.3, axis="y")
        column[0].set(yscale="log", ylabel="tokens/s, all GPUs (PREDICTED)")
        column[1].set(yscale="log", ylabel="peak GiB per GPU (PREDICTED)")
        column[0].set_title(f"{mine[0]['gpus']}x {mine[0]['gpu']}", fontsize=9)
        column[1].legend(fontsize=7)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("PREDICTED by the cost model from cited specifications; not measured", fontsize=10, color="C3")
    fig.tight_layout()
    return fig
