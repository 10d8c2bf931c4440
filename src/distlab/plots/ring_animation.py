"""The ring all-reduce, hop by hop: a static strip (``plot_ring_steps``), the bridge to sharding
(``plot_sharding_bridge``), and an animation that plays without a kernel.

The state is which ranks' contributions each rank holds for each segment;
the frames follow exactly the schedule :mod:`distlab.comm.collectives` runs
(segment indices from the same function,
:func:`~distlab.comm.collectives.ring_send_segment`), so the picture cannot drift
from the code. ``animation(n).to_jshtml()`` gives HTML + JavaScript that plays on
the static site.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

import matplotlib.pyplot as plt
from matplotlib import animation as mpl_animation
from matplotlib.patches import FancyArrowPatch, Rectangle

from distlab.comm.collectives import Phase, ring_send_segment

from .common import COLUMN_INCHES, MIN_TEXT_PT


@dataclass
class Frame:
    title: str
    held: list[list[frozenset]]  # held[rank][segment]: ranks whose data is summed in
    sends: list[tuple[int, int]]  # (rank, segment) cells on the wire in this hop
    phase: Phase | None = None  # the phase this frame shows; None before and after the ring runs


def ring_schedule(n: int) -> list[Frame]:
    """Frames of reduce-scatter then all-gather, as ``_ring_pipeline`` streams them."""
    held = [[frozenset([r]) for _ in range(n)] for r in range(n)]
    frames = [Frame(f"start: each of {n} ranks holds its own gradient, cut into {n} segments", _copy(held), [])]
    for phase in (Phase.REDUCE_SCATTER, Phase.ALL_GATHER):
        reduce = phase is Phase.REDUCE_SCATTER
        offset = ring_send_segment(0, 0, phase, n)  # rank 0's first segment: the formula's offset
        for hop in range(n - 1):
            step = f"{phase.value} hop {hop + 1}/{n - 1}"
            sends = [(r, ring_send_segment(r, hop, phase, n)) for r in range(n)]
            formula = f"(r{f'+{offset}' if offset else ''}-{hop}) mod {n}"
            frames.append(Frame(f"{step}: rank r sends segment {formula} to rank r+1", _copy(held), sends, phase))
            new = _copy(held)
            for r, seg in sends:
                dst = (r + 1) % n  # receives into the segment its predecessor sends
                new[dst][seg] = held[dst][seg] | held[r][seg] if reduce else held[r][seg]
            held = new
            label = "added into" if reduce else "copied into"
            frames.append(Frame(f"{step}: received segments {label} the receiver's", _copy(held), [], phase))
    frames.append(Frame(f"done: every rank holds the full sum; each sent 2({n}-1)/{n} of the data", _copy(held), []))
    return frames


def _copy(held: list[list[frozenset]]) -> list[list[frozenset]]:
    return [row[:] for row in held]


Held = frozenset | str
"""What a cell holds: the ranks whose contributions are summed in it (drawn ``0+1+2``, shaded by how many), or a
label of its own (drawn as written, shaded by ``shade``)."""


def plot_holdings(
    ax,
    held: list[list[Held]],
    sends: list[tuple] = (),
    columns: list[str] | None = None,
    title: str = "",
    shade: dict[str, float] | None = None,
) -> None:
    """Who holds what and who sends what, in the one grammar of the course's pictures: a row a rank, a column a
    piece of data (segment, bucket, shard, parameter); a cell's label and its shade of blue say whose
    contributions it holds ("0+1+2" is complete); a red outline with an arrow marks a cell on the wire.

    ``held[rank][column]``; ``sends``: ``(rank, column)`` to the next rank of the ring, ``(rank, column, peer)``
    to ``peer``, or ``(rank, column, None)`` into a collective (outlined, no arrow); ``shade``: a label's
    shade, 0 to 1, for cells that hold labels."""
    ax.clear()
    cmap = plt.get_cmap("Blues")
    n, width = len(held), len(held[0]) if held else 0
    for r in range(n):
        for s in range(width):
            cell = held[r][s]
            if isinstance(cell, str):
                text, level = cell, (shade or {}).get(cell, 0.3)
            else:
                text, level = _ranks_label(cell), len(cell) / n
            ax.add_patch(Rectangle((s, n - 1 - r), 0.92, 0.86, color=cmap(0.15 + 0.75 * level)))
            size = max(MIN_TEXT_PT, 12 - max(n, width))
            ax.text(s + 0.46, n - 1 - r + 0.43, text, ha="center", va="center", fontsize=size,
                    color="white" if level > 0.5 else "black")  # fmt: skip
    for send in sends:
        r, s = send[0], send[1]
        dst = send[2] if len(send) > 2 else (r + 1) % n
        ax.add_patch(Rectangle((s, n - 1 - r), 0.92, 0.86, fill=False, lw=2.5, ec="tab:red"))
        if dst is None:
            continue
        start, end = (s + 0.46, n - 1 - r + 0.05), (s + 0.46, n - 1 - dst + 0.81)
        style = "arc3,rad=0.0" if dst > r else "arc3,rad=-0.35"  # a hop back up (the ring's wrap-around) curves
        ax.add_patch(
            FancyArrowPatch(
                start, end, arrowstyle="-|>", mutation_scale=14, color="tab:red", connectionstyle=style, lw=1.5
            )
        )
    ax.set_xlim(-0.1, width + 0.1)
    ax.set_ylim(-0.2, n + 0.1)
    ax.set_xticks([s + 0.46 for s in range(width)], columns or [f"seg {s}" for s in range(width)])
    ax.set_yticks([n - 1 - r + 0.43 for r in range(n)], [f"rank {r}" for r in range(n)])
    ax.tick_params(length=0, labelsize=MIN_TEXT_PT)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title(title, fontsize=MIN_TEXT_PT)


def _ranks_label(ranks: frozenset, per_line: int = 4) -> str:
    """``0+1+2``, broken after every ``per_line`` ranks so that a cell of many ranks' sum stays narrow."""
    names = [str(r) for r in sorted(ranks)]
    lines = ["+".join(names[i : i + per_line]) for i in range(0, len(names), per_line)]
    return "+\n".join(lines)


