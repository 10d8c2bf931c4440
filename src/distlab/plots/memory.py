"""Memory: a rank's bytes along a step by category, the ZeRO stages' state per rank as the model predicts it and
as measured, FSDP2's options (the FSDP chapters).
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
