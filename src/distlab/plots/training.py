"""Training runs: loss curves and throughput, one line per run, and the labs' one speed-up.

Every lab compares its runs the same way (:func:`throughput_speedup`): training samples per second of the last
epoch, all ranks together, over the single run's. A ratio of epoch times would compare different amounts of work
wherever the runs' epochs hold different numbers of samples (``--max-steps`` caps steps, not samples)."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from ..config import TrainConfig
from .common import _hardware_title

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