def ring_steps(n: int) -> list[Frame]:
    """The strip's frames: the start, each hop of reduce-scatter and of all-gather as it sends, and the end."""
    frames = ring_schedule(n)
    return [frames[0], *[frame for frame in frames if frame.sends], frames[-1]]


def after_reduce_scatter(n: int) -> Frame:
    """What every rank holds once reduce-scatter is over: rank r the whole sum of segment r+1, and partial sums."""
    return [frame for frame in ring_schedule(n) if frame.phase is Phase.REDUCE_SCATTER][-1]


def _strip(frames: list[Frame], titles: list[str], columns: int, suptitle: str, axes=None):
    """The frames in rows of ``columns`` panels (at most 3, so that each stays legible in the book's column); only
    a row's first panel names the ranks."""
    columns = min(columns, 3)
    rows = -(-len(frames) // columns)
    if axes is None:
        n = len(frames[0].held)
        _, axes = plt.subplots(rows, columns, figsize=(COLUMN_INCHES, (0.45 * n + 1.75) * rows), squeeze=False)
    flat = list(getattr(axes, "flat", axes))
    letters = int(COLUMN_INCHES / columns * 13)  # a 9 pt title's characters in one panel's width
    for i, (ax, frame, title) in enumerate(zip(flat, frames, titles)):
        plot_holdings(ax, frame.held, frame.sends, title="\n".join(textwrap.wrap(title, letters)))
        if i % columns:
            ax.tick_params(labelleft=False)
    for ax in flat[len(frames) :]:
        ax.set_visible(False)
    flat[0].figure.suptitle("\n".join(textwrap.wrap(suptitle, 80)), fontsize=MIN_TEXT_PT)
    flat[0].figure.tight_layout()
    return flat[: len(frames)]


def plot_ring_steps(n: int = 3, axes=None, columns: int = 3):
    """A SCHEDULE, drawn as a strip: the ring all-reduce on ``n`` ranks, from each rank's own gradient through
    every hop of reduce-scatter and of all-gather to the full sum everywhere. Red: the cells each rank sends to
    the next in that hop. The segments are :func:`~distlab.comm.collectives.ring_send_segment`'s, what the
    library's ring sends (a test compares them with a trace of the ring on real gloo ranks)."""
    frames = ring_steps(n)
    titles = [
        f"start: each rank holds its own gradient, cut into {n} segments",
        *[frame.title for frame in frames[1:-1]],
        f"done: every rank holds the sum, and each sent 2({n}-1)/{n} of the gradient's bytes",
    ]
    suptitle = (
        f"schedule of the ring all-reduce on {n} ranks: ring_schedule({n}), the segments the library's ring sends"
    )
    return _strip(frames, titles, columns, suptitle, axes)


def plot_sharding_bridge(n: int = 3, axes=None):
    """A SCHEDULE: the ring's state after reduce-scatter, where rank r holds the whole sum of segment r+1
    (stop there and each rank has the gradient shard ZeRO steps), beside the all-gather's hops that bring
    every segment to every rank (what ZeRO-3 runs before a unit computes)."""
    gathers = [frame for frame in ring_steps(n) if frame.phase is Phase.ALL_GATHER]
    frames = [after_reduce_scatter(n), *gathers, ring_schedule(n)[-1]]
    titles = [
        "stop here: ZeRO's gradient shard (after reduce-scatter, rank r holds the sum of segment r+1)",
        *[f"ZeRO-3's gather: all-gather hop {hop + 1}/{n - 1}" for hop in range(len(gathers))],
        "gathered: every rank holds every segment",
    ]
    suptitle = f"schedule: the ring's two halves on {n} ranks, and the sharded strategies built from them"
    return _strip(frames, titles, 2, suptitle, axes)


def _draw(ax, frame: Frame, n: int) -> None:
    plot_holdings(ax, frame.held, frame.sends, title="\n".join(textwrap.wrap(frame.title, 70)))


def animation(n: int = 4, interval_ms: int = 1200) -> mpl_animation.FuncAnimation:
    """The ring all-reduce on ``n`` ranks; cells show whose data each segment sums."""
    frames = ring_schedule(n)
    fig, ax = plt.subplots(figsize=(min(COLUMN_INCHES, 1.3 * n + 2.5), 1.0 * n + 1.2))
    anim = mpl_animation.FuncAnimation(fig, lambda i: _draw(ax, frames[i], n), frames=len(frames), interval=interval_ms)
    plt.close(fig)  # the notebook shows the animation, not a stray still frame
    return anim
