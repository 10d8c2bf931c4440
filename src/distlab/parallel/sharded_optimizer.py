"""ZeRO-1 as an optimizer: each rank owns whole parameters, keeps the optimizer state of those only, steps
them, and sends them to the other ranks.

This is the simplest form of ZeRO-1, and the interface of torch's
:class:`torch.distributed.optim.ZeroRedundancyOptimizer` and of Stanford CS336's assignment 2
(``get_sharded_optimizer(params, optimizer_cls, **kwargs)``). It wraps any ``torch.optim`` class:

* every parameter that trains (``requires_grad``) is given to one rank, its *owner*: largest first, each to the
  rank that owns the fewest values so far (torch's ``ZeroRedundancyOptimizer`` deals them out the same way).
  A parameter listed twice (a tied weight) is one parameter; a frozen one is nobody's;
* each rank builds the wrapped optimizer over the parameters it owns, with the same parameter groups and
  hyperparameters, so Adam's moments exist only on a parameter's owner: about ``1/N`` of them per rank;
* :meth:`ShardedOptimizer.step` runs that optimizer, then broadcasts each parameter from its owner, so every
  rank ends the step with the whole updated model.

The caller synchronises the gradients first, as for a plain optimizer under data parallelism (torch DDP, the
course's DDP, or an all-reduce by hand): every rank holds the averaged gradient of every parameter, and uses
only its own. Adam, AdamW and SGD update each parameter from its own gradient and state alone, so the owner's
step is the step a plain optimizer would take, to the last bit (``tests/test_sharded_optimizer.py``).

What it saves is the optimizer state, and only that. The paper's ZeRO-1 (:mod:`.zero`) cuts the parameters
into equal flat slices instead of dealing out whole ones (one large embedding cannot be split between
owners here), and reduce-scatters the gradients so each rank receives only the averages it steps.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..errors import DistlabError

NO_GROUP = (
    "the sharded optimizer deals parameters out to the ranks of a process group, and none is initialised: "
    "call torch.distributed.init_process_group first (torchrun, or distlab.runtime.distributed, does it for you)"
)


def _distinct(params) -> Any:
    """A group's parameters with a tensor listed twice (a tied weight) kept once, in first-seen order. A set
    is left for torch to refuse: its order differs from process to process, so ranks would deal differently."""
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, set):
        return params
    return list({id(p): p for p in params}.values())


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key not in ("params", "param_names")}


class ShardedOptimizer(torch.optim.Optimizer):
    """``optimizer_cls`` over the parameters this rank owns; :meth:`step` then broadcasts every parameter from
    its owner. Its ``param_groups`` hold every parameter, as a plain optimizer's would (a learning-rate
    scheduler changes them there); its ``state`` holds only what this rank owns."""

    def __init__(self, params, optimizer_cls: type[torch.optim.Optimizer], process_group=None, **kwargs: Any):
        if not (dist.is_available() and dist.is_initialized()):
            raise DistlabError(NO_GROUP)
        self.group = process_group
        self.rank, self.world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
        self.optimizer_cls, self.optimizer_kwargs = optimizer_cls, kwargs
        self.owner: dict[torch.Tensor, int] = {}
        """Each parameter that trains -> the rank (in ``process_group``) that steps it, in dealing order."""
        self.values_owned = [0] * self.world_size
        """How many parameter values each rank steps: the measure of its share of the optimizer state."""
        self.local: torch.optim.Optimizer | None = None
        super().__init__(params, kwargs)  # calls add_param_group for each group, which builds self.local
        self.state = self.local.state  # only the owned parameters ever get state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """A group of parameters, dealt out to the ranks: at construction, or while training (a layer unfrozen
        later comes as a new group; whether a parameter trains is read when its group is added)."""
        super().add_param_group({**param_group, "params": _distinct(param_group["params"])})
        group = self.param_groups[-1]
        trains = [p for p in group["params"] if p.requires_grad]
        for param in sorted(trains, key=lambda p: p.numel(), reverse=True):  # a stable sort: same on every rank
            owner = self.values_owned.index(min(self.values_owned))
            self.owner[param] = owner
            self.values_owned[owner] += param.numel()
        mine = {**_hyperparameters(group), "params": [p for p in trains if self.owner[p] == self.rank]}
        if self.local is None:
            self.local = self.optimizer_cls([mine], **self.optimizer_kwargs)
        else:
            self.local.add_param_group(mine)
        group.update(_hyperparameters(self.local.param_groups[-1]))  # the wrapped optimizer's defaults, shown

    def owned(self) -> list[torch.Tensor]:
        """The parameters this rank steps and keeps optimizer state for."""
        return [param for param, owner in self.owner.items() if owner == self.rank]

    def step(self, closure=None, **kwargs: Any):
        """Step this rank's parameters (their gradients already averaged over the ranks), then broadcast each
        parameter from its owner. Every rank must call it."""
        for local, group in zip(self.local.param_groups, self.param_groups):
            local.update(_hyperparameters(group))  # what a scheduler changed since the last step
        loss = self.local.step(**kwargs) if closure is None else self.local.step(closure, **kwargs)
        self.broadcast_parameters()
        return loss

    def broadcast_parameters(self) -> None:
        """Every parameter from its owner to every other rank, in place: the whole updated model everywhere.
        Each rank sends the values it owns and receives the rest, what an all-gather of the shards moves."""
        works = [
            dist.broadcast(param.detach(), group_src=owner, group=self.group, async_op=True)
            for param, owner in self.owner.items()
        ]
        for work in works:
            work.wait()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """What :meth:`state_dict` saved on this rank: its owned parameters' state, keyed as the whole
        optimizer's would be (the state dicts of all the ranks together are a plain optimizer's)."""
        super().load_state_dict(state_dict)
        self.local.state = self.state  # torch's load replaced the dict; the wrapped optimizer reads this one


def get_sharded_optimizer(params, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any) -> ShardedOptimizer:
    """ZeRO-1 over ``params`` (tensors or parameter groups): ``optimizer_cls(..., **kwargs)`` on the parameters
    this rank owns, the updated parameters broadcast after each step. ``process_group=`` picks the ranks that
    share the state (default: all of them). Average the gradients over the ranks before each ``step()``."""
    return ShardedOptimizer(params, optimizer_cls, **kwargs)
