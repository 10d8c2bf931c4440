"""The practice chapter's pictures (``book/practice.md``): who holds and sends what over a frozen base, and over
the micro-steps of one accumulated step."""

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


_MICRO_LINE = re.compile(
    r"rank (\d+) (.+?), micro-step (\d+): holds ([\d,]+) B above the shards; sent ([\d,]+) B in (.+)"
)
_PEAK_LINE = re.compile(r"rank (\d+) (.+?): peak ([\d,]+) B above the shards")
_CALL_NAMES = {"all_gather": "all-gathers", "reduce_scatter": "reduce-scatters", "all_reduce": "all-reduces"}


def accumulation_records(output) -> dict[str, dict[int, dict]]:
    """What the practice chapter's accumulation run printed (its job, or the output text), by mode in the order
    printed, then by rank: ``held`` and ``sent`` (bytes, one per micro-step), ``calls`` (one dict per micro-step)
    and ``peak`` (bytes)."""
    records: dict[str, dict[int, dict]] = {}
    text = getattr(output, "output", output)
    for rank, mode, micro, held, sent, calls in _MICRO_LINE.findall(text):
        mine = records.setdefault(mode, {}).setdefault(int(rank), {"held": {}, "sent": {}, "calls": {}})
        mine["held"][int(micro)], mine["sent"][int(micro)] = int(held.replace(",", "")), int(sent.replace(",", ""))
        mine["calls"][int(micro)] = {op: int(k) for k, op in (part.split() for part in calls.split(", "))}
    for rank, mode, peak in _PEAK_LINE.findall(text):
        records.get(mode, {}).get(int(rank), {})["peak"] = int(peak.replace(",", ""))
    complete = [
        sorted(mine["held"]) == list(range(1, len(mine["held"]) + 1)) and "peak" in mine
        for by_rank in records.values()
        for mine in by_rank.values()
    ]
    ranks = {tuple(sorted(by_rank)) for by_rank in records.values()}
    if len(records) < 2 or not all(complete) or len(ranks) != 1:
        raise ValueError("no 'rank r MODE micro-step m: holds ... sent ...' and 'peak' lines for every rank and mode: "
                         "pass the output of the accumulate_fsdp.py run")  # fmt: skip
    return records


def plot_accumulation_run(output):
    """The FSDP2 accumulation run in the course's grammar, one panel per mode (synchronised every micro-step, or
    only at the last): rows its ranks, columns the micro-steps of one optimizer step; a cell is what the rank holds
    of the gradients after that micro-step (a shard, light, or the whole, dark), a red outline marks a micro-step
    whose gradients went into a reduce-scatter, and under each column what one rank sent in it. Each panel's title
    gives the run's peak."""
    from .ring_animation import plot_holdings

    records = accumulation_records(output)
    world = len(next(iter(records.values())))
    largest = max(held for by_rank in records.values() for mine in by_rank.values() for held in mine["held"].values())
    fig, axes = plt.subplots(len(records), 1, figsize=(COLUMN_INCHES, 2.2 * len(records) + 0.6), squeeze=False)
    for ax, (mode, by_rank) in zip(axes[:, 0], records.items()):
        micro_steps = sorted(by_rank[min(by_rank)]["held"])
        cells = [
            [f"holds {by_rank[r]['held'][m]:,} B\n" + ("(whole)" if by_rank[r]["held"][m] == largest else "(a shard)")
             for m in micro_steps]
            for r in sorted(by_rank)
        ]  # fmt: skip
        shade = {cell: (0.85 if "whole" in cell else 0.3) for row in cells for cell in row}
        outlined = [(r, i, None) for r in range(world) for i, m in enumerate(micro_steps)
                    if "reduce_scatter" in by_rank[r]["calls"][m]]  # fmt: skip
        first = by_rank[min(by_rank)]
        columns = [
            f"micro-step {m}\nsends {first['sent'][m]:,} B in\n"
            + ",\n".join(f"{k} {_CALL_NAMES.get(op, op)}" for op, k in first["calls"][m].items())
            for m in micro_steps
        ]
        plot_holdings(ax, cells, outlined, columns, shade=shade)
        title = f"{mode}: each rank's peak {first['peak']:,} B above the shards"
        ax.set_title(textwrap.fill(title, 80), fontsize=MIN_TEXT_PT)
    fig.tight_layout()
    return fig
