"""The ZeRO chapter's answers: a ZeRO-1 step, ZeRO-2's gradient shard, a ZeRO-3 unit, and the bytes each stage holds.

Written for reading: one flat buffer, padded to a multiple of the N ranks and cut into N equal shards, rank r
owning shard r, and torch's equal-shard collectives. The library does the same per bucket
(:mod:`distlab.parallel.zero`) or per shard unit (:mod:`distlab.parallel.zero3`), with the layout of
:class:`distlab.parallel.flat_param.FlatParams`.
"""

import torch
import torch.distributed as dist

from distlab.parallel.flat_param import all_gather_flat, reduce_scatter_flat


def zero1_step(flat_params, flat_grad, momentum, lr, beta):
    rank, n = dist.get_rank(), dist.get_world_size()
    size = flat_params.numel() // n  # the buffer is padded: every shard is the same size
    mine = slice(rank * size, (rank + 1) * size)
    if momentum is None:  # the first step: this rank's state is created for its shard only
        momentum = torch.zeros(size, dtype=flat_params.dtype, device=flat_params.device)
    momentum = beta * momentum + flat_grad[mine]
    stepped = flat_params[mine] - lr * momentum
    flat_params.copy_(all_gather_flat(stepped, flat_params.numel()))  # every rank's stepped shard, in rank order
    return momentum


def shard_gradient(grad):
    n = dist.get_world_size()
    size = -(-grad.numel() // n)  # ceil(numel / N)
    flat = torch.zeros(size * n, dtype=grad.dtype, device=grad.device)  # zero padding to a multiple of N
    flat[: grad.numel()] = grad.reshape(-1)
    flat /= n  # average before summing, as the library does
    return reduce_scatter_flat(flat, size)  # the sum over ranks of shard `rank`


def zero3_unit(shard, loss_fn):
    n = dist.get_world_size()
    full = all_gather_flat(shard, shard.numel() * n)  # the whole parameter, just before the unit computes
    full.requires_grad_(True)
    loss_fn(full).backward()
    flat_grad = full.grad / n
    del full  # the whole parameter and its whole gradient go: only shards outlive the call
    return reduce_scatter_flat(flat_grad, shard.numel())


BYTES_PER_VALUE = {"fp32": (4, 4, 8), "mixed": (2, 2, 12)}  # parameters, gradients, Adam's state
STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}


def bytes_per_rank(num_params, strategy, world_size, precision):
    param_bytes, grad_bytes, state_bytes = BYTES_PER_VALUE[precision]
    stage = STAGE[strategy]
    shard = -(-num_params // world_size)  # ceil(num_params / N)
    whole = num_params if stage == 0 else shard * world_size  # ZeRO's flat buffer is padded
    return {
        "parameters": param_bytes * (shard if stage >= 3 else whole),
        "gradients": grad_bytes * (shard if stage >= 2 else whole),
        "optimizer_state": state_bytes * (shard if stage >= 1 else whole) + 4,  # + Adam's step counter, a CPU tensor
    }
