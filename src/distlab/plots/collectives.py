"""Collectives: bus bandwidth by implementation, the alpha-beta model against the medians, the bytes each
all-reduce sends per rank, the shard collectives next to all-reduce, a flat buffer's shards through
reduce-scatter and all-gather, and one step's collectives by strategy (the ring and ZeRO chapters).
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from ..predict.alphabeta import predict_time
from ..predict.costmodel import RING_FACTOR
from .common import COLUMN_INCHES, MIN_TEXT_PT, _hardware_title
from .ring_animation import plot_holdings


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


ALL_REDUCE_NAMES = {
    "ring": "ring: reduce-scatter + all-gather",
    "naive_ring": "whole tensor round the ring",
    "reduce_broadcast": "reduce, then broadcast (rank 0)",
}


def bytes_per_rank(records: dict[int, dict], size: int | None = None) -> dict[int, dict[str, int]]:
    """``{ranks: {impl: bytes rank 0 sent}}`` for one all-reduce of ``size`` bytes (each record's largest by
    default), as the all-reduce bench counted them (``bytes_sent_per_rank``; rank 0 writes the record)."""
    sent = {}
    for n, record in sorted(records.items()):
        rows = [r for r in record["metrics"] if r["impl"] in ALL_REDUCE_NAMES]
        at = size or max(r["bytes"] for r in rows)
        sent[n] = {r["impl"]: r["bytes_sent_per_rank"] for r in rows if r["bytes"] == at} | {"size": at}
    return sent


def plot_bytes_per_rank(records: dict[int, dict], size: int | None = None, ax=None):
    """MEASURED (counted as they ran): the bytes rank 0 sent for one all-reduce of S bytes, in units of S, for
    each hand-written all-reduce at each world size of ``records`` (all-reduce bench results by ranks). The
    ring's 2(n-1)/n stays under 2; the other two send (n-1) S from rank 0."""
    ax = ax or plt.subplots(figsize=(6.4, 3.6))[1]
    sent = bytes_per_rank(records, size)
    width = 0.8 / len(ALL_REDUCE_NAMES)
    for i, (impl, label) in enumerate(ALL_REDUCE_NAMES.items()):
        color = LINE_STYLES[impl][0]
        xs = [k + (i - 1) * width for k in range(len(sent))]
        heights = [counts[impl] / counts["size"] for counts in sent.values()]
        bars = ax.bar(xs, heights, width * 0.92, color=color, label=label)
        ax.bar_label(bars, [f"{h:.2f} S" for h in heights], fontsize=7)
    ax.axhline(2, color="black", lw=0.7, ls=":")
    ax.text(-0.45, 2.04, "2 S: the ring never reaches it", fontsize=7)
    ax.set_xticks(range(len(sent)), [f"{n} ranks" for n in sent])
    sizes = sorted({counts["size"] for counts in sent.values()})
    ax.set(ylabel="bytes rank 0 sent, in units of S")
    ax.set_title(
        f"counted as each ran, S = {', '.join(f'{s / 2**20:g} MiB' for s in sizes)}; "
        f"{_hardware_title(list(records.values()))}",
        fontsize=8,
    )
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3, axis="y")
    return ax


