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

Every send is posted together with its receive in one ``batch_isend_irecv``
call. Send-then-receive on every rank works only while the transport can
buffer the whole message, so for large messages it can deadlock on any
backend; posting both at once does not depend on buffering. All functions
sum in place and return the tensor.
"""

from __future__ import annotations

import enum
import functools
import inspect
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


def _in_place_collective(body):
    """Make ``body(flat, ring, *args, **kwargs)``, an algorithm on a contiguous 1-D
    tensor, into the public ``fn(tensor, group=None, *args, **kwargs)``.

    The wrapper works in place on any ``tensor`` and returns it, or what the body
    returns if that is a tensor. A non-contiguous ``tensor`` is worked on in a
    contiguous copy and written back. gloo moves host memory only, so a CUDA
    tensor on gloo is run on a CPU copy and the result copied back (gloo's own
    CUDA collectives stage through the host too).
    """

    @functools.wraps(body)
    def collective(tensor: torch.Tensor, group=None, *args, **kwargs) -> torch.Tensor:
        if tensor.is_cuda and dist.get_backend(group) == "gloo":
            staged = tensor.cpu()
            result = collective(staged, group, *args, **kwargs)
            tensor.copy_(staged)
            return tensor if result is staged else result.to(tensor.device)
        flat, copied = _flat_view(tensor)
        result = body(flat, _Ring(group), *args, **kwargs)
        if copied:
            tensor.copy_(flat.view(tensor.shape))
        return result if isinstance(result, torch.Tensor) else tensor

    # help() and the docs show the public signature, not the body's (flat, ring, ...)
    body_signature = inspect.signature(body)
    public = [
        inspect.Parameter("tensor", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="torch.Tensor"),
        inspect.Parameter("group", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None),
    ]
    rest = list(body_signature.parameters.values())[2:]
    collective.__signature__ = body_signature.replace(parameters=public + rest, return_annotation="torch.Tensor")
    return collective


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


class Phase(enum.Enum):
    """The ring all-reduce's two phases: add what arrives, or copy it."""

    REDUCE_SCATTER = "reduce-scatter"
    ALL_GATHER = "all-gather"


def ring_send_segment(rank: int, hop: int, phase: Phase, n: int) -> int:
    """The segment ``rank`` sends to ``rank + 1`` at ``hop`` (from 0) of ``phase`` on a ring of ``n``.

    It receives into ``ring_send_segment(rank - 1, hop, phase, n)``: what its
    predecessor sends. After reduce-scatter, rank ``r`` holds the full sum of
    segment ``r + 1``, the segment it sends first in all-gather.
    """
    offset = 0 if phase is Phase.REDUCE_SCATTER else 1
    return (rank + offset - hop) % n


def _chunks(segment: torch.Tensor, chunk_elems: int) -> list[torch.Tensor]:
    return list(segment.split(chunk_elems)) if segment.numel() else []


def _ring_pipeline(
    flat: torch.Tensor,
    ring: _Ring,
    phases: tuple[Phase, ...],
    chunk_bytes: int,
    traffic: Traffic | None,
    max_in_flight: int = 8,
) -> None:
    """The ring's phases over ``n`` segments of ``flat``, as one stream of chunk exchanges.

    A phase is ``n-1`` hops; :func:`ring_send_segment` says which segment each
    rank sends at each hop. Reduce-scatter: at hop ``s`` rank ``r`` sends
    segment ``r-s`` and adds what it receives into segment ``r-s-1``;
    afterwards it holds the full sum of segment ``r+1``. All-gather: rank ``r``
    starts from that segment and passes completed segments on, receiving
    straight into place.

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
    for phase in phases:
        reduce = phase is Phase.REDUCE_SCATTER
        for hop in range(n - 1):
            send = _chunks(segments[ring_send_segment(r, hop, phase, n)], chunk_elems)
            recv = _chunks(segments[ring_send_segment(r - 1, hop, phase, n)], chunk_elems)
            steps += [(_at(send, j), _at(recv, j), reduce) for j in range(per_segment)]
    scratch = (
        [torch.empty(chunk_elems, dtype=flat.dtype, device=flat.device) for _ in range(depth + 1)]
        if Phase.REDUCE_SCATTER in phases
        else []
    )

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


@_in_place_collective
def ring_reduce_scatter(
    flat: torch.Tensor, ring: _Ring, chunk_bytes: int = DEFAULT_CHUNK_BYTES, traffic: Traffic | None = None
) -> torch.Tensor:
    """Sum ``tensor`` over ranks and return this rank's segment of the sum
    (segment ``(rank+1) % n`` of :func:`segment_bounds`); the rest of
    ``tensor`` holds partial sums afterwards."""
    if ring.size > 1:
        _ring_pipeline(flat, ring, (Phase.REDUCE_SCATTER,), chunk_bytes, traffic)
    a, b = segment_bounds(flat.numel(), ring.size)[(ring.rank + 1) % ring.size]
    return flat[a:b]


@_in_place_collective
def ring_all_gather(
    flat: torch.Tensor, ring: _Ring, chunk_bytes: int = DEFAULT_CHUNK_BYTES, traffic: Traffic | None = None
) -> None:
    """Each rank owns segment ``(rank+1) % n`` of ``tensor``; afterwards every
    rank holds every segment. In place; returns ``tensor``."""
    if ring.size > 1:
        _ring_pipeline(flat, ring, (Phase.ALL_GATHER,), chunk_bytes, traffic)


@_in_place_collective
def ring_all_reduce(
    flat: torch.Tensor, ring: _Ring, chunk_bytes: int = DEFAULT_CHUNK_BYTES, traffic: Traffic | None = None
) -> None:
    """In-place SUM all-reduce: ring reduce-scatter, then ring all-gather."""
    if ring.size > 1:
        _ring_pipeline(flat, ring, (Phase.REDUCE_SCATTER, Phase.ALL_GATHER), chunk_bytes, traffic)


@_in_place_collective
def naive_ring_all_reduce(flat: torch.Tensor, ring: _Ring, traffic: Traffic | None = None) -> None:
    """The whole tensor hops around the ring ``n-1`` times; each rank adds
    what passes through. Correct, and ``n/2`` times the ring's traffic."""
    passing, arriving = flat.clone(), torch.empty_like(flat)
    total = flat.clone()
    for _ in range(ring.size - 1):
        _wait(ring.exchange(passing, arriving, traffic))
        total += arriving
        passing, arriving = arriving, passing
    flat.copy_(total)


@_in_place_collective
def reduce_broadcast_all_reduce(flat: torch.Tensor, ring: _Ring, traffic: Traffic | None = None) -> None:
    """Everyone sends to rank 0; rank 0 sums and sends the result to everyone.
    ``2(n-1) S`` bytes pass through rank 0 while the others wait."""
    group, root = ring.group, ring.global_rank(0)
    if ring.rank == 0:
        inbox = [torch.empty_like(flat) for _ in range(ring.size - 1)]
        receives = [dist.P2POp(dist.irecv, buf, ring.global_rank(i + 1), group) for i, buf in enumerate(inbox)]
        _wait(dist.batch_isend_irecv(receives) if receives else [])
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


ALL_REDUCES = {
    "ring": ring_all_reduce,
    "naive_ring": naive_ring_all_reduce,
    "reduce_broadcast": reduce_broadcast_all_reduce,
}
