"""The communication hooks chapter's picture (``book/comm_hooks.md``): each hook's step time cut into the compute a
step without an all-reduce takes and what the all-reduce added, with the bytes it sent, beside each hook's loss."""

from __future__ import annotations

import re

import matplotlib.pyplot as plt

from .common import COLUMN_INCHES, MIN_TEXT_PT

_RUN_LINE = re.compile(
    r"^(.+?): sent ([\d,]+) B a step \(predicted ([\d,]+) B\); step ([\d.]+) ms median of (\d+) "
    r"\(([\d.]+) to ([\d.]+)\); loss ([\d.]+) -> ([\d.]+)\n  losses: ([\d. ]+)$",
    re.M,
)
COMPUTE_ONLY = "no all-reduce (no_sync)"
"""The run whose step is compute alone: every other run's step minus its step is what communication added."""


def hook_records(output) -> dict[str, dict]:
    """What the chapter's timing program printed (its text, or anything with ``.stdout`` or ``.output``): by run in
    the order printed, ``sent`` and ``predicted`` bytes a step, the step's ``median_ms``, ``low_ms`` and ``high_ms``
    over ``timed`` steps, and the ranks' mean ``losses``."""
    text = getattr(output, "stdout", None) or getattr(output, "output", output)
    records = {}
    for found in _RUN_LINE.finditer(text):
        name, sent, predicted, median, timed, low, high, _, _, losses = found.groups()
        records[name] = {"sent": int(sent.replace(",", "")), "predicted": int(predicted.replace(",", "")),
                         "median_ms": float(median), "timed": int(timed), "low_ms": float(low),
                         "high_ms": float(high), "losses": [float(v) for v in losses.split()]}  # fmt: skip
    if COMPUTE_ONLY not in records or len(records) < 2:
        raise ValueError(f"no 'NAME: sent B a step ...' lines for {COMPUTE_ONLY!r} and a hook: pass the output of "
                         "the hooks_timed.py run")  # fmt: skip
    return records


def plot_hooks_run(output):
    """Left: each run's median step, cut at the compute-only step's median (grey) and what the all-reduce added
    above it (blue), labelled with the bytes each rank sent; right: the ranks' mean loss at each step."""
    records = hook_records(output)
    compute = records[COMPUTE_ONLY]["median_ms"]
    fig, (times, losses) = plt.subplots(1, 2, figsize=(COLUMN_INCHES, 3.0), width_ratios=(1.25, 1))
    names = list(records)
    for row, name in enumerate(names):
        record = records[name]
        base = min(compute, record["median_ms"])
        times.barh(row, base, color="0.75")
        if name != COMPUTE_ONLY:
            times.barh(row, record["median_ms"] - base, left=base, color="tab:blue")
        times.plot([record["low_ms"], record["high_ms"]], [row, row], color="black", lw=0.8)
        label = "compute only" if name == COMPUTE_ONLY else f"{record['sent'] / 1e6:.1f} MB sent"
        times.text(record["high_ms"], row, f"  {label}", va="center", fontsize=MIN_TEXT_PT)
        losses.plot(range(1, len(record["losses"]) + 1), record["losses"], label=name, lw=1.2)
    times.set_yticks(range(len(names)), names, fontsize=MIN_TEXT_PT)
    times.invert_yaxis()
    times.set_xlim(0, max(r["high_ms"] for r in records.values()) * 1.6)
    times.set_xlabel("ms a step (median; line: fastest to slowest)", fontsize=MIN_TEXT_PT)
    times.tick_params(axis="x", labelsize=MIN_TEXT_PT)
    losses.set_xlabel("step", fontsize=MIN_TEXT_PT)
    losses.set_ylabel("loss (mean of the ranks)", fontsize=MIN_TEXT_PT)
    losses.tick_params(labelsize=MIN_TEXT_PT)
    losses.legend(fontsize=MIN_TEXT_PT, frameon=False)
    fig.suptitle("Measured on 2 gloo ranks of this CPU: grey compute, blue what the all-reduce added",
                 fontsize=MIN_TEXT_PT)  # fmt: skip
    fig.tight_layout()
    return fig
