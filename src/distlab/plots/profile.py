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
