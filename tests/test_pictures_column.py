"""Every picture of who holds and sends what is drawn for the column it is shown in: the book's content column is
688 px wide (Jupyter Book 1.x's theme in a 1280 px window) and the pages draw at ``figure.dpi`` 100, saved with
``bbox_inches="tight"`` as the notebook's inline backend saves them. A wider image is scaled down to 688 px, its
text with it. Each figure is built here as its page builds it, and must show at most three panels a row and every
text at 9 pt or more as displayed: the font size times the display scale, min(1, 688 / the image's width in px),
times dpi / 100 (a pixel of a 100 dpi image is a pixel of the page)."""

from __future__ import annotations

import io
import struct

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from distlab import plots  # noqa: E402
from distlab.models import (
    ToyWithFrozen,  # noqa: E402
    build_model,  # noqa: E402
)
from distlab.parallel.mini_ddp import bucket_groups  # noqa: E402
from distlab.plots.ring_animation import animation  # noqa: E402
from distlab.predict.costmodel import collective_calls  # noqa: E402
from distlab.predict.memory import shard_unit_shapes  # noqa: E402
from distlab.predict.streams import Inputs  # noqa: E402

COLUMN_PX, MIN_PT, MAX_PANELS_A_ROW = 688, 9.0, 3
MiB = 2**20
FSDP_UNITS = [("layer 0", [(16, 16), (16,)]), ("layer 2", [(8, 16), (8,)])]  # fsdp2_in_practice.md's two units
# rank 0's trace of that page's step on 2 gloo ranks (content review 5, section 3): the calls the picture draws
FSDP_CALLS = [{"op": "all_gather_single", "bytes": b} for b in (1088, 544, 544, 1088)] + [
    {"op": "reduce_scatter_single", "bytes": b} for b in (272, 544)
]
MLP_LAYERS = [(f"layer {i}", [(512, 512), (512,)]) for i in range(4)]  # ddp_vs_fsdp.md's four-layer MLP
# what that page's ddp_or_fsdp.py prints on 2 ranks (torchrun's output, as launch.torchrun returns it)
DDP_OR_FSDP_OUTPUT = "\n".join(
    f"rank {r} DDP: holds 4.01 MiB of parameters, sent 4.01 MiB in 1 all_reduce\n"
    f"rank {r} FSDP2: holds 2.00 MiB of parameters, sent 6.01 MiB in 8 all_gather, 4 reduce_scatter"
    for r in range(2)
)


def _gradient_averaging():  # ddp.md: its own 9 x 5.2 in figure, its two Axes handed in
    fig, axes = plt.subplots(2, 1, figsize=(9, 5.2))
    parameters = [
        (name, p.numel() * p.element_size(), p.requires_grad) for name, p in ToyWithFrozen().named_parameters()
    ]
    calls = [{"op": "all_reduce", "bytes": size} for _, size, trainable in parameters if trainable]
    slices, weights = [[8, 9, 2, 1], [0, 7, 10, 11], [5, 4, 3, 6]], [-0.985986] * 3
    plots.plot_gradient_averaging(axes, parameters, [calls] * 3, slices, weights, "traced on 3 gloo ranks, this CPU")
    fig.tight_layout()
    return fig


def _bucket_schedule():  # ddp.md: the CNN, 0.5 MiB buckets, in a 10 x 3.4 in figure of the page's
    cnn = build_model("cnn")
    names = {p: name for name, p in cnn.named_parameters()}
    buckets = [[names[p] for p in group] for group in bucket_groups(list(cnn.parameters()), int(0.5 * MiB))]
    fig, ax = plt.subplots(figsize=(10, 3.4))
    parameters = [(name, p.numel() * p.element_size()) for name, p in cnn.named_parameters()]
    title = "the CNN's all-reduces, bucket_cap_mb=0.5: schematic, order, not durations"
    plots.plot_bucket_schedule(ax, parameters, buckets, [name for name, _ in parameters][::-1], title=title)
    fig.tight_layout()
    return fig


def _step_collectives():  # fsdp_from_scratch.md: gpt-tiny's step on 2 ranks, four rows
    units = shard_unit_shapes(build_model("gpt-tiny"))
    rows = {"DDP": ["ddp"], "ZeRO-1, ZeRO-2": ["zero1", "zero2"], "ZeRO-3": ["zero3"],
            "ZeRO-3, reshard_after_forward=False": ["zero3-no-reshard"]}  # fmt: skip
    calls = {label: plots.step_call_order(v[0], collective_calls(v[0], units, 2, "gloo")) for label, v in rows.items()}
    ax = plots.plot_step_collectives(
        calls, 2, title="predicted by collective_calls: one step of gpt-tiny on 2 ranks, fp32"
    )
    return ax.figure


