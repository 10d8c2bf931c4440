"""The FSDP lab's figures, each drawn at notebook width (at most :data:`~distlab.plots.training.LAB_FIGURE_INCHES`
wide, every text at least :data:`~distlab.plots.common.MIN_TEXT_PT`): what a rank holds, predicted against
measured; the model sized for a GPU, predicted by category; tokens per second; and the FSDP options' step times."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter, MaxNLocator

from ..results import hardware_label
from .common import MIN_TEXT_PT
from .training import LAB_FIGURE_INCHES

FOOTPRINT_COLORS = {
    "parameters": "tab:blue",
    "gradients": "tab:orange",
    "optimizer_state": "tab:green",
    "buckets": "tab:olive",
    "gathered": "tab:purple",
}
"""What a rank holds before any activation, in the order the bars stack it: ``buckets`` is torch DDP's second copy
of every gradient (its default buckets), ``gathered`` FSDP's whole units in half precision."""
GIB, MIB = 2**30, 2**20


def _thousands(ax) -> None:
    """An x axis of few, short tick labels (``120k``), which do not run into each other at notebook width."""
    ax.xaxis.set_major_locator(MaxNLocator(4))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1e3:g}k" if v >= 1e3 else f"{v:g}"))


def warm_step_ms(record: dict) -> float:
    """The last (warm) epoch's time per optimizer step, in ms."""
    epoch = record["metrics"]["epochs"][-1]
    return 1000 * epoch["epoch_time_s"] / len(epoch["step_loss"])


def peak_allocated_gib(record: dict) -> float | None:
    """The highest ``torch.cuda.max_memory_allocated`` over the ranks of ``record``, in GiB; None on a CPU."""
    peaks = [m["cuda_max_allocated"] for m in record["metrics"]["memory"] if m["cuda_max_allocated"]]
    return max(peaks) / GIB if peaks else None


def number_range(low: float, high: float) -> str:
    """``low-high`` as a thousands-separated range, or one number when the two ends are the same."""
    return f"{low:,.0f}" if round(low) == round(high) else f"{low:,.0f}-{high:,.0f}"


