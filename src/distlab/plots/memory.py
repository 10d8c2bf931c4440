"""Memory: a rank's bytes along a step by category, the ZeRO stages' state per rank as the model predicts it and
as measured, FSDP2's options, and what each rank holds of an FSDP2 unit collective by collective (the FSDP
chapters).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import matplotlib.pyplot as plt

from ..predict.memory import BYTES_PER_VALUE, expected_state_bytes
from ..results import hardware_label
from .common import COLUMN_INCHES, MIN_TEXT_PT

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
    if axes is None:  # one panel a row, each the column's width: its bars' labels stay legible
        _, axes = plt.subplots(len(precisions), 1, figsize=(COLUMN_INCHES, 3.3 * len(precisions) + 0.4), sharey=True,
                               squeeze=False)  # fmt: skip
        axes = axes[:, 0]
    for ax, precision in zip(axes, precisions):
        bars = state_bars(parameters, strategies, world_sizes, precision, units, optimizer)
        xs = [i + i // len(strategies) * 0.6 for i in range(len(bars))]
        bottom = [0.0] * len(bars)
        for category in STATE:
            heights = [held[category] / 1e9 for _, _, held in bars]
            ax.bar(xs, heights, 0.8, bottom=bottom, color=MEMORY_COLORS[category], label=category.replace("_", " "))
            bottom = [b + h for b, h in zip(bottom, heights)]
        for x, top, (_, _, held) in zip(xs, bottom, bars):
            ax.text(x, top, f"{sum(held.values()) / parameters:.1f}", ha="center", va="bottom", fontsize=MIN_TEXT_PT)
        ax.set_xticks(xs, [f"{STAGE_NAMES[s]}\nN={n}" for s, n, _ in bars], fontsize=MIN_TEXT_PT)
        per_value = "+".join(map(str, BYTES_PER_VALUE[optimizer, precision]))
        ax.set_title(f"{precision}, {per_value} bytes a value; on each bar, bytes per parameter", fontsize=MIN_TEXT_PT)
        ax.set_ylabel("GB one rank holds\n(before activations)", fontsize=MIN_TEXT_PT)
        ax.tick_params(axis="y", labelsize=MIN_TEXT_PT)
        ax.grid(alpha=0.3, axis="y")
        ax.set_ylim(top=max(bottom) * 1.12)  # room for the labels on the tallest bar
    axes[0].legend(fontsize=MIN_TEXT_PT)
    axes[0].figure.suptitle(
        f"predicted by expected_state_bytes: {parameters:,} parameters, {optimizer}, per rank", fontsize=MIN_TEXT_PT
    )
    axes[0].figure.tight_layout()
    return axes


def _rows_of(rows: int, world: int, rank: int) -> str:
    """The rows of a first dimension of ``rows`` that ``rank`` holds as ``torch.chunk`` cuts it (FSDP2's Shard(0)),
    on two lines so that a cell of a small panel holds it."""
    piece = -(-rows // world)
    first, last = rank * piece, min(rows, (rank + 1) * piece) - 1
    return f"rows\n{first}-{last}" if first <= last else "no\nrows"


def fsdp_unit_frames(calls: Sequence[dict], units: Sequence[tuple], world: int, bytes_per_value: int = 4) -> list:
    """One FSDP2 step as its collectives ran, a frame per collective, for :func:`~distlab.plots.plot_holdings`.

    ``calls``: one rank's traced calls in order (:func:`distlab.exercises.run_on_ranks`); ``units``: each unit's
    name and parameter shapes, in forward order. The tracer records a call's first tensor argument: for
    ``all_gather_single(output, input)`` the whole unit (every rank's piece, each parameter's first dimension
    padded to a multiple of ``world``), for ``reduce_scatter_single(output, input)`` one rank's padded piece. An
    all-gather is matched to its unit by those bytes: its first is the forward's, its second the backward's. A
    reduce-scatter is matched by its piece where the trace holds it, else to the units in the order backward
    gathered them, as FSDP2 reduces.

    Each frame is a dict: ``title``; ``held[rank][column]`` after the collective; ``sends`` (the cells it filled,
    on every rank); ``op``; ``unit``; ``phase`` (``"forward"``, ``"backward"``, or None for the start);
    ``prefetch`` (a backward gather made while another unit's gradient waits for its reduce-scatter: FSDP2's
    backward prefetch); and the bytes, each named: ``traced_bytes`` (what the tracer recorded, None where it did
    not), ``layer_bytes`` (the unit whole, padded), ``piece_bytes`` (one rank's padded piece) and ``sent_bytes``
    (what each rank sends for it, (n-1)/n of the unit, as a ring sends either collective and as
    :class:`~distlab.comm.traffic.TrafficCounter` counts it). The columns are each unit's parameters, then each
    unit's reduced gradient, which holds the average over the ranks of that rank's rows (FSDP2 divides by the
    world size). With resharding after forward (FSDP2's default for every unit but the root) a unit is freed once
    its forward is done: at the next unit's gather."""
    import math

    layer = [
        world * sum(-(-shape[0] // world) * math.prod(shape[1:]) for shape in shapes) * bytes_per_value
        for _, shapes in units
    ]
    piece = [size // world for size in layer]
    count = len(units)
    rows = [[_rows_of(shapes[0][0], world, r) for _, shapes in units] for r in range(world)]
    held = [rows[r][:] + [""] * count for r in range(world)]
    frames = [{"title": "start: each rank holds its rows of every layer", "held": [h[:] for h in held], "sends": [],
               "op": None, "unit": None, "phase": None, "prefetch": False, "traced_bytes": None,
               "layer_bytes": None, "piece_bytes": None, "sent_bytes": None}]  # fmt: skip
    gathers, backward, reduced = [0] * count, [], 0
    for call in calls:
        op, size = call["op"], call.get("bytes")
        waiting: list[str] = []  # units gathered for backward whose gradient is not yet reduce-scattered
        freed: list[str] = []  # units freed at this forward gather
        if op.startswith("all_gather"):
            if size not in layer:
                raise ValueError(f"an all-gather of {size} B matches no unit ({layer} B gathered)")
            unit = layer.index(size)
            gathers[unit] += 1
            phase = "forward" if gathers[unit] == 1 else "backward"
            if phase == "forward":  # the unit before it was freed when its forward ended
                freed = [units[u][0] for u in range(count) if held[0][u] == "whole"]
                for r in range(world):
                    held[r][:count] = rows[r][:]
            else:
                waiting = [units[u][0] for u in backward[reduced:]]
                backward.append(unit)
            for r in range(world):
                held[r][unit] = "whole"
            column = unit
        elif op.startswith("reduce_scatter"):
            unit = piece.index(size) if size in piece else backward[reduced]
            reduced += 1
            phase = "backward"
            for r in range(world):
                held[r][unit] = rows[r][unit]
                held[r][count + unit] = "+".join(map(str, range(world))) + "\n" + rows[r][unit]
            column = count + unit
        else:
            continue
        frame = {"held": [h[:] for h in held], "sends": [(r, column, None) for r in range(world)], "op": op,
                 "unit": unit, "phase": phase, "prefetch": bool(waiting), "traced_bytes": size,
                 "layer_bytes": layer[unit], "piece_bytes": piece[unit],
                 "sent_bytes": (world - 1) * layer[unit] // world}  # fmt: skip
        frame["title"] = f"{len(frames)}. {op}: {_what_happened(frame, units, waiting, freed)}"
        frames.append(frame)
    return frames


def _what_happened(frame: dict, units: Sequence[tuple], waiting: Sequence[str], freed: Sequence[str]) -> str:
    """A frame's title after its op: the unit, what the collective did, and what each rank sent of the layer."""
    name = units[frame["unit"]][0]
    sent = f"sends {frame['sent_bytes']} B of the {frame['layer_bytes']} B layer"
    if frame["op"].startswith("reduce_scatter"):
        return f"{name}'s gradient reduce-scattered, {sent}; each rank keeps the average over its rows, {name} freed"
    if frame["phase"] == "forward":
        gone = f"; {' and '.join(freed)} freed" if freed else ""
        return f"{name} gathered whole for its forward{gone}; {sent}"
    if waiting:
        return (f"{name} gathered for its backward before {' and '.join(waiting)}'s gradient is reduce-scattered: "
                f"FSDP2's backward prefetch; {sent}")  # fmt: skip
    return f"{name} gathered again for its backward; {sent}"


def plot_fsdp_unit_steps(calls: Sequence[dict], units: Sequence[tuple], world: int, caption: str = "", columns=2):
    """:func:`fsdp_unit_frames` drawn in the course's grammar, a panel per collective: rows are ranks, columns each
    unit's parameters and reduced gradient; "whole" is a gathered unit, a red outline the cells the collective of
    that panel filled. The forward's panels (after the start) fill the first rows, the backward's the next, at
    most ``columns`` (2; 3 at most) a row so that the figure stays legible in the book's column. ``caption`` says what
    traced the calls."""
    import textwrap

    from .ring_animation import plot_holdings

    frames = fsdp_unit_frames(calls, units, world)
    across = min(columns, 3)
    forward = [f for f in frames if f["phase"] != "backward"]
    backward = [f for f in frames if f["phase"] == "backward"]
    lines = [forward[i : i + across] for i in range(0, len(forward), across)]
    lines += [backward[i : i + across] for i in range(0, len(backward), across)]
    fig, axes = plt.subplots(len(lines), across, figsize=(COLUMN_INCHES, 2.5 * len(lines) + 0.7), squeeze=False)
    names = [f"{name}\nparams" for name, _ in units] + [f"{name}\ngrad" for name, _ in units]
    shade = {"whole": 0.85, "": 0.0}
    for frame in frames:
        for row in frame["held"]:
            for cell in row:
                shade.setdefault(cell, 1.0 if "+" in cell else 0.25)
    letters = int(COLUMN_INCHES / across * 13)  # a 9 pt title's characters in one panel's width
    for axes_row, line in zip(axes, lines):
        for i, ax in enumerate(axes_row):
            if i >= len(line):
                ax.axis("off")
                continue
            plot_holdings(ax, line[i]["held"], line[i]["sends"], columns=names, shade=shade)
            ax.set_title("\n".join(textwrap.wrap(line[i]["title"], letters)), fontsize=MIN_TEXT_PT)
            if i:
                ax.tick_params(labelleft=False)
        phase = line[0]["phase"] or "forward"
        axes_row[0].set_ylabel(phase, fontsize=MIN_TEXT_PT + 1, fontweight="bold")
    text = (
        "FSDP2's collectives in one step, in the order they ran; a rank sends (n-1)/n of each layer, as a ring sends "
        "it" + (": " + caption if caption else "")
    )
    fig.suptitle("\n".join(textwrap.wrap(text, 80)), fontsize=MIN_TEXT_PT)
    fig.tight_layout()
    return fig


# what book/ddp_vs_fsdp.md's ddp_or_fsdp.py prints for each strategy on each rank
_RUN_LINE = re.compile(r"rank (\d+) (\S+): holds ([\d.]+) MiB of parameters, sent ([\d.]+) MiB in (.+)")
_SHORT = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS"}


def ddp_or_fsdp_records(output) -> dict[str, dict[int, dict]]:
    """What the DDP-or-FSDP chapter's two-rank run printed (its job, or the job's output text), by strategy in the
    order printed, then by rank: ``held_mib`` (parameters), ``sent_mib`` (as the run's TrafficCounter counted it)
    and ``calls`` (``{collective: how many}``)."""
    records: dict[str, dict[int, dict]] = {}
    for line in getattr(output, "output", output).splitlines():
        found = _RUN_LINE.search(line)
        if found:
            rank, name, held, sent, calls = found.groups()
            counted = {op: int(k) for k, op in (part.split() for part in calls.split(", "))}
            records.setdefault(name, {})[int(rank)] = {
                "held_mib": float(held),
                "sent_mib": float(sent),
                "calls": counted,
            }
    ranks = {tuple(sorted(by_rank)) for by_rank in records.values()}
    if not records or len(ranks) != 1:
        raise ValueError("no 'rank r NAME: holds ... MiB of parameters, sent ... MiB in ...' line for every rank: "
                         "pass the output of the ddp_or_fsdp.py run")  # fmt: skip
    return records


def _layer_held(shapes: Sequence[tuple], world: int, rank: int, sharded: bool, bytes_per_value: int) -> int:
    """The bytes of one layer ``rank`` holds: all of them, or its rows of each parameter (FSDP2's Shard(0))."""
    import math

    if not sharded:
        return sum(math.prod(shape) for shape in shapes) * bytes_per_value
    held = 0
    for shape in shapes:
        piece = -(-shape[0] // world)
        rows = max(0, min(shape[0], (rank + 1) * piece) - rank * piece)
        held += rows * math.prod(shape[1:]) * bytes_per_value
    return held


def _layer_cell(shapes: Sequence[tuple], world: int, rank: int, sharded: bool, bytes_per_value: int) -> str:
    mib = _layer_held(shapes, world, rank, sharded, bytes_per_value) / 2**20
    what = _rows_of(shapes[0][0], world, rank).replace("\n", " ") if sharded else "whole"
    return f"{what}\n{mib:.2f} MiB"


def plot_ddp_or_fsdp_run(output, layers: Sequence[tuple], bytes_per_value: int = 4, caption: str = ""):
    """The DDP-or-FSDP chapter's two-rank run in the course's grammar: a panel per strategy, rows its ranks,
    columns the model's layers (``layers``: each layer's name and parameter shapes); a cell is what the rank holds
    of the layer (whole, or its rows as FSDP2 shards them), and a red outline marks that the layer's bytes go into
    the strategy's collectives. Under each layer, what one rank sends for it in one step, at the ring volumes the
    run's TrafficCounter counts: an all-reduce sends 2(n-1)/n of each gradient, however many buckets carry them;
    an all-gather or a reduce-scatter (n-1)/n of the layer, the run's calls shared equally among the layers.
    ``output``: the run's job (or its output text), read by :func:`ddp_or_fsdp_records`; each panel's title gives
    the numbers the run printed, and layers whose bytes do not add up to them are a ValueError."""
    import textwrap

    from .ring_animation import plot_holdings

    records = ddp_or_fsdp_records(output)
    world, mib = len(next(iter(records.values()))), 2**20
    whole = [_layer_held(shapes, world, 0, False, bytes_per_value) for _, shapes in layers]
    fig, axes = plt.subplots(len(records), 1, figsize=(COLUMN_INCHES, 2.4 * len(records) + 0.9), squeeze=False)
    for ax, (name, by_rank) in zip(axes[:, 0], records.items()):
        first = by_rank[min(by_rank)]
        sharded = first["held_mib"] < sum(whole) / mib - 0.01  # a rank holds less than the whole model
        ring = (world - 1) / world
        share = {op: 2 * ring if op == "all_reduce" else ring * k / len(layers) for op, k in first["calls"].items()}
        sends = [sum(share.values()) * size for size in whole]
        for rank, record in by_rank.items():
            held = sum(_layer_held(shapes, world, rank, sharded, bytes_per_value) for _, shapes in layers)
            for what, ours, printed in (("sent", sum(sends), record["sent_mib"]), ("holds", held, record["held_mib"])):
                if abs(ours / mib - printed) > 0.006:  # the run printed two decimals
                    raise ValueError(f"{name} rank {rank} {what} {printed:.2f} MiB; its layers give "
                                     f"{ours / mib:.2f} MiB: pass the layers of the model the run used")  # fmt: skip
        how = " + ".join(
            "AR" if op == "all_reduce" else f"{k / len(layers):g} {_SHORT.get(op, op)}"
            for op, k in first["calls"].items()
        )
        columns = [f"{layer}\nsends {sent / mib:.2f} MiB\n({how})" for (layer, _), sent in zip(layers, sends)]
        cells = [[_layer_cell(shapes, world, r, sharded, bytes_per_value) for _, shapes in layers] for r in by_rank]
        shade = {cell: 0.35 if sharded else 0.85 for row in cells for cell in row}
        outlined = [(r, c, None) for r in range(world) for c in range(len(layers))]
        plot_holdings(ax, cells, outlined, columns, shade=shade)
        calls = ", ".join(f"{k} {op}" for op, k in first["calls"].items())
        title = (f"{name}: each rank holds {first['held_mib']:.2f} MiB of parameters "
                 f"({'its rows of each layer' if sharded else 'every layer whole'}) and sends "
                 f"{first['sent_mib']:.2f} MiB in {calls}")  # fmt: skip
        ax.set_title(textwrap.fill(title, 80), fontsize=MIN_TEXT_PT)
    text = (
        f"one step of the same model on {world} ranks, as the run printed it: a row a rank, a column a layer, "
        "a cell what the rank holds of it; red: the layer's bytes go into that strategy's collectives (AR: "
        "all-reduce of the gradients; AG: all-gather of the layer; RS: reduce-scatter of its gradient)"
    )
    fig.suptitle(textwrap.fill(text + (f"; {caption}" if caption else ""), 85), fontsize=MIN_TEXT_PT)
    fig.tight_layout()
    return fig
