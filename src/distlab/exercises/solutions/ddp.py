"""The DDP chapter's answers: the averaged all-reduce after backward, the same started from gradient hooks
during backward, and DistributedSampler's split of the data.

Written for reading: one all-reduce per parameter, no buckets. The library's wrappers
(:mod:`distlab.parallel.mini_ddp`) and loaders (:mod:`distlab.data`) do the same with the details added.
"""

import torch
import torch.distributed as dist


def average_gradients(model: torch.nn.Module) -> None:
    n = dist.get_world_size()
    for p in model.parameters():
        if p.grad is None:  # frozen, or not used by this forward
            continue
        dist.all_reduce(p.grad)  # in place: every rank now holds the sum
        p.grad /= n


def overlap_gradients(model: torch.nn.Module):
    n = dist.get_world_size()
    in_flight = []

    def launch(p: torch.Tensor) -> None:  # runs inside backward, the moment p.grad is complete
        p.grad /= n  # divide first, then sum: the result is the average
        in_flight.append(dist.all_reduce(p.grad, async_op=True))

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(launch)

    def finish() -> None:
        for work in in_flight:
            work.wait()
        in_flight.clear()

    return finish


def shard_indices(num_samples, world_size, rank, seed, epoch, drop_last) -> torch.Tensor:
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch))
    if drop_last:  # cut the tail: every rank gets num_samples // world_size
        per_rank = num_samples // world_size
    else:  # pad with the first indices: every rank gets ceil(num_samples / world_size)
        per_rank = -(-num_samples // world_size)
        order = torch.cat([order, order[: per_rank * world_size - num_samples]])
    return order[: per_rank * world_size][rank::world_size]
