"""The ring chapter's exercises: reduce-scatter, all-gather and all-reduce from sends and receives only.

Every rank's data is drawn from a generator seeded by the case and the rank, so every rank knows what every
other rank holds and computes what ``dist.all_reduce`` would return itself, with no collective of its own
between the learner's calls. Values are small integers, so sums are exact and a wrong answer can be recognised: a
segment summed over only some ranks, the wrong segment, the mean instead of the sum.
"""

from __future__ import annotations

from itertools import combinations

import torch

from ..comm.collectives import segment_bounds
from .catalog import Exercise
from .trial import Trial
from .verdict import ranks_said

LENGTHS = (12, 10, 4)
"""Divides by 2, 3 and 4; does not divide by 3 or 4; leaves 1-element segments at 3 ranks and 4."""
P2P = {"send", "recv", "isend", "irecv"}


def rank_data(length: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * length + rank)
    return torch.randint(-9, 10, (length,), generator=generator).float()


def _segment_locator(length: int, n: int, offset: int = 0):
    bounds = segment_bounds(length, n)

    def locate(index: int) -> str:
        index += offset
        segment = next(i for i, (a, b) in enumerate(bounds) if a <= index < b)
        return f"segment {segment}, element {index}"

    return locate


def _only_p2p(t: Trial, since: int, what: str) -> None:
    used = sorted({op for op in t.tracer.ops(since) if op not in P2P})
    if used:
        t.fail(what, f"it called dist.{used[0]}", "used_collective")


def _ranks_left_out(got, datas: list[torch.Tensor], a: int, b: int) -> list[int] | None:
    """The ranks whose values a wrong segment lacks, when it is exactly the sum over the others."""
    if not isinstance(got, torch.Tensor) or got.shape != datas[0][a:b].shape or b == a:
        return None
    n, got = len(datas), got.detach().cpu().float()
    if torch.equal(got, sum(d[a:b] for d in datas)):
        return None  # right, even where some ranks' values happen to sum to zero
    for k in range(1, n):
        for kept in combinations(range(n), k):
            if torch.equal(got, sum(datas[r][a:b] for r in kept)):
                return [r for r in range(n) if r not in kept]
    return None


def _nothing_added(t: Trial, left_out: list[int], tensor: torch.Tensor, version: int) -> None:
    """A segment that holds this rank's own values only, where no in-place op ever touched ``tensor``: what
    arrived was added into new tensors (``x = x + y``). A ring one hop short adds in place, into other segments."""
    others = [r for r in range(t.world_size) if r != t.rank]
    if sorted(left_out) == others and tensor._version == version:
        t.fail(
            "returned segment",
            f"it holds only rank {t.rank}'s own values, and nothing was ever added into `tensor` in place: what "
            f"arrived from {ranks_said(left_out)} never reached it",
            "nothing_added",
        )


def _receives_waited(t: Trial, since: int) -> None:
    """Every dist.irecv's request was waited for: until it is, its buffer may hold nothing yet, and whether it does
    depends on the machine's load (a value check would pass or fail by chance)."""
    receives = [c for c in t.tracer.calls[since:] if c["op"] == "irecv" and c.get("watched")]
    unwaited = [c for c in receives if not c.get("waited")]
    if unwaited:
        first = unwaited[0]
        t.fail(
            "use of dist.irecv",
            f"{len(unwaited)} of its {len(receives)} dist.irecv requests were never waited for (the first: from "
            f"rank {first.get('peer')}, its call {first['n']}), so what it read from their buffers may not have "
            "arrived yet",
            "receive_not_waited",
        )


def _never_written(t: Trial, since: int, tensor: torch.Tensor, version: int, before, expected) -> None:
    """``tensor`` as it was, bit for bit, with no receive into its storage and no in-place op on it: what arrived
    went into copies. (torch's sends and receives do not bump a tensor's version; the learner's ``+=`` and
    ``copy_`` do.)"""
    if torch.equal(expected, before) or not torch.equal(tensor.detach().cpu(), before):
        return
    storage = tensor.untyped_storage().data_ptr()
    if tensor._version != version or any(c.get("storage") == storage for c in t.tracer.calls[since:]):
        return
    t.fail(
        "tensor",
        "your function never wrote into `tensor`: no receive landed in it and nothing was added or copied into it, "
        "so it still holds what it held before the call",
        "not_in_place",
    )


