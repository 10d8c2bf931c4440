"""The compile chapter's picture (``book/compile.md``): which compiled graph's backward runs, and which bucket's
all-reduce DDP starts, in the order the run printed them."""

from __future__ import annotations

import re

import matplotlib.pyplot as plt

from .common import COLUMN_INCHES, MIN_TEXT_PT

_RUN_LINE = re.compile(r"^(.+?): (\d+) graphs \[([\d, ]*)\], (\d+) graph breaks; backward: ?(.*)$")


def compiled_step_records(output) -> list[dict]:
    """What the compile chapter's run printed (its job, or the text), one record a configuration: ``label``,
    ``graphs`` (layers in each graph, forward order), ``breaks`` and ``events`` (``("backward", "g7")`` or
    ``("all-reduce", kib)``, in the order they ran)."""
    records = []
    for line in getattr(output, "output", output).splitlines():
        found = _RUN_LINE.match(line.strip())
        if not found:
            continue
        label, count, layers, breaks, events = found.groups()
        graphs = [int(n) for n in layers.split(",") if n.strip()]
        parsed = []
        for event in filter(None, (e.strip() for e in events.split(","))):
            kind, _, what = event.partition(" ")
            parsed.append(("all-reduce", int(what.split()[0])) if kind == "all-reduce" else ("backward", what))
        if len(graphs) != int(count):
            raise ValueError(f"{label!r} says {count} graphs but lists {len(graphs)}: pass the compiled_step.py run")
        records.append({"label": label, "graphs": graphs, "breaks": int(breaks), "events": parsed})
    if not records:
        raise ValueError("no 'LABEL: N graphs [...], B graph breaks; backward: ...' line: pass the output of the "
                         "compiled_step.py run")  # fmt: skip
    return records


def _size(kib: int) -> str:
    return f"{kib}K" if kib < 1024 else f"{kib / 1024:.0f}M"


def backward_lanes(record: dict) -> tuple[list[tuple[float, float, str]], list[tuple[float, float, str]]]:
    """The picture's two lanes, in units of one layer's 1 MiB: each compiled graph's backward, one after another,
    as wide as its layers; each all-reduce from the moment DDP starts it (after the backward that made its bucket
    ready) or the end of the one before (one at a time), as wide as its MiB. No graph: one eager backward."""
    compute: list[tuple[float, float, str]] = []
    comm: list[tuple[float, float, str]] = []
    layers = dict(enumerate(record["graphs"]))
    clock = 0.0
    if not record["graphs"]:
        clock = 8.0
        compute.append((0.0, clock, "eager backward: nothing compiled"))
    for kind, what in record["events"]:
        if kind == "backward":
            width = layers[int(what[1:])]
            compute.append((clock, width, what))
            clock += width
        else:
            start = max(clock, comm[-1][0] + comm[-1][1] if comm else 0.0)
            comm.append((start, max(what / 1024, 0.3), _size(what)))
    return compute, comm


def plot_compiled_backward(output, labels: tuple[str, ...] = ()):
    """A row per DDP configuration of the run (or the ``labels`` given): the compiled graphs' backward above, DDP's
    all-reduces below, in the order the run printed them. An all-reduce under a later backward overlaps it."""
    records = [r for r in compiled_step_records(output) if (r["label"] in labels if labels else "DDP" in r["label"])]
    fig, axes = plt.subplots(len(records), 1, figsize=(COLUMN_INCHES, 1.35 * len(records) + 0.5), squeeze=False)
    end = max(max((s + w for s, w, _ in lane), default=0) for r in records for lane in backward_lanes(r))
    for ax, record in zip(axes[:, 0], records):
        compute, comm = backward_lanes(record)
        for lane, boxes, color in ((1, compute, "#9ecae1"), (0, comm, "#fc9272")):
            for start, width, text in boxes:
                ax.barh(lane, width, left=start, height=0.7, color=color, edgecolor="black", linewidth=0.6)
                ax.text(start + width / 2, lane, text, ha="center", va="center", fontsize=MIN_TEXT_PT)
        ax.set_yticks([1, 0], ["backward", "all-reduce"], fontsize=MIN_TEXT_PT)
        ax.set_xlim(0, end + 0.2)
        ax.set_xticks([])
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        ax.set_title(f"{record['label']}: {len(record['graphs'])} graphs", fontsize=MIN_TEXT_PT + 1, loc="left")
    axes[-1, 0].set_xlabel("order of events, widths in MiB of parameters (a schematic, not a timing)",
                           fontsize=MIN_TEXT_PT)  # fmt: skip
    fig.tight_layout()
    return fig
