"""Host-to-device copies: bandwidth by mode, copy/compute overlap, each against the stream model's
prediction (the pinned-memory chapter).
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

from ..predict.streams import MODES
from ..results import hardware_label
from .collectives import LINE_STYLES
from .streams import plot_stream_timelines


def plot_copy_bandwidth(record: dict, rank: int = 0, axes=None):
    """GB/s against copy size, host-to-device and device-to-host, one line per memory mode."""
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    measured = record["metrics"]["ranks"][rank]
    for ax, direction in zip(axes, ("h2d", "d2h")):
        for mode in MODES:
            color, style = LINE_STYLES[mode]
            rows = [r for r in measured["bandwidth"] if r["direction"] == direction and r["mode"] == mode]
            ax.plot([r["bytes"] for r in rows], [r["GBps"] for r in rows], style, color=color, label=mode, ms=4)
        ax.set(
            xscale="log", xlabel="bytes per copy", title={"h2d": "host to device", "d2h": "device to host"}[direction]
        )
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("GB/s (median, CUDA events)")
    axes[0].legend(fontsize=8)
    axes[0].figure.suptitle(f"rank {rank}: {measured['gpu']} - {hardware_label(record['environment'])}", fontsize=9)
    axes[0].figure.tight_layout()
    return axes


def plot_overlap_timeline(record: dict, rank: int = 0, axes=None):
    """Copy and compute intervals per batch: serial above, overlapped below."""
    overlap = record["metrics"]["ranks"][rank]["overlap"]
    if axes is None:
        _, axes = plt.subplots(2, 1, figsize=(10, 3.6), sharex=True)
    for ax, key in zip(axes, ("serial", "overlapped")):
        for lane, y, color in (("copy", 1, "tab:orange"), ("compute", 0, "tab:blue")):
            spans = [(i["start_ms"], i["dur_ms"]) for i in overlap["timeline"][key] if i["lane"] == lane]
            ax.broken_barh(spans, (y - 0.35, 0.7), facecolors=color, edgecolors="white")
        ax.set_yticks([1, 0], ["copy H2D", "compute"])
        ax.set_title(
            f"{key}: {overlap[f'{key}_s'] * 1e3:.1f} ms for {overlap['batches']} batches of "
            f"{overlap['batch_bytes'] >> 20} MB",
            fontsize=9,
        )
    axes[-1].set_xlabel("ms (CUDA events)")
    axes[0].figure.tight_layout()
    return axes


def plot_measured_vs_predicted_bandwidth(
    record: dict, predicted: Sequence[dict], rank: int = 0, caption: str = "", kind: str = "predicted"
):
    """Host-to-device GB/s (left) and the time the call blocked the host (right) against
    copy size: a GPU result's measurements as markers, the model's predictions as lines. ``kind`` names the lines:
    "predicted", or "fit" where the model's inputs came from the very copies drawn (in-sample)."""
    import textwrap

    _, axes = plt.subplots(1, 2, figsize=(11, 4))
    measured = record["metrics"]["ranks"][rank]
    for mode in MODES:
        color, style = LINE_STYLES[mode]
        rows = [r for r in measured["bandwidth"] if r["direction"] == "h2d" and r["mode"] == mode]
        guess = [r for r in predicted if r["mode"] == mode]
        for ax, key in zip(axes, ("GBps", "host_blocked_s")):
            ax.plot(
                [r["bytes"] for r in rows],
                [r[key] for r in rows],
                style[0],
                color=color,
                ms=5,
                ls="none",
                label=f"{mode}: measured",
            )
            ax.plot(
                [r["bytes"] for r in guess],
                [r[key] for r in guess],
                "-",
                color=color,
                alpha=0.6,
                lw=1.2,
                label=f"{mode}: {kind}",
            )
    axes[0].set(xscale="log", xlabel="bytes per copy", ylabel="GB/s (CUDA events)", title="host to device")
    axes[1].set(
        xscale="log",
        yscale="log",
        xlabel="bytes per copy",
        ylabel="s the call blocked the host",
        title="how long the call blocked",
    )
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=6, ncol=2)
    head = f"rank {rank}: {measured['gpu']} - measured on {hardware_label(record['environment'])}"
    lines = "lines predicted by the model: " if kind == "predicted" else f"lines: the model's {kind}, "
    text = head + ("; " + lines + caption if caption else "")
    axes[0].figure.suptitle("\n".join(textwrap.wrap(text, 160)), fontsize=8)
    axes[0].figure.tight_layout()
    return axes


