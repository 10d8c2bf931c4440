"""ZeRO-1 as an optimizer (``distlab.parallel.sharded_optimizer``) on 2 and 3 gloo ranks: with the gradients
averaged by hand, it ends every step with exactly the weights of torch's ``ZeroRedundancyOptimizer`` and of a
plain optimizer (``torch.equal``), on a model with a frozen parameter and a tied one, two parameter groups and a
learning-rate schedule; each rank keeps the optimizer state of its own parameters only; what a rank saves, it
loads; and without a process group it says what to do."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer

from distlab.demos import sharded_optimizer as demo
from distlab.errors import DistlabError
from distlab.models import ATOL, RTOL
from distlab.parallel.sharded_optimizer import get_sharded_optimizer
from distlab.testing import assert_same_state, run_ranks

VOCAB, WIDTH, STEPS = 13, 6, 4
ADAMW = dict(lr=0.02, betas=(0.9, 0.95))


class TiedWithFrozen(nn.Module):
    """A token embedding tied to the output head (as a GPT's are) and a LayerNorm whose scale is frozen; no size
    divides evenly by 2 or 3."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix, self.out = nn.Linear(WIDTH, 10), nn.Linear(10, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.norm.weight.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        return self.head(self.norm(x + self.out(F.gelu(self.mix(x)))))


def _model() -> TiedWithFrozen:
    """The same weights on every rank and in the test process (the frozen scale is not 1: a step that moved it
    would show)."""
    model, generator = TiedWithFrozen(), torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(0.5 * torch.randn(param.shape, generator=generator))
    return model


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(100 * step + rank))
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(inputs).reshape(-1, VOCAB), targets.reshape(-1))


def _groups(model: TiedWithFrozen, tied_twice: bool = False) -> list[dict]:
    """Weight decay on the matrices only; the tied weight listed a second time (as the head's) if asked."""
    decay = [p for p in model.parameters() if p.dim() >= 2] + ([model.head.weight] if tied_twice else [])
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _make(kind: str, model: TiedWithFrozen) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    if kind == "sharded":
        optimizer = get_sharded_optimizer(_groups(model, tied_twice=True), torch.optim.AdamW, **ADAMW)
    elif kind == "torch":
        optimizer = ZeroRedundancyOptimizer(_groups(model), optimizer_class=torch.optim.AdamW, **ADAMW)
    else:
        optimizer = torch.optim.AdamW(_groups(model), **ADAMW)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))


def _train_step(model: nn.Module, optimizer, scheduler, step: int, rank: int, world_size: int) -> None:
    """One data-parallel step: this rank's batch, the gradients averaged over the ranks by hand, the step."""
    _loss(model, *_batch(step, rank)).backward()
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad.div_(world_size)
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def _names(model: nn.Module, params) -> list[str]:
    ids = {id(p) for p in params}
    return sorted(name for name, p in model.named_parameters() if id(p) in ids)