def _which_segment(t: Trial, got, tensor: torch.Tensor, length: int, n: int, right: int) -> None:
    """A view of the wrong segment of the input: say which one it is."""
    if (
        not isinstance(got, torch.Tensor)
        or got.numel() == 0
        or got.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
    ):
        return
    start = (got.data_ptr() - tensor.data_ptr()) // tensor.element_size()
    starts = {a: i for i, (a, b) in enumerate(segment_bounds(length, n)) if b > a}
    segment = starts.get(start)
    if segment is not None and segment != right:
        mistake = "segment_of_rank" if segment == t.rank else "wrong_segment"
        t.fail(
            "returned segment",
            f"it is segment {segment} of the tensor; rank {t.rank} finishes segment {right}",
            mistake,
        )


def _chunk_bounds(length: int, n: int) -> list[tuple[int, int]]:
    """How ``torch.chunk`` cuts ``length`` values into (at most) ``n`` pieces, padded with empty ones to ``n``."""
    bounds = [(int(c[0]), int(c[-1]) + 1) for c in torch.arange(length).chunk(n)]
    return bounds + [(length, length)] * (n - len(bounds))


def _sizes(bounds: list[tuple[int, int]]) -> str:
    return ", ".join(str(b - a) for a, b in bounds)


def _cut_differently(t: Trial, got, total: torch.Tensor, length: int, n: int, right: int) -> None:
    """A segment summed right but cut as ``torch.chunk`` cuts, which differs from ``segment_bounds`` when n does
    not divide the length: say so, with both sets of sizes, rather than what the wrong size looks like."""
    ours, chunks = segment_bounds(length, n), _chunk_bounds(length, n)
    a, b = chunks[right]
    if not isinstance(got, torch.Tensor) or (a, b) == ours[right] or b == a or got.shape != (b - a,):
        return
    if torch.equal(got.detach().cpu().float(), total[a:b]):
        t.fail(
            "returned segment",
            f"it is the sum of elements {a}..{b - 1}, segment {right} as torch.chunk cuts {length} values on {n} "
            f"ranks ({_sizes(chunks)}); segment_bounds({length}, {n}) cuts {_sizes(ours)}, and rank {t.rank} "
            f"finishes elements {ours[right][0]}..{ours[right][1] - 1}",
            "cut_differently",
        )


def _floor_segments(t: Trial, got, total: torch.Tensor, length: int, n: int, right: int) -> None:
    """A segment summed right but cut numel // n long, which leaves numel % n values in no segment: say so."""
    size, left = length // n, length % n
    a, b = right * size, (right + 1) * size
    if not left or not isinstance(got, torch.Tensor) or got.shape != (size,) or not size:
        return
    if torch.equal(got.detach().cpu().float(), total[a:b]):
        cut = " + ".join([str(size)] * n)
        t.fail(
            "returned segment",
            f"it is the sum of elements {a}..{b - 1}: your segments cut {length} values as {cut} and leave "
            f"{'one' if left == 1 else left} out",
            "floor_segments",
        )


def _in_place(t: Trial, result, tensor: torch.Tensor, before: torch.Tensor, expected: torch.Tensor) -> None:
    """The collective's answer is ``tensor`` itself: a new tensor returned, with ``tensor`` left as it was, fails."""
    if not isinstance(result, torch.Tensor) or not torch.equal(tensor.detach().cpu(), before):
        return
    if result.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr():
        right = result.shape == expected.shape and torch.equal(result.detach().cpu().float(), expected)
        what = "a new tensor with the right values" if right else "a new tensor"
        t.fail("tensor", f"your function returned {what} and left `tensor` as it was", "not_in_place")