def plot_transfer_against_model(record: dict, rank: int = 0, host: dict | None = None) -> tuple[list, str]:
    """A GPU result of :mod:`distlab.bench.transfer` next to the stream model's predictions from
    inputs measured in that same result (and ``host``, a :mod:`distlab.bench.host` result of the same machine
    and run, when there is one): the figures, and a Markdown summary that labels every number measured or
    predicted. The bandwidth lines are a fit: the model's inputs come from the copies they are drawn against
    (:func:`distlab.predict.stream_results.bandwidth_table` adds each size left out of its own fit)."""
    from ..predict import stream_results

    prediction = stream_results.predict_transfer_result(record, rank, host)
    measured_on = hardware_label(record["environment"])
    if prediction is None:
        return [], f"*{measured_on}: this result holds no host-to-device bandwidth rows to compare with.*"
    inputs = prediction["inputs"]
    caption = "in-sample, its inputs found on these very copies: " + inputs.describe()
    axes = plot_measured_vs_predicted_bandwidth(record, prediction["bandwidth"], rank, caption, kind="fit")
    figures = [axes[0].figure]
    gpu = record["metrics"]["ranks"][rank]
    lines = [
        f"**{gpu['gpu']}, rank {rank}** (measured on {measured_on}; the model's inputs, found on this same run: "
        f"{inputs.describe()})",
        "",
    ]
    if "overlap" in prediction:
        o = prediction["overlap"]
        figures.append(plot_overlap_timeline(record, rank)[0].figure)
        caption = (
            f"predicted by the model from the measured copy ({o['copy_s'] * 1e3:.2f} ms) and compute "
            f"({o['compute_s'] * 1e3:.2f} ms) of one batch"
        )
        figures.append(plot_stream_timelines([o["serial"], o["overlapped"]], caption=caption)[0].figure)
        lines.append(
            f"- side-stream overlap: measured {o['measured_speedup']:.2f}x, predicted {o['predicted_speedup']:.2f}x"
        )
    if "hazard" in prediction:
        h = prediction["hazard"]
        word = lambda stale: "stale" if stale else "up to date"
        lines.append(
            f"- early device-to-host read: measured {word(h['measured_stale'])}, predicted {word(h['predicted_stale'])}"
        )
    cost = max(gpu.get("pinning_cost") or [], key=lambda r: r["bytes"], default=None)
    if cost and "first_pin_memory_s" in cost:
        lines.append(
            f"- `pin_memory()` of {cost['bytes'] >> 20} MiB, measured: {cost['first_pin_memory_s'] * 1e3:.1f} ms on "
            f"the first call, {cost['cached_pin_memory_s'] * 1e3:.1f} ms from the cache, against "
            f"{cost['pageable_clone_s'] * 1e3:.1f} ms for a pageable clone"
        )
    loader = record["metrics"].get("loader") or []
    if loader:
        base = next(r for r in loader if r["variant"] == "pin_memory off, non_blocking off")["samples_per_s"]
        predicted = prediction.get("loader", {}).get("predicted", {})
        names = {
            "pin_memory off, non_blocking on": "pageable + non_blocking",
            "pin_memory on, non_blocking off": "pinned",
            "pin_memory on, non_blocking on": "pinned + non_blocking",
        }
        lines += [
            "",
            "| input pipeline | measured samples/s | measured speed-up | predicted speed-up |",
            "|---|---|---|---|",
        ]
        for row in loader:
            guess = predicted.get(names.get(row["variant"], ""))
            guessed = "" if guess is None else f"{guess:.2f}x"
            lines.append(
                f"| {row['variant']} | {row['samples_per_s']:,.0f} | {row['samples_per_s'] / base:.2f}x | {guessed} |"
            )
    return figures, "\n".join(lines)
