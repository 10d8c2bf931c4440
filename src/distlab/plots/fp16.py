"""The fp16 chapter's pictures (``book/fp16.md``): where a gradient falls in fp16's range with and without the loss
scale, and what each rank found and did with its scaler on two ranks."""

from __future__ import annotations

import re

import matplotlib.pyplot as plt

from .common import COLUMN_INCHES, MIN_TEXT_PT

FP16_SMALLEST_SUBNORMAL = 2.0**-24
"""Below half of it an fp16 value rounds to 0 (``torch.finfo(torch.float16).smallest_normal * 2**-10``)."""
FP16_SMALLEST_NORMAL = 2.0**-14
"""Below it fp16 has fewer than 11 significant bits (``torch.finfo(torch.float16).smallest_normal``)."""
FP16_MAX = 65504.0
"""Above it an fp16 value is inf (``torch.finfo(torch.float16).max``)."""

_UNDERFLOW_LINE = re.compile(r"scale ([\d,]+): gradient (\S+) held as (\S+) \(([\d.]+)% off\)")
_SCALER_LINE = re.compile(r"rank (\d+) (.+?): inf in my shard ([01]), (stepped|skipped), scale now ([\d,]+)")


def underflow_records(output) -> dict[float, list[tuple[float, float, float]]]:
    """What the fp16 chapter's underflow program printed (its text, or anything with ``.stdout`` or ``.output``):
    by scale, each gradient's (true value, value held after unscaling, fraction off)."""
    text = getattr(output, "stdout", None) or getattr(output, "output", output)
    records: dict[float, list[tuple[float, float, float]]] = {}
    for found in _UNDERFLOW_LINE.finditer(text):
        scale, true, held, off = found.groups()
        records.setdefault(float(scale.replace(",", "")), []).append((float(true), float(held), float(off) / 100))
    if len(records) < 2:
        raise ValueError("no 'scale S: gradient G held as H (P% off)' lines for two scales: pass the output of the "
                         "underflow.py run")  # fmt: skip
    return records


def plot_underflow(output):
    """The underflow run on fp16's number line: a row per scale, each gradient drawn where fp16 held it in backward
    (the true gradient times the scale), against the bands fp16 has there (rounded to 0, subnormal with fewer bits,
    normal, inf); a dot's label is how far off the gradient came back once divided by the scale."""
    records = underflow_records(output)
    fig, ax = plt.subplots(figsize=(COLUMN_INCHES, 1.2 + 0.9 * len(records)))
    bands = [(1e-12, FP16_SMALLEST_SUBNORMAL / 2, "#f4b6b6", "rounds to 0"),
             (FP16_SMALLEST_SUBNORMAL / 2, FP16_SMALLEST_NORMAL, "#fde7b0", "subnormal:\nfewer bits"),
             (FP16_SMALLEST_NORMAL, FP16_MAX, "#d8ecd8", "normal: 11 significant bits"),
             (FP16_MAX, 1e7, "#f4b6b6", "inf")]  # fmt: skip
    for low, high, colour, label in bands:
        ax.axvspan(low, high, color=colour, zorder=0)
        ax.text((low * high) ** 0.5, len(records) - 0.35, label, ha="center", va="bottom", fontsize=MIN_TEXT_PT)
    rows = []
    for row, (scale, gradients) in enumerate(sorted(records.items(), reverse=True)):
        for true, _, off in gradients:
            held = max(true * scale, 1.5e-12)  # where it sat in fp16
            lost = off > 0.5
            ax.plot(held, row, "x" if lost else "o", color="tab:red" if lost else "tab:blue", ms=8)
            ax.annotate("lost" if lost else f"{off:.0%}", (held, row), xytext=(0, -14), textcoords="offset points",
                        ha="center", fontsize=MIN_TEXT_PT)  # fmt: skip
        rows.append("no scale" if scale == 1 else f"loss x {scale:,.0f}")
    ax.set_xscale("log")
    ax.set_xlim(1e-12, 1e7)
    ax.set_ylim(-0.7, len(records) + 0.1)
    ax.set_yticks(range(len(rows)), rows, fontsize=MIN_TEXT_PT)
    ax.tick_params(axis="x", labelsize=MIN_TEXT_PT)
    ax.set_xlabel("a gradient's value in fp16 during backward (label: how far off it came back)", fontsize=MIN_TEXT_PT)
    ax.set_title("Measured on this CPU: gradients 1e-3 to 1e-9 under autocast fp16", fontsize=MIN_TEXT_PT)
    fig.tight_layout()
    return fig


def scaler_records(output) -> dict[str, dict[int, dict]]:
    """What the fp16 chapter's two-rank run printed: by scaler in the order printed, then by rank, ``own_inf``
    (0 or 1), ``stepped`` and ``scale`` (after the step)."""
    text = getattr(output, "stdout", None) or getattr(output, "output", output)
    records: dict[str, dict[int, dict]] = {}
    for found in _SCALER_LINE.finditer(text):
        rank, name, own, what, scale = found.groups()
        records.setdefault(name, {})[int(rank)] = {"own_inf": int(own), "stepped": what == "stepped",
                                                   "scale": int(scale.replace(",", ""))}  # fmt: skip
    if not records or len({tuple(sorted(by_rank)) for by_rank in records.values()}) != 1:
        raise ValueError("no 'rank r NAME: inf in my shard F, stepped|skipped, scale now S' line for every rank: "
                         "pass the output of the fp16_ranks.py run")  # fmt: skip
    return records


def plot_scaler_run(output):
    """The two-rank run in the course's grammar: a panel per scaler, rows its ranks, columns what each rank found
    in its own shard, the found-inf its step obeyed, the step, the scale after. A red outline marks a found-inf that
    went into a collective: inferred from the run, where a rank skipped with no inf of its own (another rank's inf
    reached it); the title says whether the ranks still hold one model."""
    from .ring_animation import plot_holdings

    records = scaler_records(output)
    fig, axes = plt.subplots(len(records), 1, figsize=(COLUMN_INCHES, 1.75 * len(records) + 0.3), squeeze=False)
    columns = ["inf in my shard", "found-inf obeyed", "optimizer step", "scale after"]
    for ax, (name, by_rank) in zip(axes[:, 0], records.items()):
        ranks = sorted(by_rank)
        shared = any(not by_rank[r]["stepped"] and not by_rank[r]["own_inf"] for r in ranks)
        cells, shade = [], {}
        for r in ranks:
            rec = by_rank[r]
            obeyed = f"{0 if rec['stepped'] else 1} ({'shared' if shared else 'own'})"
            row = ["inf" if rec["own_inf"] else "finite", obeyed, "stepped" if rec["stepped"] else "skipped",
                   f"{rec['scale']:,}"]  # fmt: skip
            cells.append(row)
            shade.update({row[0]: 0.85 if rec["own_inf"] else 0.1, row[2]: 0.1 if rec["stepped"] else 0.85})
            shade.setdefault(row[1], 0.1 if rec["stepped"] else 0.85)
            shade.setdefault(row[3], 0.3)
        agree = len({by_rank[r]["stepped"] for r in ranks}) == 1 and len({by_rank[r]["scale"] for r in ranks}) == 1
        verdict = "the ranks agree: one model" if agree else "the ranks diverge: one stepped, one skipped"
        outlined = [(i, 1, None) for i in range(len(ranks))] if shared else []
        plot_holdings(ax, cells, outlined, columns, title=f"{name}: {verdict}", shade=shade)
    fig.tight_layout()
    return fig
