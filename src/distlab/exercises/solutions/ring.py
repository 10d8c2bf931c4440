"""The ring chapter's answers: reduce-scatter, all-gather and all-reduce from point-to-point messages only.

Written for reading: one segment a hop, no chunking. The library's versions
(:mod:`distlab.comm.collectives`) run the same schedule, chunked and pipelined.
"""

import torch
import torch.distributed as dist

from distlab.comm.collectives import segment_bounds


def exchange(send: torch.Tensor, recv: torch.Tensor) -> None:
    """Send to the right-hand neighbour while receiving from the left-hand one."""
    rank, n = dist.get_rank(), dist.get_world_size()
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % n), dist.P2POp(dist.irecv, recv, (rank - 1) % n)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()


def ring_reduce_scatter(tensor: torch.Tensor) -> torch.Tensor:
    rank, n = dist.get_rank(), dist.get_world_size()
    segments = [tensor[a:b] for a, b in segment_bounds(tensor.numel(), n)]
    for hop in range(n - 1):
        send = segments[(rank - hop) % n]
        into = segments[(rank - hop - 1) % n]
        arrived = torch.empty_like(into)
        exchange(send, arrived)
        into += arrived
    return segments[(rank + 1) % n]


def ring_all_gather(tensor: torch.Tensor) -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    segments = [tensor[a:b] for a, b in segment_bounds(tensor.numel(), n)]
    for hop in range(n - 1):
        exchange(segments[(rank + 1 - hop) % n], segments[(rank - hop) % n])


def ring_all_reduce(tensor: torch.Tensor) -> None:
    ring_reduce_scatter(tensor)
    ring_all_gather(tensor)
