"""Training runs: loss curves and throughput, one line per run."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

from .common import _hardware_title, run_label


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
