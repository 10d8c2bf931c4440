"""Training runs: loss curves and throughput, one line per run, the labs' one speed-up, and the FSDP lab's
figures (what a rank holds, predicted against measured; the model sized for a GPU; tokens per second; the FSDP
options' step times), each at notebook width: at most :data:`LAB_FIGURE_INCHES` wide, every text at least
:data:`~distlab.plots.common.MIN_TEXT_PT`.

Every lab compares its runs the same way (:func:`throughput_speedup`): training samples per second of the last
epoch, all ranks together, over the single run's. A ratio of epoch times would compare different amounts of work
wherever the runs' epochs hold different numbers of samples (``--max-steps`` caps steps, not samples)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

from ..config import TrainConfig
from ..results import hardware_label
from .common import MIN_TEXT_PT, _hardware_title

LAB_FIGURE_INCHES = 7.8
"""The widest a lab's figure is drawn: a notebook at a 900 px window shows about 790 px, at 100 dpi."""


def throughput(record: dict) -> float:
    """Training samples per second of ``record``'s last (warm) epoch, all ranks together."""
    return record["metrics"]["epochs"][-1]["samples_per_s"]


def throughput_speedup(record: dict, single: dict) -> float:
    """The labs' speed-up: ``record``'s :func:`throughput` over the ``single`` run's."""
    return throughput(record) / throughput(single)


def step_losses(record: dict) -> list[float]:
    """The training loss of every optimizer step of ``record``, epochs joined."""
    return [loss for epoch in record["metrics"]["epochs"] for loss in epoch["step_loss"]]


def step_loss_differences(record: dict, other: dict) -> list[float]:
    """The relative difference of the two runs' training losses at every step; a ValueError if they took different
    numbers of steps (then they did not train the same way)."""
    mine, theirs = step_losses(record), step_losses(other)
    if len(mine) != len(theirs) or not mine:
        raise ValueError(f"the runs took {len(mine)} and {len(theirs)} steps: they are not the same training")
    return [abs(a - b) / abs(b) for a, b in zip(mine, theirs, strict=True)]


def largest_step_loss_difference(record: dict, other: dict) -> tuple[int, float]:
    """How many steps the two runs took, and the largest of their :func:`step_loss_differences`."""
    differences = step_loss_differences(record, other)
    return len(differences), max(differences)


SAME_TRAINING = {
    "model": ("name",),
    "data": ("dataset", "synthetic_size", "loader"),
    "training": ("epochs", "accum_steps", "max_steps", "lr", "optimizer", "max_grad_norm", "seed"),
    "precision": ("dtype",),
}
"""What two ``distlab.train`` runs must share, besides the global batch, to take the same steps on the same data."""


def global_batch(record: dict) -> int:
    """Samples per optimizer step of a ``distlab.train`` run: the per-rank batch times the ranks."""
    return record["config"]["training"]["batch_size"] * record["environment"]["world_size"]


def same_training(record: dict, other: dict) -> bool:
    """Whether two ``distlab.train`` runs take the same optimizer steps on the same samples: the same global batch
    (one rank at 256 is two at 128) and the same :data:`SAME_TRAINING` settings. Their step losses then differ by
    float rounding only (:func:`largest_step_loss_difference`)."""
    a, b = record["config"], other["config"]
    same = all(a[group][key] == b[group][key] for group, keys in SAME_TRAINING.items() for key in keys)
    return same and global_batch(record) == global_batch(other)


def training_label(record: dict) -> str:
    """A run as a legend entry: strategy, ranks, loader, its batch said per rank (``--batch-size`` is per rank) and
    a precision other than the default; a plain-torch script's run (``fsdp_train.py``, ``ddp_train.py``) by its
    wrapper, ranks, batch and script."""
    config, ranks = record["config"], record["environment"]["world_size"]
    ranks_said = f"{ranks} rank{'s' if ranks > 1 else ''}"
    if "parallel" not in config:  # a script's record: its config is its command line's flags
        script = record.get("kind", "script").replace("_train", "_train.py")
        wrap = config.get("wrap", script.split("_")[0])
        return f"{wrap} ({ranks_said}, batch {config['batch_size']}/rank, {script})"
    extras = [config["data"]["loader"], f"batch {config['training']['batch_size']}/rank"]
    if config["precision"]["dtype"] != TrainConfig().precision.dtype:
        extras.append(config["precision"]["dtype"])
    return f"{config['parallel']['strategy']} ({ranks_said}, {', '.join(extras)})"


def _log_axis_with_labels(ax) -> None:
    """A log y axis that labels every integer multiple of a power of ten when the range spans less than one decade
    (the default labels only the decades: two labels over 0.8-2.4)."""
    low, high = ax.get_ylim()
    if high / low < 10:
        ax.yaxis.set_major_locator(LogLocator(subs="all"))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())


def plot_loss_curves(records: Sequence[dict], ax=None, smooth: int = 1):
    """Training loss per optimizer step (numbered from 1), one line per run, epochs joined."""
    ax = ax or plt.subplots(figsize=(7, 4))[1]
    for record, style in zip(records, ["-", "--", ":", "-."] * len(records)):
        losses = step_losses(record)
        if smooth > 1:
            losses = [
                sum(losses[max(0, i - smooth + 1) : i + 1]) / len(losses[max(0, i - smooth + 1) : i + 1])
                for i in range(len(losses))
            ]
        label = training_label(record)
        ax.plot(range(1, len(losses) + 1), losses, style, label=label)  # styles keep identical runs visible
    ax.set(xlabel="optimizer step", ylabel="training loss (mean over ranks)", yscale="log")
    _log_axis_with_labels(ax)
    ax.set_title(_hardware_title(records), fontsize=9)
    ax.legend(fontsize=9)
    ax.grid(alpha=0.3)
    return ax


def plot_throughput(records: Sequence[dict], ax=None, single: dict | None = None):
    """Training samples per second of each run's last epoch, all ranks together, as bars with the value written on
    them; with ``single``, each value's :func:`throughput_speedup` over it too."""
    ax = ax or plt.subplots(figsize=(7, 3.5))[1]
    names = [training_label(r) for r in records]
    values = [throughput(r) for r in records]
    labels = [
        f"{v:,.0f}" + (f" ({throughput_speedup(r, single):.2f}x)" if single else "") for v, r in zip(values, records)
    ]
    bars = ax.barh(names, values, color="tab:blue")
    ax.bar_label(bars, labels=labels, padding=3, fontsize=9)
    ax.set(xlabel="training samples / s, all ranks (last epoch)")
    ax.set_xlim(0, max(values) * (1.45 if single else 1.25))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1e3:g}k" if v >= 1e3 else f"{v:g}"))
    ax.invert_yaxis()
    ax.set_title(_hardware_title(records), fontsize=9)
    return ax


def plot_training_runs(records: Sequence[dict], single: dict | None = None, loss_records: Sequence[dict] | None = None):
    """A lab's comparison of its runs, at notebook width, as two figures: the throughput (with the speed-up over
    ``single``), then the training loss of ``loss_records`` (by default every run), its legend below the curves.
    Returns the two figures."""
    bars = plt.subplots(figsize=(LAB_FIGURE_INCHES, 0.8 + 0.4 * len(records)))[1]
    plot_throughput(records, ax=bars, single=single)
    bars.figure.tight_layout()
    loss_records = loss_records or records
    curves = plt.subplots(figsize=(LAB_FIGURE_INCHES, 3.0 + 0.25 * len(loss_records)))[1]
    plot_loss_curves(loss_records, ax=curves)
    curves.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=1, frameon=False)
    curves.figure.tight_layout()
    return bars.figure, curves.figure


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