def _copy_paths():  # pinned_memory.md: an 8 MiB copy, a host like the committed one
    inputs = Inputs(link_GBps=15.75, stage_GBps=8.0, api_s=5e-6)
    return plots.plot_copy_paths(inputs, 8 * MiB, caption=inputs.describe()).flat[0].figure


def _ring_animation():  # ring_allreduce.md: animation(n=4), each frame drawn on one figure
    anim = animation(n=4)
    anim._init_draw()  # noqa: SLF001 (the first frame, as to_jshtml draws it)
    return anim._fig  # noqa: SLF001


PICTURES = {
    "ring strip": lambda: plots.plot_ring_steps(3)[0].figure,
    "ring animation": _ring_animation,
    "sharding bridge": lambda: plots.plot_sharding_bridge(3)[0].figure,
    "gradient averaging": _gradient_averaging,
    "bucket schedule": _bucket_schedule,
    "shard steps": lambda: plots.plot_shard_steps(3, 5)[0].figure,
    "step collectives": _step_collectives,
    "state bars": lambda: (
        plots.plot_state_bars(7_000_000_000, world_sizes=(4, 8), precisions=("fp32", "mixed"))[0].figure
    ),
    "copy paths": _copy_paths,
    "fsdp unit steps": lambda: plots.plot_fsdp_unit_steps(
        FSDP_CALLS,
        FSDP_UNITS,
        2,
        caption="traced from the run above, 2 gloo ranks, torch 2.14.1; each panel is the "
        "state after one collective, and a red outline marks the cells it filled",
    ),
    "ddp or fsdp run": lambda: plots.plot_ddp_or_fsdp_run(DDP_OR_FSDP_OUTPUT, MLP_LAYERS),
}


def image_width_px(fig) -> int:
    """The width of the PNG the page shows: the figure saved as the inline backend saves it."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")
    return struct.unpack(">I", buffer.getvalue()[16:20])[0]  # the IHDR chunk's width


def drawn_texts(fig) -> list[Text]:
    """Every text the figure draws: visible, not empty, not in a hidden Axes, not a tick or axis label of an Axes
    whose axis is off."""
    hidden: set[int] = set()
    for ax in fig.axes:
        if not ax.get_visible():
            hidden |= {id(t) for t in ax.findobj(Text)}
        elif not ax.axison:
            hidden |= {id(t) for axis in (ax.xaxis, ax.yaxis) for t in axis.findobj(Text)}
    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip() and id(t) not in hidden]


def panels_a_row(fig) -> list[int]:
    """How many drawn Axes sit side by side in each row of the figure (their heights overlapping)."""
    boxes = sorted((ax.get_position() for ax in fig.axes if ax.get_visible() and ax.axison), key=lambda b: -b.y1)
    rows: list[list] = []
    for box in boxes:
        row = next((r for r in rows if min(box.y1, r[0].y1) - max(box.y0, r[0].y0) > 0.5 * box.height), None)
        row.append(box) if row is not None else rows.append([box])
    return [len(r) for r in rows]


@pytest.mark.parametrize("name", list(PICTURES))
def test_each_picture_is_drawn_for_the_books_column(name):
    with plt.rc_context({"figure.dpi": 100}):  # what every page sets
        torch.manual_seed(0)
        fig = PICTURES[name]()
        width = image_width_px(fig)
        scale = min(1.0, COLUMN_PX / width) * fig.dpi / 100
        assert width <= COLUMN_PX, f"{name}: {width} px wide, shown at {scale:.2f} of its size"
        assert max(panels_a_row(fig)) <= MAX_PANELS_A_ROW, f"{name}: {panels_a_row(fig)} panels a row"
        small = sorted({(round(t.get_fontsize() * scale, 1), t.get_text()[:40]) for t in drawn_texts(fig)})
        small = [(size, text) for size, text in small if size < MIN_PT]
        assert not small, f"{name}: {len(small)} texts under {MIN_PT:g} pt as shown, e.g. {small[:3]}"
    plt.close("all")


def test_the_measure_sees_a_picture_too_wide_and_a_text_too_small():
    """The walk finds what it measures: a 10 in figure of four panels with a 7 pt label fails all three checks."""
    with plt.rc_context({"figure.dpi": 100}):
        fig, axes = plt.subplots(1, 4, figsize=(10, 2))
        axes[0].text(0.5, 0.5, "small", fontsize=7)
        width = image_width_px(fig)
        assert width > COLUMN_PX and panels_a_row(fig) == [4]
        assert min(t.get_fontsize() for t in drawn_texts(fig)) == 7 and "small" in [
            t.get_text() for t in drawn_texts(fig)
        ]
        axes[1].set_visible(False)
        assert panels_a_row(fig) == [3]
    plt.close("all")
