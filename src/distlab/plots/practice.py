"""The practice chapter's pictures (``book/practice.md``): who holds and sends what over a frozen base."""

from __future__ import annotations

import re
import textwrap

import matplotlib.pyplot as plt

from .common import COLUMN_INCHES, MIN_TEXT_PT

_FROZEN_LINE = re.compile(
    r"rank (\d+) (\S+): ([\d,]+) of ([\d,]+) values train; sent ([\d,]+) B in (.+); predicted ([\d,]+) B"
)


def frozen_base_records(output) -> dict[str, dict[int, dict]]:
    """What the practice chapter's frozen-base run printed (its job, or the output text), by strategy in the order
    printed, then by rank: ``trainable``, ``every`` (values), ``sent`` and ``predicted`` (bytes) and ``calls``."""
    records: dict[str, dict[int, dict]] = {}
    for line in getattr(output, "output", output).splitlines():
        found = _FROZEN_LINE.search(line)
        if found:
            rank, name, trainable, every, sent, calls, predicted = found.groups()
            pairs = (("trainable", trainable), ("every", every), ("sent", sent), ("predicted", predicted))
            number = {key: int(value.replace(",", "")) for key, value in pairs}
            counted = {op: int(k) for k, op in (part.split() for part in calls.split(", "))}
            records.setdefault(name, {})[int(rank)] = number | {"calls": counted}
    if not records or len({tuple(sorted(by_rank)) for by_rank in records.values()}) != 1:
        raise ValueError("no 'rank r NAME: T of E values train; sent ... B' line for every rank: pass the output of "
                         "the frozen_base.py run")  # fmt: skip
    return records


def plot_frozen_base_run(output, bytes_per_value: int = 4):
    """The frozen-base run in the course's grammar: a panel per strategy, rows its ranks, two columns (the frozen
    base, the trainable adapters); a cell is what the rank holds of them, a red outline marks values that go into
    the strategy's collectives, and under each column what one rank sends for it, at the ring volumes the run's
    TrafficCounter counts: DDP all-reduces the adapters' gradients (2(n-1)/n) and nothing of the base; FSDP2
    gathers both twice and reduce-scatters the adapters' gradients ((n-1)/n each). Each panel's title gives what
    the run printed; columns whose bytes do not add up to it are a ValueError."""
    from .ring_animation import plot_holdings

    records = frozen_base_records(output)
    world = len(next(iter(records.values())))
    ring = (world - 1) / world
    fig, axes = plt.subplots(len(records), 1, figsize=(COLUMN_INCHES, 2.3 * len(records) + 0.6), squeeze=False)
    for ax, (name, by_rank) in zip(axes[:, 0], records.items()):
        first = by_rank[min(by_rank)]
        trainable, frozen = first["trainable"], first["every"] - first["trainable"]
        sharded = "all_gather" in first["calls"]
        if sharded:  # gathered in forward and backward, frozen or not; only the adapters' gradients reduced
            sends = [2 * ring * frozen * bytes_per_value, 3 * ring * trainable * bytes_per_value]
            how = ["2 all-gathers", "2 all-gathers + reduce-scatter"]
        else:  # no gradient, no all-reduce for the frozen base
            sends = [0.0, 2 * ring * trainable * bytes_per_value]
            how = ["nothing: no gradient", "all-reduce of the gradients"]
        if round(sum(sends)) != first["sent"]:
            raise ValueError(f"{name} sent {first['sent']:,} B; its columns give {sum(sends):,.0f} B: pass the "
                             "output of the frozen_base.py run")  # fmt: skip
        state = ("weights only", "weights, grads, Adam")
        cells = [
            [(f"1/{world} of the rows" if sharded else "whole") + f"\n{what}" for what in state]
            for r in sorted(by_rank)
        ]
        shade = {cell: (0.35 if sharded else 0.85) for row in cells for cell in row}
        outlined = [(r, c, None) for r in range(world) for c in range(2) if sharded or c == 1]
        columns = [f"{label}\nsends {sent:,.0f} B\n({what})"
                   for label, sent, what in zip(("frozen base", "adapters"), sends, how)]  # fmt: skip
        plot_holdings(ax, cells, outlined, columns, shade=shade)
        title = (f"{name}: {trainable:,} of {first['every']:,} values train; each rank sent {first['sent']:,} B "
                 f"(predicted {first['predicted']:,} B)")  # fmt: skip
        ax.set_title(textwrap.fill(title, 80), fontsize=MIN_TEXT_PT)
    fig.tight_layout()
    return fig
