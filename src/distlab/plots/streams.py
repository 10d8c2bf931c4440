"""The stream model's figures: host costs, timelines of its scenarios, predicted speed-ups, and the
copy/compute ratio animated (the pinned-memory chapter).
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

from ..results import hardware_label
from .common import COLUMN_INCHES, MIN_TEXT_PT

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


def plot_stream_timeline(timeline, ax=None, xlim: float | None = None, label_min: float = 0.06, fontsize: float = 7):
    """One scenario of the stream model (:class:`distlab.predict.streams.Timeline`) as a Gantt chart:
    a row per lane, a bar per interval, coloured by kind; the host's reads marked; ``fontsize`` of its labels."""
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
            ax.text(start + width / 2, y, text, ha="center", va="center", fontsize=fontsize, clip_on=True)
    for read in timeline.reads:
        color = "tab:red" if read.stale else "tab:green"
        y = rows["host"]
        ax.plot([read.time * 1e3] * 2, [y - 0.45, y + 0.45], color=color, lw=2)
        said = f"read: {'stale' if read.stale else 'up to date'}"
        ax.text(read.time * 1e3, y + 0.5, said, color=color, fontsize=fontsize)
    ax.set_yticks([rows[lane] for lane in lanes], lanes)
    ax.set_ylim(-0.6, len(lanes) - 0.2)
    ax.set_xlim(0, span * 1.02)
    ax.set_title(timeline.title, fontsize=max(9, fontsize), loc="left")
    ax.tick_params(labelsize=max(fontsize, 9))
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


def animate_copy_compute_ratio(inputs, ratios: Sequence[float], batch_bytes: int, steps: int = 4, dpi: int = 60):
    """A slider over copy time / compute time: the model's timelines of three input pipelines
    at each ratio (a ``FuncAnimation``; ``.to_jshtml()`` plays it on a static page)."""
    import textwrap

    from matplotlib import animation as mpl_animation

    from ..predict import stream_scenarios

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
            stream_scenarios.training_loop(
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


# -- a copy's path, chunk by chunk, in the course's picture grammar ---------------------------------------------


def copy_path_holdings(path, t: float) -> tuple[list[str], list[list[str]], list[tuple[int, int, int]]]:
    """Where each chunk of a :class:`~distlab.predict.stream_scenarios.CopyPath` is at time ``t``, as
    :func:`~distlab.plots.plot_holdings` draws it: the rows (the places: the source, the pinned staging buffers
    for a pageable source, GPU memory), ``held[row][chunk]`` (a label, or "" for nothing) and the sends at ``t``,
    ``(row, chunk, to_row)``: a host staging copy or a DMA that is running then."""
    source = "pinned RAM" if path.pinned else "pageable RAM"
    rows = [source, "GPU memory"] if path.pinned else [source, "pinned staging\n(driver's)", "GPU memory"]
    gpu = len(rows) - 1
    held = [[f"c{k}" for k in range(len(path.chunks))]] + [["" for _ in path.chunks] for _ in rows[1:]]
    sends = []
    for k, ((start, end), staged) in enumerate(zip(path.sent, path.staged)):
        if staged is not None:
            if staged[0] <= t < staged[1]:
                sends.append((0, k, 1))  # the host thread copies chunk k into its staging buffer
            if staged[0] <= t < end:  # in its buffer from the moment the host starts filling it until it is sent
                held[1][k] = f"c{k}: buf {path.slots[k]}"
        if end <= t:
            held[gpu][k] = f"c{k}"
        elif start <= t:
            sends.append((gpu - 1, k, gpu))  # the copy engine reads chunk k over PCIe
    return rows, held, sends


def plot_copy_paths(inputs, nbytes: int = 8 << 20, caption: str = ""):
    """The idea of pinned memory in one picture, predicted by the stream model (:func:`copy_path`): a pageable
    blocking copy (the host thread stages each chunk through two pinned buffers and is blocked until the last
    lands) above a pinned ``non_blocking`` one (one DMA; the call returns at once). Each row: where the chunks
    are at one moment (the course's grammar: a red outline and arrow is a copy running then), beside the model's
    timeline of the whole copy with that moment marked."""
    import textwrap

    from ..predict.stream_scenarios import copy_path
    from .ring_animation import plot_holdings

    paths = [
        copy_path(inputs, nbytes, pinned=False, non_blocking=False),
        copy_path(inputs, nbytes, pinned=True, non_blocking=True),
    ]
    # each path: its holdings above its timeline, every panel the column's width (the text stays legible)
    fig, stacked = plt.subplots(4, 1, figsize=(COLUMN_INCHES, 8.6), gridspec_kw={"height_ratios": [3, 1.9, 2.1, 1.6]})
    axes = stacked.reshape(2, 2)
    span = max(p.timeline.end for p in paths) * 1e3
    shade = {"": 0.0, **{f"c{k}": 0.55 for k in range(len(paths[0].chunks))}}
    for (left, right), path in zip(axes, paths):
        middle = path.sent[min(1, len(path.sent) - 1)]
        t = (middle[0] + middle[1]) / 2  # a moment with the pipeline full: chunk 1 on the wire
        rows, held, sends = copy_path_holdings(path, t)
        shade.update({label: 0.35 for row in held for label in row if "buf" in label})
        columns = [
            f"chunk {k}: " + (f"{c >> 20} MiB" if c >= 1 << 20 else f"{c >> 10} KiB") for k, c in enumerate(path.chunks)
        ]
        plot_holdings(left, held, sends, columns=columns, shade=shade)
        left.set_yticks(left.get_yticks(), rows, fontsize=MIN_TEXT_PT)
        blocked = path.call.host_blocked_s * 1e3
        how = (
            "pageable, blocking `.to('cuda')`: the host thread stages every chunk, then waits"
            if not path.pinned
            else "pinned, `non_blocking=True`: one DMA reads the source; the call returns"
        )
        left.set_title(f"{how}\nat {t * 1e3:.3f} ms (red: a copy running then)", fontsize=MIN_TEXT_PT)
        path.timeline.title = f"the host is held {blocked:.3f} ms; the copy ends at {path.call.end * 1e3:.3f} ms" + (
            "" if path.pinned else "\n(purple: staging, grey: blocked)"
        )
        plot_stream_timeline(path.timeline, ax=right, xlim=span, label_min=0.09, fontsize=MIN_TEXT_PT)
        right.axvline(t * 1e3, color="tab:red", lw=1, ls="--")
        right.set_xlabel("ms (predicted)", fontsize=MIN_TEXT_PT)
    text = f"predicted by the stream model for one {nbytes >> 20} MiB host-to-device copy" + (
        "; inputs: " + caption if caption else ""
    )
    fig.suptitle("\n".join(textwrap.wrap(text, 80)), fontsize=MIN_TEXT_PT)
    fig.tight_layout()
    return axes