def shard_frames(n: int, numel: int) -> tuple[list[str], list[tuple[str, list, list]]]:
    """The columns and frames of a flat buffer of ``numel`` values padded to ``n`` equal shards (the layout of
    :class:`distlab.parallel.flat_param.FlatParams`, rank r owning shard r) through a reduce-scatter and an
    all-gather: ``(title, held[rank][shard], sends)``; a shard a rank does not keep is ``""``."""
    size = -(-numel // n)
    columns = []
    for c in range(n):
        start, stop = c * size, min((c + 1) * size, numel)
        pad = (c + 1) * size - max(stop, start)
        values = {0: "none", 1: f"{start}"}.get(stop - start, f"{start}-{stop - 1}")
        columns.append(f"shard {c}\n{values}" + (f"\n+{pad} pad" if pad else ""))
    everyone = frozenset(range(n))
    own = [[frozenset([r]) for _ in range(n)] for r in range(n)]
    kept = [[everyone if c == r else "" for c in range(n)] for r in range(n)]
    frames = [
        (
            f"1. each rank's whole gradient, {numel} values padded to {n} x {size}: all of it goes into the "
            "reduce-scatter",
            own,
            [(r, c, None) for r in range(n) for c in range(n)],
        ),
        (
            "2. after the reduce-scatter: rank r keeps the sum of shard r only (ZeRO steps it here), and sends it "
            "into the all-gather",
            kept,
            [(r, r, None) for r in range(n)],
        ),
        ("3. after the all-gather: every rank holds every summed shard, as an all-reduce leaves it",
         [[everyone] * n for _ in range(n)], []),
    ]  # fmt: skip
    return columns, frames


def plot_shard_steps(n: int = 3, numel: int = 5, axes=None):
    """A SCHEDULE: a padded flat buffer in ``n`` shards, before the reduce-scatter, after it (rank r holds the sum
    of shard r; the ring of the all-reduce chapter leaves segment r+1 instead) and after the all-gather. Red
    outlines: what each rank puts into the collective (no arrow: the collective decides the route)."""
    columns, frames = shard_frames(n, numel)
    if axes is None:
        _, axes = plt.subplots(1, len(frames), figsize=(COLUMN_INCHES, 0.45 * n + 3.0))
    for i, (ax, (title, held, sends)) in enumerate(zip(axes, frames)):
        plot_holdings(ax, held, sends, columns=columns, title=_wrap(title, 28), shade={"": -0.2})
        if i:
            ax.tick_params(labelleft=False)
    text = f"schedule: reduce_scatter_flat then all_gather_flat on {n} ranks (distlab.parallel.flat_param)"
    axes[0].figure.suptitle(_wrap(text, 80), fontsize=MIN_TEXT_PT)
    axes[0].figure.tight_layout()
    return axes


def _wrap(text: str, width: int) -> str:
    return "\n".join(textwrap.wrap(text, width))


COLLECTIVE_COLORS = {"all_reduce": "tab:gray", "reduce_scatter": "tab:red", "all_gather": "tab:blue"}
SHORT = {"all_reduce": "AR", "reduce_scatter": "RS", "all_gather": "AG"}


def step_call_order(variant: str, calls: list[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
    """``calls`` as :func:`distlab.predict.costmodel.collective_calls` lists them (ZeRO-3: unit by unit, each
    unit's gathers then its reduce-scatter, the root last) put in the order one step issues them: ZeRO-3's
    forward gathers the root, then each unit; backward gathers each unit again (unless it kept it) and
    reduce-scatters it, last unit first; the root's reduce-scatter comes last. Other strategies are in order."""
    if not variant.startswith(("zero3", "fsdp")):
        return list(calls)
    units, current = [], []
    for call in calls:
        current.append(call)
        if call[0] == "reduce_scatter":
            units.append(current)
            current = []
    *blocks, root = units
    forward = [root[0], *[unit[0] for unit in blocks]]
    backward = [call for unit in reversed(blocks) for call in unit[1:]]
    return forward + backward + [root[-1]]


def plot_step_collectives(rows: dict[str, list[tuple[str, str, int]]], n: int, title: str = "", ax=None):
    """One row per strategy, one box per collective in call order, its width the bytes this rank sends for it
    (ring volume: 2(n-1)/n of the tensor for an all-reduce, (n-1)/n for the others); each row's total, and its
    ratio to the first row's, at the right. ``rows``: label -> ``(collective, impl, bytes of the tensor)``."""
    ax = ax or plt.subplots(figsize=(COLUMN_INCHES, 0.8 * len(rows) + 1.6))[1]
    totals = {}
    for y, (label, calls) in enumerate(rows.items()):
        left = 0.0
        for collective, _, size in calls:
            width = RING_FACTOR[collective](n) * size / 2**10
            ax.add_patch(Rectangle((left, -y - 0.35), width, 0.7, fc=COLLECTIVE_COLORS[collective], ec="white", lw=1.2))
            left += width
        totals[label] = left
        ax.text(0, -y + 0.4, label, va="bottom", fontsize=MIN_TEXT_PT)  # the row's name above it: the bar's width
    first = next(iter(totals.values()))
    widest = max(totals.values())
    for y, (label, calls) in enumerate(rows.items()):
        left = 0.0
        for collective, _, size in calls:  # a box's name where it is wide enough to hold it
            width = RING_FACTOR[collective](n) * size / 2**10
            if width > widest * 0.045:
                ax.text(left + width / 2, -y, SHORT[collective], ha="center", va="center", fontsize=MIN_TEXT_PT,
                        color="white")  # fmt: skip
            left += width
        total = totals[label]
        ax.text(total + widest * 0.01, -y, f"{total:,.0f} KiB\n{total / first:.2f}x", va="center", fontsize=MIN_TEXT_PT)
    ax.set_yticks([])
    ax.set_xlim(0, widest * 1.2)
    ax.set_ylim(-len(rows) + 0.5, 1.0)
    ax.set_xlabel(f"KiB this rank sends in one step, collective after collective ({n} ranks)", fontsize=MIN_TEXT_PT)
    handles = [Rectangle((0, 0), 1, 1, fc=color) for color in COLLECTIVE_COLORS.values()]
    labels = [f"{SHORT[name]}: {name.replace('_', '-')}" for name in COLLECTIVE_COLORS]
    ax.legend(handles, labels, fontsize=MIN_TEXT_PT, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3,
              frameon=False)  # fmt: skip
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title(_wrap(title, 80), fontsize=MIN_TEXT_PT)
    ax.figure.tight_layout()
    return ax
