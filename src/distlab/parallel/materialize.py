"""A model built on the meta device, given real storage and its initial weights: the same weights on any
number of ranks and any sharding, the global RNG untouched. :meth:`.base.Strategy.build` decides the order
(materialise then wrap, or wrap then materialise only the shards); the course's ZeRO-3 initialises unit by
unit with :func:`init_module_whole`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import DistlabError


def materialize(model: nn.Module, device: torch.device, seed: int) -> nn.Module:
    """Give a model built (and perhaps sharded) on ``meta`` real storage on
    ``device`` and initialise it from ``seed``, leaving every global RNG as it was.

    Each rank allocates only what it holds: its shards, under a sharding
    strategy. The values do not depend on the sharding or the device: module
    by module, in order, the whole parameters are drawn on the CPU from the
    seeded generator (one module's worth at a time), and each rank keeps its
    part. So a model sharded over any number of ranks starts from exactly the
    weights one process would have.
    """
    tied = tied_parameters(model)
    model.to_empty(device=device)
    for places in tied:  # to_empty gives each place its own tensor unless a sharding wrapper keeps the tie
        (owner, attr), rest = places[0], places[1:]
        for module, name in rest:
            setattr(module, name, getattr(owner, attr))
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)  # the CPU's only: the draws happen there
        for module in model.modules():
            init_module_whole(model, module)
    return model


def init_module_whole(model: nn.Module, module: nn.Module) -> None:
    """Run ``model.init_module(module)`` on whole CPU copies of the module's own
    tensors, then copy into each tensor the part this rank holds."""
    held = {**module._parameters, **module._buffers}
    held = {name: tensor for name, tensor in held.items() if tensor is not None}
    if not held:
        model.init_module(module)
        return
    for name, tensor in held.items():
        whole = torch.empty(tensor.shape, dtype=tensor.dtype)  # a DTensor's shape is the whole one
        if name in module._parameters:
            module._parameters[name] = nn.Parameter(whole, requires_grad=tensor.requires_grad)
        else:
            module._buffers[name] = whole
    try:
        model.init_module(module)
    finally:
        for name, tensor in held.items():
            whole = module._parameters[name] if name in module._parameters else module._buffers[name]
            (module._parameters if name in module._parameters else module._buffers)[name] = tensor
            with torch.no_grad():
                _local(tensor).copy_(_my_part(whole.detach(), tensor))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _my_part(whole: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """The slice of ``whole`` that ``tensor`` (whole, or a DTensor sharded on dim 0) stores on this rank."""
    placements = getattr(tensor, "placements", ())
    part = whole
    for mesh_dim, placement in enumerate(placements):
        if placement.is_shard():
            # torch.chunk's split, as FSDP's Shard(0) uses: ceil(n / ranks) rows each, the last ranks fewer or none
            chunks = part.chunk(tensor.device_mesh.size(mesh_dim), dim=placement.dim)
            index = tensor.device_mesh.get_local_rank(mesh_dim)
            part = chunks[index] if index < len(chunks) else part.narrow(placement.dim, 0, 0)
    expected = _local(tensor).shape
    if part.shape != expected:
        raise DistlabError(f"cannot place a {tuple(whole.shape)} tensor on a shard of shape {tuple(expected)}")
    return part


def tied_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, attribute) that hold one and the same parameter."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            places.setdefault(id(param), []).append((module, name))
    return [group for group in places.values() if len(group) > 1]
