"""What a strategy checkpoints: its model and optimizer tensors as DCP saves and loads them.

Each strategy names its layout (:attr:`.base.Strategy.checkpoint_layout`) and builds its state
(:meth:`.base.Strategy.checkpoint_state`); strategies with the same layout load each other's checkpoints,
on any number of ranks. :mod:`distlab.checkpoint` writes and reads the folders and never asks which strategy
it has.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from .mini_ddp import DataParallelWrapper

if TYPE_CHECKING:
    from .zero3 import ShardedParameters

PER_PARAMETER, FLAT_OPTIMIZER, FLAT = "per-parameter", "flat optimizer state", "flat parameters and optimizer state"


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP-style wrapper (FSDP2 shards in place: nothing to unwrap)."""
    return model.module if isinstance(model, (DistributedDataParallel, DataParallelWrapper)) else model


def initialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state (Adam's moments) so a load has tensors to fill:
    one step on zero gradients with a zero learning rate, which moves no parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if optimizer.state or any(p.grad is not None for p in params):
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    optimizer.zero_grad(set_to_none=True)


class CheckpointState:
    """Per parameter, by name: the model's state dict and the optimizer's state, as torch's
    ``get_state_dict`` names them (DTensor shards under FSDP2, whole tensors otherwise).

    :attr:`tensors` shares memory with the model and optimizer where it can, so a load fills them in place;
    :meth:`apply` finishes a load where it cannot."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        initialize_optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import get_state_dict  # DTensor, only once a checkpoint is made

        model_state, optimizer_state = get_state_dict(unwrap(model), optimizer)
        # The hyperparameters come from this run's flags; only the per-parameter state is saved.
        self.param_groups = optimizer_state["param_groups"]
        self.tensors = {"model": model_state, "optimizer": optimizer_state["state"]}

    def apply(self) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        optimizer_state = {"state": self.tensors["optimizer"], "param_groups": self.param_groups}
        set_state_dict(
            unwrap(self.model), self.optimizer, model_state_dict=self.tensors["model"], optim_state_dict=optimizer_state
        )


class FlatState(CheckpointState):
    """ZeRO-3: each unit's parameter slice and its optimizer state as DTensor pieces of the unit's flat
    vector (so any number of ranks reads its own slices); frozen and replicated parameters and buffers, whole
    on every rank, by name (the replicated ones' optimizer state as one flat tensor). Loaded in place."""

    def __init__(self, model: ShardedParameters, optimizer: torch.optim.Optimizer, device_type: str):
        self.model, self.optimizer = model, optimizer
        initialize_optimizer_state(optimizer)
        world = model.world_size
        names = {id(module): name for name, module in model.module.named_modules()}
        model_part, optimizer_part, sharded = {}, {}, set()
        for unit in model.forward_order:
            mesh = unit.collectives.owners_mesh(device_type, world)  # the ring keeps segment (r+1) % N on rank r
            key = f"unit.{names[id(unit.module)] or 'root'}"
            model_part[key] = unit.layout.shard_as_dtensor(unit.shard, mesh)
            optimizer_part |= unit.layout.shard_state_as_dtensors(key, optimizer.state[unit.shard], mesh)
            sharded.update(id(p) for p in unit.layout.params)
        if model.replicated is not None:  # whole on every rank, as the world size leaves them
            optimizer_part |= {f"replicated.{k}": v for k, v in optimizer.state[model.replicated.shard].items()}
        for key, tensor in model.module.state_dict(keep_vars=True).items():
            if id(tensor) not in sharded:
                model_part[key] = model.stored(tensor).detach()
        self.tensors = {"model": model_part, "optimizer": optimizer_part}

    def apply(self) -> None:
        """Loaded in place; frozen parameters' copies for compute follow their loaded values."""
        self.model.refresh_frozen()