def plot_state_against_prediction(rows: Sequence[tuple[str, int, int, int | None]], title: str, ax=None):
    """Per rank, what the memory model predicts it holds (hatched) against what it measured holding (its tensors'
    storage bytes), and the allocator's peak where a GPU recorded one. ``rows``: ``(label, predicted bytes,
    measured bytes, peak bytes or None)``."""
    ax = ax or plt.subplots(figsize=(LAB_FIGURE_INCHES, 1.0 + 0.55 * len(rows)))[1]
    for i, (_, predicted, measured, peak) in enumerate(rows):
        first = i == 0
        ax.barh(i - 0.2, predicted / MIB, 0.4, color="white", edgecolor="black", hatch="//",
                label="predicted: parameters + gradients + Adam" if first else None)  # fmt: skip
        ax.barh(i + 0.2, measured / MIB, 0.4, color="tab:green",
                label="measured: the rank's tensors (storage bytes)" if first else None)  # fmt: skip
        if peak:
            ax.plot(peak / MIB, i + 0.2, "k|", ms=14, label="measured: peak allocated (torch.cuda)" if first else None)
    ax.set_yticks(range(len(rows)), [label for label, *_ in rows])
    ax.invert_yaxis()
    ax.set(xlabel="MiB per rank")
    ax.set_title(title, fontsize=MIN_TEXT_PT + 1)
    ax.legend(fontsize=MIN_TEXT_PT, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    ax.figure.tight_layout()
    return ax


def plot_predicted_footprint(
    predicted: Mapping[str, Mapping[str, int]],
    capacity: int,
    title: str,
    measured_peaks: Mapping[str, Sequence[int]] | None = None,
    ran_out: Sequence[str] = (),
    capacity_label: str = "the GPU's memory",
    ax=None,
):
    """Each wrapper's bytes per rank, predicted by category (:data:`FOOTPRINT_COLORS`; a category a wrapper does
    not hold is 0), against the GPU's ``capacity`` (dashed); a wrapper's ``measured_peaks`` (bytes, one per rank)
    as diamonds where a run recorded them; the wrappers in ``ran_out`` marked so."""
    ax = ax or plt.subplots(figsize=(LAB_FIGURE_INCHES, 3.6))[1]
    names = []
    for i, (wrap, held) in enumerate(predicted.items()):
        left = 0.0
        for category, color in FOOTPRINT_COLORS.items():
            width = held.get(category, 0) / GIB
            label = f"predicted: {category.replace('_', ' ')}" if i == 0 else None
            ax.barh(i, width, 0.5, left=left, color=color, label=label)
            left += width
        peaks = (measured_peaks or {}).get(wrap)
        if peaks:
            ax.plot([p / GIB for p in peaks], [i] * len(peaks), "kD", label="measured: peak allocated, each rank")
        names.append(f"{wrap.upper()}\n{left:.2f} GiB, {100 * left * GIB / capacity:.0f} %"
                     + ("\nran out of memory" if wrap in ran_out else ""))  # fmt: skip
    ax.axvline(capacity / GIB, color="tab:red", ls="--", label=capacity_label)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    widest = max(sum(held.values()) for held in predicted.values())
    ax.set(xlabel="GiB per rank", xlim=(0, 1.1 * max(capacity, widest) / GIB))
    ax.set_title(title, fontsize=MIN_TEXT_PT + 1)
    ax.legend(fontsize=MIN_TEXT_PT, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    ax.figure.tight_layout()
    return ax


def plot_tokens_per_s(records: Mapping[str, dict], tokens_per_sample: Mapping[str, int], ax=None):
    """Training tokens per second of each run's last (warm) epoch, all ranks together: ``records`` by label,
    ``tokens_per_sample`` by label (the model's sequence length). DDP's runs blue, the others red."""
    ax = ax or plt.subplots(figsize=(LAB_FIGURE_INCHES, 1.2 + 0.45 * len(records)))[1]
    labels = list(records)
    tokens = [records[k]["metrics"]["epochs"][-1]["samples_per_s"] * tokens_per_sample[k] for k in labels]
    colors = ["tab:blue" if label.lower().endswith("ddp") else "tab:red" for label in labels]
    bars = ax.barh(labels, tokens, color=colors)
    ax.bar_label(bars, labels=[f"{v:,.0f}" for v in tokens], padding=3, fontsize=MIN_TEXT_PT)
    ax.set(xlabel="training tokens / s, all ranks (last epoch)", xlim=(0, 1.3 * max(tokens)))
    _thousands(ax)
    ax.invert_yaxis()
    ax.set_title(_measured_on(records.values()), fontsize=MIN_TEXT_PT)
    ax.figure.tight_layout()
    return ax


def plot_fsdp_step_options(records: Mapping[str, dict], title: str, ax=None):
    """The warm epoch's ms per optimizer step (:func:`warm_step_ms`) of each FSDP option, by label, the first the
    default; each bar says its ratio to the default."""
    ax = ax or plt.subplots(figsize=(LAB_FIGURE_INCHES, 1.2 + 0.45 * len(records)))[1]
    labels = list(records)
    times = [warm_step_ms(records[k]) for k in labels]
    bars = ax.barh(labels, times, color=["tab:gray", "tab:blue", "tab:orange", "tab:green"][: len(labels)])
    ax.bar_label(bars, labels=[f"{t:.1f} ms ({t / times[0]:.2f}x)" for t in times], padding=3, fontsize=MIN_TEXT_PT)
    ax.set(xlabel="ms per optimizer step (warm epoch)", xlim=(0, 1.4 * max(times)))
    ax.xaxis.set_major_locator(MaxNLocator(5))
    ax.invert_yaxis()
    ax.set_title(f"{title}, measured on {_measured_on(records.values(), prefix='')}", fontsize=MIN_TEXT_PT)
    ax.figure.tight_layout()
    return ax


def _measured_on(records, prefix: str = "measured on ") -> str:
    return prefix + "; ".join(sorted({hardware_label(r["environment"]) for r in records}))
