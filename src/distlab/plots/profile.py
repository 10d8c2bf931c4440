"""The profiling chapter's picture (``book/profiling.md``): one rank's step as its trace shows it, compute on one
lane, communication on another, and below them the moments when a collective ran and no computation did (the
exposed communication the step waited for)."""

from __future__ import annotations

import matplotlib.pyplot as plt

from ..measure.profile import COMMUNICATION, COMPUTE, busy, exposed_intervals, step_time
from .common import COLUMN_INCHES, MIN_TEXT_PT

LANES = ((COMPUTE, "tab:blue"), (COMMUNICATION, "tab:red"), ("exposed", "black"))


def plot_profiled_step(step: dict, ax=None, title: str = ""):
    """``step`` as :func:`distlab.measure.profile.read_step` returns it (or written by hand, for a schedule): each
    lane's busy time as bars, ms from the step's start, the exposed communication summed in its label."""
    ax = ax or plt.subplots(figsize=(COLUMN_INCHES - 0.4, 1.9))[1]  # the lanes' labels stay in the column
    spans = {COMPUTE: busy(step["events"], COMPUTE), COMMUNICATION: busy(step["events"], COMMUNICATION),
             "exposed": exposed_intervals(step)}  # fmt: skip
    for row, (lane, color) in enumerate(LANES):
        bars = [(start, max(end - start, step["step_ms"] / 1000)) for start, end in spans[lane]]  # a tick stays seen
        ax.broken_barh(bars, (row - 0.35, 0.7), facecolors=color, edgecolors="white", linewidth=0.3)
    added = step_time(step)
    labels = [f"compute {added['compute_ms']:.1f} ms", f"communication {added['communication_ms']:.1f} ms",
              f"exposed {added['exposed_ms']:.1f} ms"]  # fmt: skip
    ax.set_yticks(range(len(LANES)), labels, fontsize=MIN_TEXT_PT)
    ax.set_ylim(len(LANES) - 0.5, -0.5)
    ax.set_xlim(0, step["step_ms"])
    ax.set_xlabel(f"ms since the step began (the step: {step['step_ms']:.1f} ms)", fontsize=MIN_TEXT_PT)
    ax.tick_params(axis="x", labelsize=MIN_TEXT_PT)
    if title:
        ax.set_title(title, fontsize=MIN_TEXT_PT)
    return ax


LAYER_COLORS = {"allocated before the step": "tab:brown", "rounding and unseen": "tab:pink",
                "cached": "lightgray", "outside the allocator": "black"}  # fmt: skip


def plot_memory_layers(rows: list[dict], axes=None, title: str = ""):
    """One bar a row, GB: the tracker's split at the peak (its categories' colours), then what the allocator holds
    beyond it (:func:`distlab.measure.allocator.memory_layers`), each row on its own scale. ``rows`` as
    :func:`~distlab.measure.allocator.sweep_memory_rows` returns them; a layer not measured is left out, and one
    below zero (the tracker counted a tensor allocated before the step) is drawn as nothing and named."""
    from ..measure.allocator import memory_layers
    from .memory import MEMORY_COLORS

    if axes is None:
        axes = plt.subplots(len(rows), 1, figsize=(COLUMN_INCHES, 1.4 + 0.8 * len(rows)), squeeze=False,
                            layout="constrained")[1][:, 0]  # fmt: skip
    for ax, row in zip(axes, rows):
        layers = memory_layers(row["peak_by_category"], row["cuda_memory"], row.get("device_used"))
        parts = [(name, row["peak_by_category"][name], color) for name, color in MEMORY_COLORS.items()]
        parts += [(name, layers[name], color) for name, color in LAYER_COLORS.items() if layers[name] is not None]
        left, drawn = 0.0, []
        for name, nbytes, color in parts:
            if nbytes > 0:
                ax.barh(0, nbytes / 1e9, left=left, color=color, edgecolor="white", linewidth=0.4,
                        label=name.replace("_", " "))  # fmt: skip
                left += nbytes / 1e9
                drawn.append(name)
        name = {"fsdp": "FSDP2"}.get(row["variant"], row["variant"].upper())
        ax.set_yticks([0], [f"{name}, {row['tokens']:,} tokens"], fontsize=MIN_TEXT_PT)
        ax.set_xlim(0, left * 1.02)
        ax.axvline(row["cuda_memory"]["max_allocated"] / 1e9, color="black", linestyle=":", linewidth=1)
        ax.tick_params(axis="x", labelsize=MIN_TEXT_PT)
    axes[-1].set_xlabel("GB at the step's peak (dotted: max_memory_allocated)", fontsize=MIN_TEXT_PT)
    handles = {h.get_label(): h for ax in axes for h in ax.get_legend_handles_labels()[0]}
    axes[0].figure.legend(handles.values(), handles.keys(), loc="outside lower center", ncol=3, fontsize=MIN_TEXT_PT,
                          frameon=False)  # fmt: skip
    if title:
        axes[0].figure.suptitle(title, fontsize=MIN_TEXT_PT + 1)
    return axes