def _expected_bytes(length: int, n: int, hops: int, first_offset: int, rank: int) -> int:
    bounds = segment_bounds(length, n)
    return sum(
        4 * (bounds[(rank + first_offset - hop) % n][1] - bounds[(rank + first_offset - hop) % n][0])
        for hop in range(hops)
    )


def _at_most_the_ring_bytes(t: Trial, since: int, expected: int, collective: str) -> None:
    sent = t.tracer.bytes_sent(since)
    if sent > expected:
        t.fail(
            "traffic", f"it sent {sent} bytes; a ring {collective} sends {expected} from this rank", "sends_too_much"
        )


def reduce_scatter_trial(t: Trial, fn) -> None:
    n, r = t.world_size, t.rank
    t.tracer.watch_waits = True  # whether each irecv was waited for is read from its request
    for length in LENGTHS:
        with t.case(f"length {length}"):
            datas = [rank_data(length, rank) for rank in range(n)]
            total = sum(datas)
            a, b = segment_bounds(length, n)[(r + 1) % n]
            mine = datas[r].clone().to(t.device)
            since, version = len(t.tracer.calls), mine._version
            got = t.call(fn, mine)
            _only_p2p(t, since, "reduce-scatter")
            _receives_waited(t, since)
            own_a, own_b = segment_bounds(length, n)[r]
            mistakes = {
                "segment_of_rank": total[own_a:own_b],
                "averaged": total[a:b] / n,
                "whole_tensor": total,
            }
            if (
                got is not None
                and isinstance(got, torch.Tensor)
                and got.shape == total.shape
                and torch.equal(got.cpu(), total)
            ):
                t.fail("returned tensor", "it is the whole summed tensor", "whole_tensor")
            _floor_segments(t, got, total, length, n, (r + 1) % n)
            left_out = _ranks_left_out(got, datas, a, b)
            if left_out:
                _nothing_added(t, left_out, mine, version)
                said = f"it holds the sum over every rank except {ranks_said(left_out)}"
                t.fail("returned segment", said, "partial_sum")
            _cut_differently(t, got, total, length, n, (r + 1) % n)
            _which_segment(t, got, mine, length, n, (r + 1) % n)
            t.expect_close(got, total[a:b], "returned segment", mistakes, _segment_locator(length, n, a))
            _at_most_the_ring_bytes(t, since, _expected_bytes(length, n, n - 1, 0, r), "reduce-scatter")


def all_gather_trial(t: Trial, fn) -> None:
    n, r = t.world_size, t.rank
    t.tracer.watch_waits = True
    for length in LENGTHS:
        with t.case(f"length {length}"):
            full = sum(rank_data(length, rank) for rank in range(n))
            stale = torch.full((length,), -1000.0)
            mine = stale.clone()
            bounds = segment_bounds(length, n)
            a, b = bounds[(r + 1) % n]
            mine[a:b] = full[a:b]
            tensor = mine.to(t.device)
            since, version = len(t.tracer.calls), tensor._version
            result = t.call(fn, tensor)
            _only_p2p(t, since, "all-gather")
            _receives_waited(t, since)
            _in_place(t, result, tensor, mine, full)
            _never_written(t, since, tensor, version, mine, full)
            got = tensor.detach().cpu()
            for segment, (lo, hi) in enumerate(bounds):
                if hi > lo and torch.equal(got[lo:hi], stale[lo:hi]):
                    t.fail(
                        "tensor",
                        f"segment {segment} (elements {lo}..{hi - 1}) still holds its old values",
                        "segment_never_arrived",
                    )
            for segment, (lo, hi) in enumerate(bounds):
                extra = got[lo:hi] - full[lo:hi]
                if (
                    hi > lo
                    and (extra != 0).all()
                    and bool(((extra / stale[lo:hi]).round() * stale[lo:hi] == extra).all())
                ):
                    t.fail("tensor", f"segment {segment} holds the right values plus old ones", "added_not_copied")
            t.expect_close(got, full, "tensor", locate=_segment_locator(length, n))
            _at_most_the_ring_bytes(t, since, _expected_bytes(length, n, n - 1, 1, r), "all-gather")


