"""The DDP chapter's pictures draw the code's real traffic. P1 (who holds and sends what in one averaged step) is
drawn from the traced calls of the ``average_gradients`` solution on 3 gloo ranks: one all_reduce per trainable
parameter of ``ToyWithFrozen``, with its bytes, and none for the frozen bias. P2 (when each all-reduce is
posted) draws ``bucket_groups``' buckets in backward order, and the order and bytes it draws are those that
NaiveDDP and BucketedDDP send on real ranks."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
import torch
import torch.distributed as dist

from distlab.data import shard_indices
from distlab.exercises import run_on_ranks
from distlab.exercises.solutions.ddp import average_gradients
from distlab.models import ToyWithFrozen, build_model
from distlab.parallel.mini_ddp import BucketedDDP, NaiveDDP, bucket_groups
from distlab.plots import plot_bucket_schedule, plot_gradient_averaging, traced_all_reduces

CAP_MB = 0.5


def one_averaged_step() -> dict:
    """The page's traced step: the same model and 12 samples on every rank, backward on this rank's slice, then
    the chapter's first exercise (its solution) averages the gradients."""
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = ToyWithFrozen()
    inputs, labels = torch.randn(12, 11), torch.randint(0, 5, (12,))
    mine = shard_indices(12, n, rank, seed=0, epoch=0)
    torch.nn.functional.cross_entropy(model(inputs[mine]), labels[mine]).backward()
    average_gradients(model)
    return {"slice": mine, "weights": sum(p.sum().item() for p in model.parameters())}


def naive_then_bucketed_backward() -> None:
    """One backward under NaiveDDP, a barrier (to tell the two apart in the trace), one under BucketedDDP."""
    for wrapper in (NaiveDDP, lambda m: BucketedDDP(m, bucket_cap_mb=CAP_MB)):
        torch.manual_seed(0)
        model = wrapper(build_model("cnn"))
        images, labels = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        dist.barrier()


def _toy_parameters() -> list[tuple[str, int, bool]]:
    return [(name, p.numel() * p.element_size(), p.requires_grad) for name, p in ToyWithFrozen().named_parameters()]


@pytest.fixture(scope="module")
def averaged():
    return run_on_ranks(one_averaged_step, ranks=3)


def test_the_averaging_sends_one_all_reduce_per_trainable_parameter_and_none_for_the_frozen_bias(averaged):
    parameters = _toy_parameters()
    assert [(name, trainable) for name, _, trainable in parameters] == [
        ("fc1.weight", True), ("fc1.bias", False), ("fc2.weight", True), ("fc2.bias", True),
    ]  # fmt: skip
    for run in averaged:
        assert [(c["op"], c["bytes"]) for c in run.calls] == [
            ("all_reduce", 308),
            ("all_reduce", 140),
            ("all_reduce", 20),
        ]
        assert traced_all_reduces(run.calls, parameters) == [0, 2, 3]
    slices = [run.returned["slice"] for run in averaged]
    assert sorted(i for s in slices for i in s) == list(range(12)), "the slices are disjoint and cover the data"
    assert len({run.returned["weights"] for run in averaged}) == 1, "every rank holds the same weights"


def test_p1_outlines_exactly_the_traced_sends_and_fills_only_what_they_averaged(averaged):
    parameters = _toy_parameters()
    fig, (before, after) = plt.subplots(2, 1)
    sends = plot_gradient_averaging(
        (before, after),
        parameters,
        [run.calls for run in averaged],
        [run.returned["slice"] for run in averaged],
        [run.returned["weights"] for run in averaged],
        "traced on 3 gloo ranks",
    )
    columns = {name: 2 + i for i, (name, _, _) in enumerate(parameters)}
    trained = [columns["fc1.weight"], columns["fc2.weight"], columns["fc2.bias"]]
    assert sorted(sends) == sorted((r, c, None) for r in range(3) for c in trained)
    outlined = {(round(p.get_x()), 2 - round(p.get_y())) for p in before.patches if not p.get_fill()}
    assert outlined == {(c, r) for r in range(3) for c in trained}, "a red outline for each traced send, no other"
    assert not [p for p in after.patches if not p.get_fill()]
    labels = [t.get_text() for t in before.get_xticklabels()]
    assert labels[2:] == ["fc1.weight\n308 B", "fc1.bias\nfrozen", "fc2.weight\n140 B", "fc2.bias\n20 B"]
    cells = {
        (round(t.get_position()[0] - 0.46), 2 - round(t.get_position()[1] - 0.43)): t.get_text() for t in after.texts
    }
    for r in range(3):
        assert [cells[(c, r)] for c in trained] == ["0+1+2"] * 3
        assert cells[(columns["fc1.bias"], r)] == "no grad"
        assert cells[(0, r)] == " ".join(map(str, averaged[r].returned["slice"]))
    plt.close(fig)