def _moment_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of Adam's two running moments in the optimizer's state on this rank."""
    return sum(s[k].numel() * s[k].element_size() for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq"))


def sharded_torch_and_plain(runtime, steps: int) -> dict:
    """The three optimizers side by side on copies of one model; every difference from the sharded one's
    weights after each step, its dealing and state, and whether a reload of its state steps on alike."""
    runs = {}
    for kind in ("sharded", "torch", "plain"):
        model = _model()
        runs[kind] = (model, *_make(kind, model))
    different = []
    for step in range(steps):
        for model, optimizer, scheduler in runs.values():
            _train_step(model, optimizer, scheduler, step, runtime.rank, runtime.world_size)
        mine = runs["sharded"][0].state_dict()
        for kind in ("torch", "plain"):
            theirs = runs[kind][0].state_dict()
            different += [f"step {step}, {kind}: {key}" for key in mine if not torch.equal(mine[key], theirs[key])]

    model, optimizer, scheduler = runs["sharded"]
    weights = {key: value.clone() for key, value in model.state_dict().items()}
    moments, plain_moments = _moment_bytes(optimizer), _moment_bytes(runs["plain"][1])

    # save and load this rank's state into a new optimizer over a copy of the model: both step on alike
    copied = copy.deepcopy(model)
    reloaded, reloaded_scheduler = _make("sharded", copied)
    reloaded.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # as saved: a state dict holds the live tensors
    reloaded_scheduler.load_state_dict(scheduler.state_dict())
    _train_step(model, optimizer, scheduler, steps, runtime.rank, runtime.world_size)
    _train_step(copied, reloaded, reloaded_scheduler, steps, runtime.rank, runtime.world_size)
    reload_differs = [
        key for key, value in model.state_dict().items() if not torch.equal(value, copied.state_dict()[key])
    ]

    return {
        "different": different,
        "weights": weights,
        "owned": _names(model, optimizer.owned()),
        "with_state": _names(model, optimizer.state),
        "values_owned": list(optimizer.values_owned),
        "moment_bytes": moments,
        "plain_moment_bytes": plain_moments,
        "reload_differs": reload_differs,
    }


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def ranks(request, tmp_path_factory):
    world_size = request.param
    return world_size, run_ranks(sharded_torch_and_plain, world_size, tmp_path_factory.mktemp("sharded"), STEPS)


def test_the_weights_are_torch_zero_redundancy_optimizers_and_a_plain_optimizers_to_the_last_bit(ranks):
    _, results = ranks
    for rank, result in enumerate(results):
        assert not result["different"], f"rank {rank}: {result['different']}"


def test_the_weights_are_one_process_trained_on_the_whole_batch(ranks):
    world_size, results = ranks
    model = _model()
    optimizer, scheduler = _make("plain", model)
    for step in range(STEPS):
        batches = [_batch(step, rank) for rank in range(world_size)]
        _loss(model, torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    assert_same_state(results[0]["weights"], model.state_dict(), atol=ATOL, rtol=RTOL, label="one process")
    assert torch.equal(results[0]["weights"]["norm.weight"], _model().norm.weight), "the frozen scale moved"


def test_each_rank_keeps_the_state_of_the_parameters_it_owns_and_no_other(ranks):
    world_size, results = ranks
    model = _model()
    trains = [name for name, p in model.named_parameters() if p.requires_grad]  # the tied weight once
    owned = [name for result in results for name in result["owned"]]
    assert sorted(owned) == sorted(trains), "every parameter that trains has exactly one owner; the frozen none"
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    largest = max(p.numel() for p in model.parameters())
    for rank, result in enumerate(results):
        assert result["with_state"] == result["owned"], f"rank {rank} keeps state it does not own"
        assert result["values_owned"] == results[0]["values_owned"], "every rank deals the same way"
        assert result["moment_bytes"] == 2 * 4 * result["values_owned"][rank]  # Adam's two fp32 moments
        assert result["plain_moment_bytes"] == 2 * 4 * total
    shares = results[0]["values_owned"]
    assert sum(shares) == total and max(shares) - min(shares) <= largest, shares  # whole parameters: near 1/N


def test_a_rank_that_loads_what_it_saved_steps_as_if_never_stopped(ranks):
    _, results = ranks
    assert all(not result["reload_differs"] for result in results), [r["reload_differs"] for r in results]


def test_the_chapters_demonstration_agrees_to_the_last_bit(tmp_path):
    """What the chapter runs (``distlab.demos.sharded_optimizer``): a GPT with its head tied to its embedding."""
    results = run_ranks(demo.run_all, 2, tmp_path, "gpt-tiny", 2, 1)
    for rank, result in enumerate(results):
        assert all(result["same_as_torch"]) and all(result["same_as_plain"]), f"rank {rank}: {result}"
        assert result["state_bytes"]["sharded"] == result["state_bytes"]["torch"] < result["state_bytes"]["plain"]
    assert sum(result["owned_values"] for result in results) == results[0]["values"]


def test_without_a_process_group_it_says_what_to_do():
    if dist.is_initialized():
        pytest.skip("this process already has a process group")
    with pytest.raises(DistlabError, match="init_process_group") as error:
        get_sharded_optimizer(_model().parameters(), torch.optim.AdamW, lr=0.01)
    assert "\n" not in str(error.value)
