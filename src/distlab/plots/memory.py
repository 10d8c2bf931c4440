"""Memory: a rank's bytes along a step by category, the ZeRO stages' state per rank as the model predicts it and
as measured, FSDP2's options, and what each rank holds of an FSDP2 unit collective by collective (the FSDP
chapters).
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

from ..predict.memory import BYTES_PER_VALUE, expected_state_bytes
from ..results import hardware_label

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


STATE = ("parameters", "gradients", "optimizer_state")
STAGE_NAMES = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "fsdp": "FSDP2"}


def state_bars(parameters: int, strategies, world_sizes, precision: str, units=None, optimizer: str = "adam"):
    """``[(strategy, N, {parameters, gradients, optimizer_state: bytes on rank 0})]``, the bars of
    :func:`plot_state_bars`, from :func:`distlab.predict.memory.expected_state_bytes`."""
    return [
        (strategy, n, expected_state_bytes(parameters, strategy, n, optimizer, precision, units))
        for n in world_sizes
        for strategy in strategies
    ]


def plot_state_bars(
    parameters: int,
    strategies=("ddp", "zero1", "zero2", "zero3"),
    world_sizes=(4, 8),
    precisions=("fp32", "mixed"),
    units=None,
    optimizer: str = "adam",
    axes=None,
):
    """PREDICTED: what one rank holds for training, before any activation, stacked by parameters, gradients and
    optimizer state, for each strategy at each world size, one panel per precision (the ZeRO paper's figure;
    :func:`~distlab.predict.memory.expected_state_bytes`, which the course checks against measured bytes).
    Each bar is labelled with its bytes per parameter."""
    if axes is None:
        _, axes = plt.subplots(1, len(precisions), figsize=(6.2 * len(precisions), 3.9), sharey=True, squeeze=False)
        axes = axes[0]
    for ax, precision in zip(axes, precisions):
        bars = state_bars(parameters, strategies, world_sizes, precision, units, optimizer)
        xs = [i + i // len(strategies) * 0.6 for i in range(len(bars))]
        bottom = [0.0] * len(bars)
        for category in STATE:
            heights = [held[category] / 1e9 for _, _, held in bars]
            ax.bar(xs, heights, 0.8, bottom=bottom, color=MEMORY_COLORS[category], label=category.replace("_", " "))
            bottom = [b + h for b, h in zip(bottom, heights)]
        for x, top, (_, _, held) in zip(xs, bottom, bars):
            ax.text(x, top, f"{sum(held.values()) / parameters:.1f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(xs, [f"{STAGE_NAMES[s]}\nN={n}" for s, n, _ in bars], fontsize=7)
        per_value = "+".join(map(str, BYTES_PER_VALUE[optimizer, precision]))
        ax.set_title(f"{precision}, {per_value} bytes a value; on each bar, bytes per parameter", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylabel("GB one rank holds (before activations)")
    axes[0].legend(fontsize=7)
    axes[0].figure.suptitle(
        f"predicted by expected_state_bytes: {parameters:,} parameters, {optimizer}, per rank", fontsize=9
    )
    axes[0].figure.tight_layout()
    return axes


def _rows_of(rows: int, world: int, rank: int) -> str:
    """The rows of a first dimension of ``rows`` that ``rank`` holds as ``torch.chunk`` cuts it (FSDP2's Shard(0))."""
    piece = -(-rows // world)
    first, last = rank * piece, min(rows, (rank + 1) * piece) - 1
    return f"rows {first}-{last}" if first <= last else "no rows"


def fsdp_unit_frames(calls: Sequence[dict], units: Sequence[tuple], world: int, bytes_per_value: int = 4) -> list:
    """One FSDP2 step as its collectives ran, a frame per collective, for :func:`~distlab.plots.plot_holdings`.

    ``calls``: one rank's traced calls in order (:func:`distlab.exercises.run_on_ranks`); ``units``: each unit's
    name and parameter shapes, in forward order. An all-gather is matched to its unit by its bytes (every rank's
    piece, each parameter's first dimension padded to a multiple of ``world``): its first is the forward's, its
    second the backward's. A reduce-scatter is matched by its bytes (one rank's padded piece) where the trace holds
    them, else to the units in the order backward gathered them, as FSDP2 reduces. Each frame is a dict: ``title``,
    ``held[rank][column]`` after the collective, ``sends`` (the cells it filled, on every rank), ``op``, ``bytes``,
    ``unit``; the columns are each unit's parameters, then each unit's reduced gradient. With resharding after
    forward (FSDP2's default for every unit but the root) a unit is freed once its forward is done: at the next
    unit's gather."""
    import math

    gathered = [
        world * sum(-(-shape[0] // world) * math.prod(shape[1:]) for shape in shapes) * bytes_per_value
        for _, shapes in units
    ]
    shard = [g // world for g in gathered]
    count = len(units)
    rows = [[_rows_of(shapes[0][0], world, r) for _, shapes in units] for r in range(world)]
    held = [rows[r][:] + [""] * count for r in range(world)]
    frames = [{"title": "start: each rank holds its rows of every unit", "held": [h[:] for h in held], "sends": [],
               "op": None, "bytes": None, "unit": None}]  # fmt: skip
    gathers, backward, reduced = [0] * count, [], 0
    for call in calls:
        op, size = call["op"], call.get("bytes")
        if op.startswith("all_gather"):
            if size not in gathered:
                raise ValueError(f"an all-gather of {size} B matches no unit ({gathered} B gathered)")
            unit = gathered.index(size)
            gathers[unit] += 1
            if gathers[unit] == 1:  # forward: the unit before it was freed when its forward ended
                for r in range(world):
                    held[r][:count] = rows[r][:]
                what = "gathered whole for its forward"
            else:
                backward.append(unit)
                what = "gathered again for its backward"
            for r in range(world):
                held[r][unit] = "whole"
            column = unit
        elif op.startswith("reduce_scatter"):
            unit = shard.index(size) if size in shard else backward[reduced]
            reduced += 1
            for r in range(world):
                held[r][unit] = rows[r][unit]
                held[r][count + unit] = "+".join(map(str, range(world))) + "\n" + rows[r][unit]
            what = "gradient reduce-scattered: each rank keeps the sum over its rows; the whole unit freed"
            column = count + unit
        else:
            continue
        name = units[unit][0]
        said = f"{size} B" if size else "its bytes not traced"
        frames.append({"title": f"{len(frames)}. {op}, {said}: {name} {what}",
                       "held": [h[:] for h in held], "sends": [(r, column, None) for r in range(world)],
                       "op": op, "bytes": size, "unit": unit})  # fmt: skip
    return frames


def plot_fsdp_unit_steps(calls: Sequence[dict], units: Sequence[tuple], world: int, caption: str = "", columns=4):
    """:func:`fsdp_unit_frames` drawn in the course's grammar, a panel per collective: rows are ranks, columns each
    unit's parameters and reduced gradient; "whole" is a gathered unit, a red outline the cells the collective of
    that panel filled. ``caption`` says what traced the calls."""
    import textwrap

    from .ring_animation import plot_holdings

    frames = fsdp_unit_frames(calls, units, world)
    across = min(columns, len(frames))
    down = -(-len(frames) // across)
    fig, axes = plt.subplots(down, across, figsize=(3.6 * across, 2.3 * down + 0.6), squeeze=False)
    names = [f"{name}\nparams" for name, _ in units] + [f"{name}\ngradient" for name, _ in units]
    shade = {"whole": 0.85, "": 0.0}
    for frame in frames:
        for row in frame["held"]:
            for cell in row:
                shade.setdefault(cell, 1.0 if "+" in cell else 0.25)
    for ax, frame in zip(axes.flat, frames):
        plot_holdings(ax, frame["held"], frame["sends"], columns=names, shade=shade)
        ax.set_title("\n".join(textwrap.wrap(frame["title"], 48)), fontsize=7)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(frames) :]:
        ax.axis("off")
    text = "FSDP2's collectives in one step, in the order they ran" + (": " + caption if caption else "")
    fig.suptitle("\n".join(textwrap.wrap(text, 170)), fontsize=8)
    fig.tight_layout()
    return fig
