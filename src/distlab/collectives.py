"""All-reduce written by hand with point-to-point messages only.

Three versions, from naive to the one that matches the library collective:

* :func:`reduce_broadcast_all_reduce`: everyone sends to rank 0, rank 0 adds
  and sends the sum back. Rank 0 receives ``(n-1) S`` bytes and then sends
  ``(n-1) S``; it is the bottleneck.
* :func:`naive_ring_all_reduce`: the whole tensor travels around the ring,
  ``n-1`` hops; every rank sends ``(n-1) S`` bytes.
* :func:`ring_all_reduce`: ring reduce-scatter, then ring all-gather, each
  over ``n`` segments; every rank sends ``2(n-1)/n * S`` bytes, which does not
  grow with ``n``. Segments are cut into chunks and streamed, so adding one
  chunk overlaps the transfer of the next, across hops and phases.

Every send is paired with its receive in one ``batch_isend_irecv`` call, so
the pattern cannot deadlock on NCCL, where a blocking send waits for its
receiver. All functions sum in place and return the tensor.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_CHUNK_BYTES = 4 << 20
# Segments from this size on are cut into at least two chunks so that hops
# overlap; below it the extra message costs more latency than it hides.
SPLIT_FROM_BYTES = 2 << 20


@dataclass
class Traffic:
    """Bytes and messages this rank sent: the quantity the ring minimises."""

    bytes_sent: int = 0
    messages: int = 0

    def add(self, tensor: torch.Tensor) -> None:
        self.bytes_sent += tensor.numel() * tensor.element_size()
        self.messages += 1


class _Ring:
    """This rank's neighbours in ``group``, as global ranks (p2p wants those)."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = self.global_rank((self.rank + 1) % self.size)
        self.prev = self.global_rank((self.rank - 1) % self.size)

    def global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def exchange(self, send: torch.Tensor | None, recv: torch.Tensor | None, traffic: Traffic | None):
        """Post a send to ``next`` and a receive from ``prev`` together; return the works."""
        ops = []
        if send is not None and send.numel():
            ops.append(dist.P2POp(dist.isend, send, self.next, self.group))
            if traffic is not None:
                traffic.add(send)
        if recv is not None and recv.numel():
            ops.append(dist.P2POp(dist.irecv, recv, self.prev, self.group))
        return dist.batch_isend_irecv(ops) if ops else []


def _host_staged(fn):
    """gloo moves host memory only: run on a CPU copy of a CUDA tensor and copy
    the result back (gloo's own CUDA collectives stage through the host too)."""

    @functools.wraps(fn)
    def wrapper(tensor: torch.Tensor, group=None, *args, **kwargs):
        if tensor.is_cuda and dist.get_backend(group) == "gloo":
            staged = tensor.cpu()
            result = fn(staged, group, *args, **kwargs)
            tensor.copy_(staged)
            return tensor if result is staged else result.to(tensor.device)
        return fn(tensor, group, *args, **kwargs)

    return wrapper


def _wait(works) -> None:
    for work in works:
        work.wait()


