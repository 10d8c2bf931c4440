"""The DDP chapter's figures: who holds and sends what in one averaged step (from a traced run), when each
all-reduce is posted with and without buckets (a schedule), time per wrapper, and one profiled step."""

from __future__ import annotations

import textwrap

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from ..results import hardware_label
from .common import MIN_TEXT_PT, fit_to_column
from .ring_animation import plot_holdings


def plot_step_times(record: dict, ax=None):
    """Median forward+backward time per variant (bars) with its quartiles over the steps (whiskers, so labelled in
    the legend), from a ddp_step_bench result."""
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
    ax.errorbar([], [], xerr=[], fmt="none", ecolor="black", capsize=3, label="quartiles over the steps")
    ax.legend(fontsize=8, loc="best")
    ax.bar_label(bars, labels=[f"{m:.1f} ms" for m in medians], padding=8, fontsize=8)
    ax.set_xlim(0, max(max(medians) * 1.3, 1.15 * max(1e3 * r["time_q3_s"] for r in rows)))  # whiskers whole
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


def traced_all_reduces(calls: list[dict], parameters: list[tuple[str, int, bool]]) -> list[int]:
    """Which parameter each of one rank's traced ``all_reduce`` calls carried: its index in ``parameters``
    (``(name, bytes, trainable)`` in the model's order), matched by bytes, the first trainable one not yet
    matched. A call that fits no trainable parameter is a ValueError: the picture draws only what was sent."""
    matched: list[int] = []
    for call in (c for c in calls if c["op"] == "all_reduce"):
        fits = [i for i, (_, nbytes, trainable) in enumerate(parameters) if trainable and nbytes == call.get("bytes")]
        fits = [i for i in fits if i not in matched]
        if not fits:
            raise ValueError(f"an all_reduce of {call.get('bytes')} B carried no trainable parameter's gradient")
        matched.append(fits[0])
    return matched


def plot_gradient_averaging(
    axes,
    parameters: list[tuple[str, int, bool]],
    calls: list[list[dict]],
    slices: list[list[int]],
    weights: list[float],
    traced_on: str,
) -> list[tuple[int, int, None]]:
    """DDP's data parallelism in two panels drawn with :func:`plot_holdings` from a traced run: ``axes`` (two
    Axes); ``parameters`` as :func:`traced_all_reduces` takes them; for each rank, its traced ``calls``, the
    indices of its data ``slices`` and its ``weights`` (a checksum). First: after backward, each rank holds its
    own gradients; a red outline marks each gradient a rank put into an ``all_reduce``. Second: after them, each
    such gradient holds every rank's contribution; a frozen parameter's "no grad" stays. The sends drawn. A figure
    wider than the book's column is narrowed to it (:func:`~distlab.plots.common.fit_to_column`)."""
    n, first = len(calls), 2  # columns: the data, the weights, then one column a parameter
    sent = [traced_all_reduces(rank_calls, parameters) for rank_calls in calls]
    sends = [(r, first + i, None) for r in range(n) for i in sent[r]]
    columns = ["data slice", "weights"] + [
        f"{name}\n{nbytes} B" if trainable else f"{name}\nfrozen" for name, nbytes, trainable in parameters
    ]

    def row(r: int, averaged: bool) -> list:
        grads = [
            "no grad" if not trainable else frozenset(range(n)) if averaged and i in sent[r] else frozenset([r])
            for i, (_, _, trainable) in enumerate(parameters)
        ]
        return [" ".join(map(str, slices[r])), f"Σw {weights[r]:.4f}", *grads]

    shade = {"no grad": 0.0}
    before, after = axes
    title = textwrap.fill(f"after backward: each rank's own gradients; red: into an all_reduce ({traced_on})", 75)
    plot_holdings(before, [row(r, False) for r in range(n)], sends, columns, title, shade)
    title = f"after the all_reduces, divided by {n}: every rank holds the average"
    plot_holdings(after, [row(r, True) for r in range(n)], [], columns, title, shade)
    fit_to_column(before.figure)
    return sends


def plot_bucket_schedule(
    ax, parameters: list[tuple[str, int]], buckets: list[list[str]], arrival: list[str], title: str = ""
) -> None:
    """When each all-reduce is posted, as a schedule (order, not durations). ``parameters``: ``(name, bytes)`` of
    the trainable parameters in registration order; ``buckets``: the names in each bucket, as they fill in reverse
    registration order (:func:`distlab.parallel.mini_ddp.bucket_groups`); ``arrival``: the names in the order one
    backward completed their gradients (recorded with hooks). Three lanes: the gradients in that order, coloured
    by bucket; NaiveDDP's one all-reduce a parameter, in registration order, once backward has ended;
    BucketedDDP's one a bucket, posted right after its last gradient arrived. Each box's ``gid`` says what it is
    (``grad:``, ``naive:`` or ``bucket k:`` and the names). A figure wider than the book's column is narrowed to
    it."""
    backward = list(arrival)
    slot = {name: i for i, name in enumerate(backward)}
    size = dict(parameters)
    bucket_of = {name: k for k, names in enumerate(buckets) for name in names}
    colors = plt.get_cmap("tab10")
    lanes = {"backward": 2, "naive": 1, "bucketed": 0}
    end = len(parameters)

    def box(x: float, lane: str, gid: str, text: str, color) -> None:
        ax.add_patch(Rectangle((x, lanes[lane] - 0.44), 0.9, 0.88, color=color, alpha=0.85, gid=gid))
        ax.text(x + 0.45, lanes[lane], text, ha="center", va="center", fontsize=MIN_TEXT_PT, rotation=90)

    for name in backward:
        short = name.replace(".weight", ".w").replace(".bias", ".b")
        box(slot[name], "backward", f"grad:{name}", short, colors(bucket_of[name] % 10))
    for i, (name, nbytes) in enumerate(parameters):
        box(end + i, "naive", f"naive:{name}", f"{nbytes:,} B", "0.75")
    for k, names in enumerate(buckets):
        posted = 1 + max(slot[name] for name in names)  # right after its last gradient
        nbytes = sum(size[name] for name in names)
        box(posted, "bucketed", f"bucket {k}:{','.join(names)}", f"{k}: {nbytes:,} B", colors(k % 10))
    ax.axvline(end, color="gray", ls=":", lw=1)
    ax.text(end, 2.47, " backward ends", fontsize=MIN_TEXT_PT, color="gray", va="bottom")
    ax.set_xlim(-0.2, 2 * end + 0.2)
    ax.set_ylim(-0.5, 2.75)
    names = ["backward:\ngradient\nready", "NaiveDDP:\nall-reduce\nof each", "BucketedDDP:\nall-reduce of\nbucket k"]
    ax.set_yticks([lanes[lane] for lane in lanes], names)
    ax.set_xticks([])
    ax.set_xlabel("order of events (schematic: order, not durations)")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(textwrap.fill(title or "schematic: order, not durations", 80), fontsize=MIN_TEXT_PT)
    fit_to_column(ax.figure)
    ax.figure.set_size_inches(ax.figure.get_size_inches()[0], max(4.8, ax.figure.get_size_inches()[1]))
