"""The FSDP2 chapter's answers: a model wrapped with ``fully_shard`` unit by unit, and what it gathers at once.

Written for reading: the defaults of every option. The library's versions are ``FSDP2.wrap`` in
:mod:`distlab.parallel.fsdp2` (every option) and ``expected_gathered_bytes`` in :mod:`distlab.predict.memory`.
"""

import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def shard_model(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for unit in model.shard_units():
        fully_shard(unit, mesh=mesh)  # one all-gather in forward, one in backward, one reduce-scatter
    fully_shard(model, mesh=mesh)  # last: the root takes the parameters no unit holds
    # only now: fully_shard has replaced every parameter with a sharded DTensor
    return torch.optim.SGD(model.parameters(), lr=lr)


def gathered_peak_bytes(units: list, n: int, reshard_after_forward: bool, bytes_per_value: int = 4) -> int:
    def whole(shape) -> int:  # one parameter gathered: dim 0 padded to a multiple of n
        rows, row = (shape[0], math.prod(shape[1:])) if len(shape) else (1, 1)
        return -(-rows // n) * n * row

    gathered = [sum(whole(shape) for shape in unit) for unit in units]
    *blocks, root = gathered
    if reshard_after_forward:  # the root stays gathered; the other units take turns
        return (root + max(blocks, default=0)) * bytes_per_value
    return sum(gathered) * bytes_per_value  # every unit kept from its forward to its backward