def _flat_view(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A contiguous 1-D view to work in; a copy (to write back) if ``tensor`` is not contiguous."""
    if tensor.is_contiguous():
        return tensor.view(-1), False
    return tensor.contiguous().view(-1), True


def segment_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` near-equal slices of ``range(numel)``; the first ``numel % parts`` are one longer.
    Some are empty when ``numel < parts``."""
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _chunks(segment: torch.Tensor, chunk_elems: int) -> list[torch.Tensor]:
    return list(segment.split(chunk_elems)) if segment.numel() else []


def _ring_pipeline(flat: torch.Tensor, ring: _Ring, phases: tuple[bool, ...], chunk_bytes: int, traffic: Traffic | None, max_in_flight: int = 8) -> None:
    """The ring's phases over ``n`` segments of ``flat``, as one stream of chunk exchanges.

    A phase is ``n-1`` hops. Reduce-scatter (``True``): at hop ``s`` rank ``r``
    sends segment ``r-s`` and adds what it receives into segment ``r-s-1``;
    afterwards it holds the full sum of segment ``r+1``. All-gather
    (``False``): rank ``r`` starts from that segment and passes completed
    segments on, receiving straight into place.

    Each segment is cut into ``k`` chunks (``k >= 2`` from 2 MiB). What
    chunk ``j`` sends at one hop is what it received at the hop before, ``k``
    exchanges earlier, so with at most ``k`` exchanges in flight the stream
    never waits for a whole hop: the next hop's first chunk travels while
    this hop's last one is still being added.
    """
    n, r = ring.size, ring.rank
    bounds = segment_bounds(flat.numel(), n)
    segments = [flat[a:b] for a, b in bounds]
    longest = max(b - a for a, b in bounds)
    segment_bytes = longest * flat.element_size()
    per_segment = max(-(-segment_bytes // chunk_bytes), 2 if segment_bytes >= SPLIT_FROM_BYTES else 1)
    chunk_elems = max(1, -(-longest // per_segment))
    depth = min(per_segment, max_in_flight)
    steps = []  # (chunk to send, chunk to receive into, add it?)
    for reduce in phases:
        offset = 0 if reduce else 1
        for hop in range(n - 1):
            send = _chunks(segments[(r + offset - hop) % n], chunk_elems)
            recv = _chunks(segments[(r + offset - hop - 1) % n], chunk_elems)
            steps += [(_at(send, j), _at(recv, j), reduce) for j in range(per_segment)]
    scratch = [torch.empty(chunk_elems, dtype=flat.dtype, device=flat.device) for _ in range(depth + 1)] if any(phases) else []

    def post(t: int):
        send, recv, reduce = steps[t]
        landing = scratch[t % (depth + 1)][: recv.numel()] if reduce and recv is not None else recv
        return ring.exchange(send, landing, traffic), landing

    in_flight = deque(post(t) for t in range(min(depth, len(steps))))
    for t, (_, recv, reduce) in enumerate(steps):
        works, landing = in_flight.popleft()
        _wait(works)
        if reduce and recv is not None:
            recv.add_(landing)  # before step t+k sends this chunk on, and before its buffer is reused
        if t + depth < len(steps):
            in_flight.append(post(t + depth))


def _at(chunks: list[torch.Tensor], j: int) -> torch.Tensor | None:
    return chunks[j] if j < len(chunks) else None


@_host_staged
def ring_reduce_scatter(tensor: torch.Tensor, group=None, chunk_bytes: int = DEFAULT_CHUNK_BYTES, traffic: Traffic | None = None) -> torch.Tensor:
    """Sum ``tensor`` over ranks and return this rank's segment of the sum
    (segment ``(rank+1) % n`` of :func:`segment_bounds`); the rest of
    ``tensor`` holds partial sums afterwards."""
    ring = _Ring(group)
    flat, copied = _flat_view(tensor)
    if ring.size > 1:
        _ring_pipeline(flat, ring, (True,), chunk_bytes, traffic)
    a, b = segment_bounds(flat.numel(), ring.size)[(ring.rank + 1) % ring.size]
    if copied:
        tensor.copy_(flat.view(tensor.shape))
    return flat[a:b]


@_host_staged
def ring_all_gather(tensor: torch.Tensor, group=None, chunk_bytes: int = DEFAULT_CHUNK_BYTES, traffic: Traffic | None = None) -> torch.Tensor:
    """Each rank owns segment ``(rank+1) % n`` of ``tensor``; afterwards every
    rank holds every segment. In place; returns ``tensor``."""
    ring = _Ring(group)
    flat, copied = _flat_view(tensor)
    if ring.size > 1:
        _ring_pipeline(flat, ring, (False,), chunk_bytes, traffic)
    if copied:
        tensor.copy_(flat.view(tensor.shape))
    return tensor


@_host_staged
def ring_all_reduce(tensor: torch.Tensor, group=None, chunk_bytes: int = DEFAULT_CHUNK_BYTES, traffic: Traffic | None = None) -> torch.Tensor:
    """In-place SUM all-reduce: ring reduce-scatter, then ring all-gather."""
    ring = _Ring(group)
    if ring.size == 1:
        return tensor
    flat, copied = _flat_view(tensor)
    _ring_pipeline(flat, ring, (True, False), chunk_bytes, traffic)
    if copied:
        tensor.copy_(flat.view(tensor.shape))
    return tensor


@_host_staged
def naive_ring_all_reduce(tensor: torch.Tensor, group=None, traffic: Traffic | None = None) -> torch.Tensor:
    """The whole tensor hops around the ring ``n-1`` times; each rank adds
    what passes through. Correct, and ``n/2`` times the ring's traffic."""
    ring = _Ring(group)
    flat, copied = _flat_view(tensor)
    passing, arriving = flat.clone(), torch.empty_like(flat)
    total = flat.clone()
    for _ in range(ring.size - 1):
        _wait(ring.exchange(passing, arriving, traffic))
        total += arriving
        passing, arriving = arriving, passing
    flat.copy_(total)
    if copied:
        tensor.copy_(flat.view(tensor.shape))
    return tensor


@_host_staged
def reduce_broadcast_all_reduce(tensor: torch.Tensor, group=None, traffic: Traffic | None = None) -> torch.Tensor:
    """Everyone sends to rank 0; rank 0 sums and sends the result to everyone.
    ``2(n-1) S`` bytes pass through rank 0 while the others wait."""
    ring = _Ring(group)
    flat, copied = _flat_view(tensor)
    root = ring.global_rank(0)
    if ring.rank == 0:
        inbox = [torch.empty_like(flat) for _ in range(ring.size - 1)]
        _wait(dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, ring.global_rank(i + 1), group) for i, buf in enumerate(inbox)]) if inbox else [])
        for buf in inbox:
            flat += buf
        sends = [dist.P2POp(dist.isend, flat, ring.global_rank(i), group) for i in range(1, ring.size)]
        if traffic is not None:
            for _ in sends:
                traffic.add(flat)
        _wait(dist.batch_isend_irecv(sends) if sends else [])
    else:
        if traffic is not None:
            traffic.add(flat)
        _wait(dist.batch_isend_irecv([dist.P2POp(dist.isend, flat, root, group)]))
        _wait(dist.batch_isend_irecv([dist.P2POp(dist.irecv, flat, root, group)]))
    if copied:
        tensor.copy_(flat.view(tensor.shape))
    return tensor


ALL_REDUCES = {
    "ring": ring_all_reduce,
    "naive_ring": naive_ring_all_reduce,
    "reduce_broadcast": reduce_broadcast_all_reduce,
}
