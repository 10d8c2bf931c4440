"""The course's ZeRO-3 overlaps its reduce-scatters with backward: each unit's starts, asynchronously, as soon
as the unit's gradient is complete, the next unit's backward computes while it runs, and it is waited for
only when the next unit's starts (one in flight at a time) or, for the last, when backward ends
(``finish_gradient_sync``). That it still trains like one process is the rest of the ZeRO-3 tests
(tests/test_zero3_replicate.py with torch's collectives, tests/test_zero3.py, tests/test_implementations.py).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from distlab.models import build_model
from distlab.parallel.flat_param import TorchCollectives
from distlab.parallel.zero3 import ShardedParameters


class _RecordedWork:
    def __init__(self, work, label: str, log: list):
        self.work, self.label, self.log = work, label, log

    def wait(self) -> None:
        self.log.append(("wait", self.label))
        self.work.wait()


class RecordingCollectives(TorchCollectives):
    """torch's collectives for one unit, writing each reduce-scatter to ``log``: started (and later waited
    for), or blocking."""

    def __init__(self, group, label: str, log: list):
        super().__init__(group)
        self.label, self.log = label, log

    def reduce_scatter(self, flat, owned):
        self.log.append(("blocking reduce-scatter", self.label))
        return super().reduce_scatter(flat, owned)

    def start_reduce_scatter(self, flat, owned):
        reduced, work = super().start_reduce_scatter(flat, owned)
        self.log.append(("start", self.label))
        return reduced, _RecordedWork(work, self.label, self.log)


def record_one_backward(runtime) -> list[tuple[str, str]]:
    """gpt-tiny's units (root, block 0, block 1) on torch's collectives: what happens, in order, from the
    start of backward to its end. ``backward X``: the gradient of unit X's output has arrived, so X's own
    backward computes next."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        plain = build_model("gpt-tiny")
    model = ShardedParameters(plain, plain.shard_units())
    log: list[tuple[str, str]] = []
    labels = {id(model.root): "root", **{id(unit): f"block {i}" for i, unit in enumerate(model.units)}}
    for unit in model.forward_order:
        unit.collectives = RecordingCollectives(unit.collectives.group, labels[id(unit)], log)

        def note_backward(module, args, output, label=labels[id(unit)]) -> None:
            output.register_hook(lambda grad: log.append(("backward", label)))

        unit.module.register_forward_hook(note_backward)
    finish = model.finish_gradient_sync

    def recorded_finish() -> None:
        log.append(("finish_gradient_sync", "begins"))
        finish()
        log.append(("finish_gradient_sync", "ends"))

    model.finish_gradient_sync = recorded_finish
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(runtime.rank))
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    log.append(("loss.backward()", "called"))
    loss.backward()
    log.append(("loss.backward()", "returned"))
    return log


def test_each_reduce_scatter_starts_async_and_overlaps_the_next_units_backward(ranks2):
    for log in ranks2.run(record_one_backward):
        _check_overlapped(log)


def _check_overlapped(log: list[tuple[str, str]]) -> None:
    assert not [event for event in log if event[0] == "blocking reduce-scatter"], log
    at = partial(_index, log)
    # backward runs the root's head first, then block 1, block 0; the root's gradient (its embeddings) is last
    assert [label for kind, label in log if kind == "backward"] == ["root", "block 1", "block 0"], log
    assert [label for kind, label in log if kind == "start"] == ["block 1", "block 0", "root"], log
    # block 1's reduce-scatter runs while block 0's backward computes, and is waited for only after it
    assert at("start", "block 1") < at("backward", "block 0") < at("wait", "block 1") < at("start", "block 0")
    # one reduce-scatter in flight at a time: every start but the first comes after the wait of the one before
    kinds = [(kind, label) for kind, label in log if kind in ("start", "wait")]
    assert kinds == [(k, u) for u in ("block 1", "block 0", "root") for k in ("start", "wait")], log
    # the last one is waited for when backward ends, before loss.backward() returns
    begins, ends = at("finish_gradient_sync", "begins"), at("finish_gradient_sync", "ends")
    assert begins < at("wait", "root") < ends < at("loss.backward()", "returned"), log


def _index(log: list, kind: str, label: str) -> int:
    return log.index((kind, label))