def all_reduce_trial(t: Trial, fn) -> None:
    n, r = t.world_size, t.rank
    t.tracer.watch_waits = True
    for length in LENGTHS:
        with t.case(f"length {length}"):
            datas = [rank_data(length, rank) for rank in range(n)]
            reference = sum(datas)  # what dist.all_reduce returns, computed here: no collective beside the learner's
            since = len(t.tracer.calls)
            tensor = datas[r].clone().to(t.device)
            version = tensor._version
            result = t.call(fn, tensor)
            _only_p2p(t, since, "all-reduce")
            _receives_waited(t, since)
            _in_place(t, result, tensor, datas[r], reference)
            _never_written(t, since, tensor, version, datas[r], reference)
            got = tensor.detach().cpu()
            a, b = segment_bounds(length, n)[(r + 1) % n]
            own_only = n > 1 and b > a and torch.equal(got[a:b], datas[r][a:b]) and not torch.equal(got, reference)
            if own_only and tensor._version == version:
                t.fail("tensor", f"segment {(r + 1) % n}, the one rank {r} finishes in the reduce-scatter, holds only "
                       f"rank {r}'s own values, and nothing was ever added into `tensor` in place",
                       "nothing_added")  # fmt: skip
            if length >= n and torch.equal(got[a:b], reference[a:b]) and not torch.equal(got, reference):
                t.fail("tensor", f"only segment {(r + 1) % n} holds the full sum", "no_all_gather")
            t.expect_close(got, reference, "tensor", {"averaged": reference / n}, _segment_locator(length, n))
            # any ring schedule moves one segment a hop: at most 2(n-1) of the longest segment
            sent, most = t.tracer.bytes_sent(since), 2 * (n - 1) * -(-length // n) * 4
            if sent > most:
                t.fail("traffic", f"it sent {sent} bytes, {sent / (4 * length):.2f} x the tensor; the ring sends "
                       f"2(n-1)/n = {2 * (n - 1) / n:.2f} x", "sends_too_much")  # fmt: skip
    t.note(f"each rank sent 2(n-1)/n = {2 * (n - 1) / n:.2f} times the tensor's bytes, as the ring should")


RING_MISTAKES = {
    "used_collective": "the exercise is to build the collective from sends and receives: use dist.send/recv, "
    "dist.isend/irecv or dist.batch_isend_irecv only.",
    "averaged": "you divided by the number of ranks. A reduce-scatter and an all-reduce sum; averaging is "
    "the caller's (DDP divides afterwards).",
    "sends_too_much": "each hop should move one segment (S/n bytes), not the whole tensor.",
    "not_in_place": "the collective works in place, as dist.all_gather_into_tensor and dist.all_reduce do: write "
    "what arrives into the segments of `tensor` itself, views such as tensor[a:b], not copies (.clone(), "
    "torch.cat, x = x + y). The caller reads `tensor`; a tensor returned is ignored.",
    "receive_not_waited": "dist.irecv returns at once, before anything has arrived: its buffer is filled only when "
    "the request it returned has been waited for. Keep each request and call .wait() on it (or on every request "
    "dist.batch_isend_irecv returns) before you read or add what arrived.",
    "nothing_added": "x = x + y makes a new tensor and binds x to it, leaving the segment in `tensor` as it was: add "
    "what arrived in place, with `x += y` (or x.add_(y)), so that the sum lands in `tensor`.",
    "wrong_peer": "each rank receives from a rank that sends to another one. In this ring every rank sends to "
    "(rank + 1) % n, so the rank that sends to it is (rank - 1) % n: receive from that one. (On two ranks both "
    "are the same rank, which is why the check runs three.)",
}
RING_MIN_RANKS = 3
RING_MIN_RANKS_WHY = "rank + 1 and rank - 1 are the same rank, and torch.chunk cuts every length as segment_bounds does"

EXERCISES = (
    Exercise(
        name="ring_reduce_scatter",
        page="ring_allreduce",
        task="Sum `tensor` over the ranks in n-1 ring hops, each rank sending one segment to rank + 1 and adding "
        "what arrives from rank - 1, and return this rank's fully summed segment, (rank + 1) % n of "
        "`segment_bounds(tensor.numel(), n)`.",
        signature="def ring_reduce_scatter(tensor: torch.Tensor) -> torch.Tensor:",
        solution="ring.ring_reduce_scatter",
        library="distlab.comm.collectives.ring_reduce_scatter",
        trial=reduce_scatter_trial,
        min_ranks=RING_MIN_RANKS,
        min_ranks_why=RING_MIN_RANKS_WHY,
        mistakes={
            **RING_MISTAKES,
            "segment_of_rank": "you returned segment `rank`. In this ring rank r sends segment r - hop at each hop, so "
            "the segment it finishes is the one it receives last: (rank + 1) % n.",
            "wrong_segment": "you returned a segment this rank has not finished: rank r ends holding segment "
            "(rank + 1) % n, the one it receives last.",
            "whole_tensor": "you returned the whole tensor. A reduce-scatter leaves each rank one segment of the sum; "
            "return that segment (a view of `tensor` is fine).",
            "cut_differently": "your segments are cut differently from the course's. segment_bounds(numel, n) "
            "gives the first numel % n segments one value more (10 values on 3 ranks: 4, 3, 3), where torch.chunk "
            "cuts pieces of ceil(numel / n) until the values run out (4, 4, 2), and can return fewer than n pieces. "
            "Cut with segment_bounds, as the ring this check compares with does.",
            "floor_segments": "segments of numel // n leave numel % n values in no segment: cut with "
            "segment_bounds(tensor.numel(), n), which gives the first numel % n segments one value more.",
            "partial_sum": "the segment misses some ranks' values: a segment needs n - 1 hops to collect every "
            "rank's contribution, and at each hop a rank must add what it received into the segment it sends next.",
        },
    ),
    Exercise(
        name="ring_all_gather",
        page="ring_allreduce",
        task="Rank r holds the finished segment (r + 1) % n of `tensor`; the other segments are stale. In n-1 ring "
        "hops, pass segments to rank + 1 so that every rank ends with every segment, in place.",
        signature="def ring_all_gather(tensor: torch.Tensor) -> None:",
        solution="ring.ring_all_gather",
        library="distlab.comm.collectives.ring_all_gather",
        trial=all_gather_trial,
        min_ranks=RING_MIN_RANKS,
        min_ranks_why=RING_MIN_RANKS_WHY,
        mistakes={
            **RING_MISTAKES,
            "added_not_copied": "you added what arrived to the stale values. The sums are already made; an "
            "all-gather copies each arriving segment into place.",
            "segment_never_arrived": "a segment was never delivered. Each rank first sends the segment it owns, "
            "(rank + 1) % n, then at every hop forwards the one it has just received.",
        },
    ),
    Exercise(
        name="ring_all_reduce",
        page="ring_allreduce",
        task="Sum `tensor` over the ranks in place, sending 2(n-1)/n times its bytes from each rank: a ring "
        "reduce-scatter, then a ring all-gather.",
        signature="def ring_all_reduce(tensor: torch.Tensor) -> None:",
        solution="ring.ring_all_reduce",
        library="distlab.comm.collectives.ring_all_reduce",
        trial=all_reduce_trial,
        min_ranks=RING_MIN_RANKS,
        min_ranks_why=RING_MIN_RANKS_WHY,
        mistakes={
            **RING_MISTAKES,
            "no_all_gather": "after the reduce-scatter each rank holds the sum of one segment only; the all-gather "
            "must then deliver every segment to every rank.",
            "sends_too_much": "the whole tensor travelled the ring: that sends (n-1) S per rank. Cut it into n "
            "segments, reduce-scatter, then all-gather: 2(n-1)/n S.",
        },
        pages=("labs/lab_ring_allreduce",),
    ),
)