def test_a_traced_call_that_carried_no_parameter_is_refused_not_drawn():
    with pytest.raises(ValueError, match="999 B"):
        traced_all_reduces([{"op": "all_reduce", "bytes": 999}], _toy_parameters())
    with pytest.raises(ValueError, match="20 B"):  # the frozen bias's size is 28 B; twice fc2.bias is one too many
        traced_all_reduces([{"op": "all_reduce", "bytes": 20}] * 2, _toy_parameters())


def _lane(ax, prefix: str) -> list[tuple[float, str]]:
    """(x, what) of the boxes of one lane, left to right."""
    return sorted((p.get_x(), p.get_gid()[len(prefix) :]) for p in ax.patches if (p.get_gid() or "").startswith(prefix))


def gradient_arrival(model: torch.nn.Module) -> list[str]:
    """The parameters' names in the order one backward completes their gradients (as the page records it)."""
    names, arrived = {p: name for name, p in model.named_parameters()}, []
    hooks = [p.register_post_accumulate_grad_hook(lambda p: arrived.append(names[p])) for p in model.parameters()]
    torch.manual_seed(0)
    images, labels = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
    torch.nn.functional.cross_entropy(model(images), labels).backward()
    for hook in hooks:
        hook.remove()
    return arrived


def test_p2_draws_bucket_groups_as_gradients_arrive_and_the_wrappers_real_all_reduces():
    cnn = build_model("cnn")
    names = {p: name for name, p in cnn.named_parameters()}
    parameters = [(name, p.numel() * p.element_size()) for name, p in cnn.named_parameters()]
    groups = [[names[p] for p in group] for group in bucket_groups(list(cnn.parameters()), int(CAP_MB * 2**20))]
    assert [name for group in groups for name in group] == [name for name, _ in reversed(parameters)]
    arrival = gradient_arrival(cnn)
    assert sorted(arrival) == sorted(names.values())
    fig, ax = plt.subplots()
    plot_bucket_schedule(ax, parameters, groups, arrival)
    backward = _lane(ax, "grad:")
    assert [name for _, name in backward] == arrival
    slot = {name: x for x, name in backward}
    drawn = [(x, what.split(":", 1)[1].split(",")) for x, what in _lane(ax, "bucket ")]
    assert sorted(members for _, members in drawn) == sorted(groups), "bucket_groups' buckets, each drawn once"
    for x, members in drawn:
        assert x == 1 + max(slot[name] for name in members), "posted right after its last gradient arrived"
    assert drawn[0][1] == groups[0] and groups[0][0] == "classifier.3.bias", "the last layer's bucket goes first"
    naive = _lane(ax, "naive:")
    assert [name for _, name in naive] == [name for name, _ in parameters]
    assert min(x for x, _ in naive) >= len(parameters), "NaiveDDP posts only after backward"
    assert "schematic: order, not durations" in ax.get_title() + ax.get_xlabel()
    plt.close(fig)

    size = dict(parameters)
    runs = run_on_ranks(naive_then_bucketed_backward, ranks=2)
    for run in runs:
        ops = [(c["op"], c.get("bytes")) for c in run.calls if c["op"] in ("all_reduce", "barrier")]
        cut = ops.index(("barrier", None))
        naive_sent, bucketed_sent = ops[:cut], ops[cut + 1 : -1]
        assert naive_sent == [("all_reduce", size[name]) for _, name in naive], "NaiveDDP's order and bytes"
        drawn_bytes = [("all_reduce", sum(size[name] for name in members)) for _, members in drawn]
        assert bucketed_sent == drawn_bytes, "BucketedDDP's all-reduces in the order drawn, with their bytes"
