"""The checkpointing chapter's picture (``book/checkpointing.md``): what each rank holds of each block's activations
at the peak of a step, with and without checkpointing each block, drawn from what the page's run printed."""

from __future__ import annotations

import re
import textwrap

import matplotlib.pyplot as plt

from ..predict.checkpointing import LOSS_BYTES, checkpointed_activation_bytes, mlp_backward_bytes, mlp_block_bytes
from .common import COLUMN_INCHES, MIN_TEXT_PT

_LINE = re.compile(
    r"rank (\d+) (\S+), checkpointing ([^:]+): activations at the peak ([\d,]+) B; "
    r"step ([\d.]+) ms \(median of \d+, (\w+)\)"
)


def checkpointing_records(output) -> dict[tuple[str, str], dict[int, dict]]:
    """What the checkpointing chapter's run printed (its job, or the output text), by ``(strategy, where)`` in the
    order printed, then by rank: ``activations`` (bytes at the peak), ``step_ms`` and the ``machine`` it timed."""
    records: dict[tuple[str, str], dict[int, dict]] = {}
    for line in getattr(output, "output", output).splitlines():
        found = _LINE.search(line)
        if found:
            rank, strategy, where, activations, step_ms, machine = found.groups()
            record = {"activations": int(activations.replace(",", "")), "step_ms": float(step_ms), "machine": machine}
            records.setdefault((strategy, where), {})[int(rank)] = record
    if ("DDP", "none") not in records or len({tuple(sorted(by_rank)) for by_rank in records.values()}) != 1:
        raise ValueError("no 'rank r DDP, checkpointing none: activations at the peak ... B' line for every rank: "
                         "pass the output of the checkpointing.py run")  # fmt: skip
    return records


def plot_checkpointing_run(output, batch: int = 256, width: int = 64, hidden: int = 256, blocks: int = 4):
    """The run's DDP steps in the course's grammar: a panel with and one without checkpointing each block, rows
    the ranks, a column per block and one for the last block's backward and the loss; a cell says what the rank
    holds of it at the peak of the step (darker: more), and under each column its bytes, from the model of
    :mod:`distlab.predict.checkpointing` for the page's shapes (they add up to the prediction). Each panel's title
    gives what the run measured beside the prediction."""
    from .ring_animation import plot_holdings

    records = checkpointing_records(output)
    input_bytes, inside_bytes = mlp_block_bytes(batch, width, hidden)
    working = mlp_backward_bytes(batch, width, hidden) + LOSS_BYTES
    panels = [("none", "no checkpointing"), ("each block", "each block checkpointed")]
    fig, axes = plt.subplots(len(panels), 1, figsize=(COLUMN_INCHES, 4.8), squeeze=False)
    for ax, (where, name) in zip(axes[:, 0], panels):
        by_rank = records.get(("DDP", where))
        if by_rank is None:
            raise ValueError(f"no DDP line with checkpointing {where}: pass the output of the checkpointing.py run")
        checkpointed = where == "each block"
        kept = [input_bytes if checkpointed else input_bytes + inside_bytes for _ in range(blocks)]
        if checkpointed:
            kept[-1] += inside_bytes  # the last block, recomputed: its backward is where the peak falls
        labels = ["input only" if checkpointed else "input\n+ inside" for _ in range(blocks)]
        labels[-1] = "input + inside\n(recomputed)" if checkpointed else labels[-1]
        columns = [f"block {b}\n{held:,} B" for b, held in enumerate(kept)] + [f"backward, loss\n{working:,} B"]
        measured = by_rank[min(by_rank)]["activations"]
        predicted = checkpointed_activation_bytes(input_bytes, inside_bytes, blocks, checkpointed) + working
        cells = [[*labels, "gradients\nin flight"] for _ in sorted(by_rank)]
        shade = {
            "input only": 0.1,
            "input\n+ inside": 0.8,
            "input + inside\n(recomputed)": 0.8,
            "gradients\nin flight": 0.4,
        }
        plot_holdings(ax, cells, [], columns, shade=shade)
        title = f"DDP, {name}: each rank measured {measured:,} B of activations at the peak (predicted {predicted:,} B)"
        ax.set_title(textwrap.fill(title, 80), fontsize=MIN_TEXT_PT)
    fig.tight_layout()
    return fig
