"""Typical wrong answers to the FSDP2 chapter's exercises, each with the mistake its check must name."""

import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def mesh_of(model):
    return init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))


def shard_root_first(model, lr):
    mesh = mesh_of(model)
    fully_shard(model, mesh=mesh)
    for unit in model.shard_units():
        fully_shard(unit, mesh=mesh)
    return torch.optim.SGD(model.parameters(), lr=lr)


def shard_root_only(model, lr):
    fully_shard(model, mesh=mesh_of(model))
    return torch.optim.SGD(model.parameters(), lr=lr)


def shard_units_no_root(model, lr):
    mesh = mesh_of(model)
    for unit in model.shard_units():
        fully_shard(unit, mesh=mesh)
    return torch.optim.SGD(model.parameters(), lr=lr)


def shard_optimizer_first(model, lr):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    mesh = mesh_of(model)
    for unit in model.shard_units():
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return optimizer


def shard_skips_last_unit(model, lr):
    mesh = mesh_of(model)
    for unit in model.shard_units()[:-1]:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return torch.optim.SGD(model.parameters(), lr=lr)


def whole(shape, n, pad=True):
    rows, row = (shape[0], math.prod(shape[1:])) if len(shape) else (1, 1)
    return (-(-rows // n) * n if pad else rows) * row


def peak_without_padding(units, n, reshard_after_forward, bytes_per_value=4):
    gathered = [sum(whole(s, n, pad=False) for s in unit) for unit in units]
    if reshard_after_forward:
        return (gathered[-1] + max(gathered[:-1], default=0)) * bytes_per_value
    return sum(gathered) * bytes_per_value


def peak_without_root(units, n, reshard_after_forward, bytes_per_value=4):
    gathered = [sum(whole(s, n) for s in unit) for unit in units[:-1]]
    if reshard_after_forward:
        return max(gathered, default=0) * bytes_per_value
    return sum(gathered) * bytes_per_value


def peak_ignores_the_option(units, n, reshard_after_forward, bytes_per_value=4):
    gathered = [sum(whole(s, n) for s in unit) for unit in units]
    return (gathered[-1] + max(gathered[:-1], default=0)) * bytes_per_value


def peak_of_every_unit(units, n, reshard_after_forward, bytes_per_value=4):
    return sum(sum(whole(s, n) for s in unit) for unit in units) * bytes_per_value


def peak_of_shards(units, n, reshard_after_forward, bytes_per_value=4):
    gathered = [sum(whole(s, n) for s in unit) for unit in units]
    if reshard_after_forward:
        return (gathered[-1] + max(gathered[:-1], default=0)) * bytes_per_value // n
    return sum(gathered) * bytes_per_value // n


# The answers a fifth review wrote and graded (its section 4)


def shard_on_a_cuda_mesh(model, lr):  # W13: copied from a GPU tutorial, run on the CPU
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    for unit in model.shard_units():
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return torch.optim.SGD(model.parameters(), lr=lr)


def shard_with_the_default_mesh(model, lr):  # V5: no mesh argument
    for unit in model.shard_units():
        fully_shard(unit)
    fully_shard(model)
    return torch.optim.SGD(model.parameters(), lr=lr)


def peak_pads_each_units_total(units, n, reshard_after_forward, bytes_per_value=4):  # W14: ZeRO's flat padding
    gathered = [-(-sum(math.prod(shape) for shape in unit) // n) * n for unit in units]
    *blocks, root = gathered
    if reshard_after_forward:
        return (root + max(blocks, default=0)) * bytes_per_value
    return sum(gathered) * bytes_per_value


ALTERNATIVES = [
    ("fsdp2_shard_model", shard_with_the_default_mesh),
]

MISTAKES = [
    ("fsdp2_shard_model", shard_root_first, "root_first", "the root before the units"),
    ("fsdp2_shard_model", shard_root_only, "root_only", "gathered at once"),
    ("fsdp2_shard_model", shard_units_no_root, "no_root", "the model itself is not"),
    ("fsdp2_shard_model", shard_optimizer_first, "optimizer_first", "are not in it"),
    ("fsdp2_shard_model", shard_skips_last_unit, "missed_unit", "blocks.2 of model.shard_units() not wrapped"),
    ("fsdp2_gathered_bytes", peak_without_padding, "no_padding", "cnn on 3 ranks"),
    ("fsdp2_gathered_bytes", peak_without_root, "forgot_root", "gpt-tiny on 2 ranks"),
    ("fsdp2_gathered_bytes", peak_ignores_the_option, "freed_after_forward", "reshard_after_forward=False"),
    ("fsdp2_gathered_bytes", peak_of_shards, "shards_not_whole", "got 141184, expected 282368"),
    ("fsdp2_gathered_bytes", peak_of_every_unit, "kept_until_backward", "prefetch can add the next unit's all-gather"),
    ("fsdp2_shard_model", shard_on_a_cuda_mesh, "mesh_device", 'init_device_mesh("cuda"'),
    ("fsdp2_gathered_bytes", peak_pads_each_units_total, "unit_padding", "got 819720, expected 826116"),
]
