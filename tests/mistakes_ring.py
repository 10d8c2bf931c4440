"""Typical wrong answers to the ring chapter's exercises, each with the mistake its check must name."""

import torch
import torch.distributed as dist

from distlab.comm.collectives import segment_bounds
from distlab.exercises.solutions.ring import ring_all_gather, ring_reduce_scatter


def exchange(send, recv):
    rank, n = dist.get_rank(), dist.get_world_size()
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % n), dist.P2POp(dist.irecv, recv, (rank - 1) % n)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()


def reduce_scatter_keeps_own_segment(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    segments = [tensor[a:b] for a, b in segment_bounds(tensor.numel(), n)]
    for hop in range(n - 1):
        into = segments[(rank - hop - 1) % n]
        arrived = torch.empty_like(into)
        exchange(segments[(rank - hop) % n], arrived)
        into += arrived
    return segments[rank]


def reduce_scatter_one_hop_short(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    segments = [tensor[a:b] for a, b in segment_bounds(tensor.numel(), n)]
    for hop in range(n - 2):
        into = segments[(rank - hop - 1) % n]
        arrived = torch.empty_like(into)
        exchange(segments[(rank - hop) % n], arrived)
        into += arrived
    return segments[(rank + 1) % n]


def reduce_scatter_send_then_recv(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    segments = [tensor[a:b] for a, b in segment_bounds(tensor.numel(), n)]
    for hop in range(n - 1):
        into = segments[(rank - hop - 1) % n]
        arrived = torch.empty_like(into)
        dist.send(segments[(rank - hop) % n], (rank + 1) % n)
        dist.recv(arrived, (rank - 1) % n)
        into += arrived
    return segments[(rank + 1) % n]


def reduce_scatter_by_all_reduce(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    dist.all_reduce(tensor)
    a, b = segment_bounds(tensor.numel(), n)[(rank + 1) % n]
    return tensor[a:b]


def reduce_scatter_with_chunk(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    segments = list(tensor.chunk(n))
    segments += [tensor[:0]] * (n - len(segments))  # chunk gives fewer pieces than n when the tensor is short
    for hop in range(n - 1):
        into = segments[(rank - hop - 1) % n]
        arrived = torch.empty_like(into)
        exchange(segments[(rank - hop) % n], arrived)
        into += arrived
    return segments[(rank + 1) % n]


def all_gather_adds(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    segments = [tensor[a:b] for a, b in segment_bounds(tensor.numel(), n)]
    for hop in range(n - 1):
        into = segments[(rank - hop) % n]
        arrived = torch.empty_like(into)
        exchange(segments[(rank + 1 - hop) % n], arrived)
        into += arrived


def all_gather_starts_from_rank(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    segments = [tensor[a:b] for a, b in segment_bounds(tensor.numel(), n)]
    for hop in range(n - 1):
        exchange(segments[(rank - hop) % n], segments[(rank - hop - 1) % n])


def all_gather_into_a_copy(tensor):
    gathered = tensor.clone()
    ring_all_gather(gathered)
    return gathered


def all_reduce_whole_tensor_ring(tensor):
    passing, arriving, total = tensor.clone(), torch.empty_like(tensor), tensor.clone()
    for _ in range(dist.get_world_size() - 1):
        exchange(passing, arriving)
        total += arriving
        passing, arriving = arriving, passing
    tensor.copy_(total)


def all_reduce_without_gather(tensor):
    ring_reduce_scatter(tensor)


def all_reduce_mean(tensor):
    all_reduce_whole_tensor_ring(tensor)
    tensor /= dist.get_world_size()


def all_reduce_into_a_copy(tensor):
    summed = tensor.clone()
    ring_reduce_scatter(summed)
    ring_all_gather(summed)
    return summed


# The answers a fourth review wrote and graded (R1-R5): each wrong one must be named for what it did


def reduce_scatter_rebinds_the_sum(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    segments = [tensor[a:b] for a, b in segment_bounds(tensor.numel(), n)]
    for hop in range(n - 1):
        into = segments[(rank - hop - 1) % n]
        arrived = torch.empty_like(into)
        exchange(segments[(rank - hop) % n], arrived)
        into = into + arrived  # a new tensor: the segment of `tensor` is left as it was
    return segments[(rank + 1) % n]


def all_gather_into_cloned_segments(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    segments = [tensor[a:b].clone() for a, b in segment_bounds(tensor.numel(), n)]
    for hop in range(n - 1):
        exchange(segments[(rank + 1 - hop) % n], segments[(rank - hop) % n])


def reduce_scatter_receive_not_waited(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    segments = [tensor[a:b] for a, b in segment_bounds(tensor.numel(), n)]
    for hop in range(n - 1):
        into = segments[(rank - hop - 1) % n]
        arrived = torch.zeros_like(into)
        sending = dist.isend(segments[(rank - hop) % n], (rank + 1) % n)
        dist.irecv(arrived, (rank - 1) % n)
        sending.wait()
        into += arrived
    return segments[(rank + 1) % n]


def all_reduce_receives_from_the_right(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    segments = [tensor[a:b] for a, b in segment_bounds(tensor.numel(), n)]
    for hop in range(n - 1):
        into = segments[(rank - hop - 1) % n]
        arrived = torch.empty_like(into)
        ops = [
            dist.P2POp(dist.isend, segments[(rank - hop) % n], (rank + 1) % n),
            dist.P2POp(dist.irecv, arrived, (rank + 1) % n),
        ]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        into += arrived
    for hop in range(n - 1):
        exchange(segments[(rank + 1 - hop) % n], segments[(rank - hop) % n])


def reduce_scatter_returns_a_clone(tensor):
    return ring_reduce_scatter(tensor).clone()


def all_reduce_on_a_copy(tensor):
    summed = tensor.clone()
    ring_reduce_scatter(summed)
    ring_all_gather(summed)


def all_reduce_rebinds_the_sum(tensor):
    reduce_scatter_rebinds_the_sum(tensor)
    ring_all_gather(tensor)


# Right answers written otherwise than the course's: each must pass (tests/test_grader_names.py)


def reduce_scatter_waits_each_request(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    segments = [tensor[a:b] for a, b in segment_bounds(tensor.numel(), n)]
    for hop in range(n - 1):
        into = segments[(rank - hop - 1) % n]
        arrived = torch.zeros_like(into)
        sending = dist.isend(segments[(rank - hop) % n], (rank + 1) % n)
        receiving = dist.irecv(arrived, (rank - 1) % n)
        receiving.wait()
        sending.wait()
        into += arrived
    return segments[(rank + 1) % n]


def all_gather_receives_then_copies(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    segments = [tensor[a:b] for a, b in segment_bounds(tensor.numel(), n)]
    for hop in range(n - 1):
        arrived = torch.empty_like(segments[(rank - hop) % n])
        exchange(segments[(rank + 1 - hop) % n], arrived)
        segments[(rank - hop) % n].copy_(arrived)


def all_reduce_blocking_recv(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    segments = [tensor[a:b] for a, b in segment_bounds(tensor.numel(), n)]
    for hop in range(n - 1):
        into = segments[(rank - hop - 1) % n]
        arrived = torch.empty_like(into)
        sending = dist.isend(segments[(rank - hop) % n], (rank + 1) % n)
        dist.recv(arrived, (rank - 1) % n)
        sending.wait()
        into += arrived
    for hop in range(n - 1):
        sending = dist.isend(segments[(rank + 1 - hop) % n], (rank + 1) % n)
        dist.recv(segments[(rank - hop) % n], (rank - 1) % n)
        sending.wait()


# The answers a fifth review wrote and graded (its section 4)


def reduce_scatter_adds_into_the_segment_sent(tensor):  # W1: off by one
    rank, n = dist.get_rank(), dist.get_world_size()
    segments = [tensor[a:b] for a, b in segment_bounds(tensor.numel(), n)]
    for hop in range(n - 1):
        send = segments[(rank - hop) % n]
        arrived = torch.empty_like(send)
        exchange(send, arrived)
        send += arrived
    return segments[(rank + 1) % n]


def reduce_scatter_floor_segments(tensor):  # W2: segments of numel // n
    rank, n = dist.get_rank(), dist.get_world_size()
    size = tensor.numel() // n
    segments = [tensor[k * size : (k + 1) * size] for k in range(n)]
    for hop in range(n - 1):
        into = segments[(rank - hop - 1) % n]
        arrived = torch.empty_like(into)
        exchange(segments[(rank - hop) % n], arrived)
        into += arrived
    return segments[(rank + 1) % n]


def all_gather_by_the_collective(tensor):  # W3: dist.all_gather instead of sends and receives
    rank, n = dist.get_rank(), dist.get_world_size()
    bounds = segment_bounds(tensor.numel(), n)
    a, b = bounds[(rank + 1) % n]
    pieces = [torch.empty(b - a) for _ in range(n)]
    dist.all_gather(pieces, tensor[a:b].clone())
    for k, piece in enumerate(pieces):  # rank k holds segment (k + 1) % n
        lo, hi = bounds[(k + 1) % n]
        tensor[lo:hi] = piece


def reduce_scatter_even_ranks_send_first(tensor):  # V1: blocking send and recv, alternating by parity
    rank, n = dist.get_rank(), dist.get_world_size()
    segments = [tensor[a:b] for a, b in segment_bounds(tensor.numel(), n)]
    for hop in range(n - 1):
        send, into = segments[(rank - hop) % n], segments[(rank - hop - 1) % n]
        arrived = torch.empty_like(into)
        if rank % 2 == 0:
            dist.send(send, (rank + 1) % n)
            dist.recv(arrived, (rank - 1) % n)
        else:
            dist.recv(arrived, (rank - 1) % n)
            dist.send(send, (rank + 1) % n)
        into += arrived
    return segments[(rank + 1) % n]


ALTERNATIVES = [
    ("ring_reduce_scatter", reduce_scatter_returns_a_clone),
    ("ring_reduce_scatter", reduce_scatter_waits_each_request),
    ("ring_all_gather", all_gather_receives_then_copies),
    ("ring_all_reduce", all_reduce_blocking_recv),
    ("ring_reduce_scatter", reduce_scatter_even_ranks_send_first),
]


MISTAKES = [
    ("ring_reduce_scatter", reduce_scatter_keeps_own_segment, "segment_of_rank", "(rank + 1) % n"),
    ("ring_reduce_scatter", reduce_scatter_one_hop_short, "partial_sum", "except rank"),
    ("ring_reduce_scatter", reduce_scatter_send_then_recv, "all_send_first", "waited in send to rank"),
    ("ring_reduce_scatter", reduce_scatter_by_all_reduce, "used_collective", "dist.all_reduce"),
    ("ring_reduce_scatter", reduce_scatter_with_chunk, "cut_differently", "on 3 ranks (4, 4, 2)"),
    ("ring_all_gather", all_gather_adds, "added_not_copied", "copies each arriving segment"),
    ("ring_all_gather", all_gather_starts_from_rank, "segment_never_arrived", "still holds its old values"),
    ("ring_all_gather", all_gather_into_a_copy, "not_in_place", "left `tensor` as it was"),
    ("ring_all_reduce", all_reduce_whole_tensor_ring, "sends_too_much", "2(n-1)/n"),
    ("ring_all_reduce", all_reduce_without_gather, "no_all_gather", "holds the full sum"),
    ("ring_all_reduce", all_reduce_mean, "averaged", "divided by the number of ranks"),
    ("ring_all_reduce", all_reduce_into_a_copy, "not_in_place", "returned a new tensor with the right values"),
    ("ring_reduce_scatter", reduce_scatter_rebinds_the_sum, "nothing_added", "from ranks 1 and 2 never reached it"),
    ("ring_reduce_scatter", reduce_scatter_receive_not_waited, "receive_not_waited", "were never waited for"),
    ("ring_all_gather", all_gather_into_cloned_segments, "not_in_place", "never wrote into `tensor`"),
    (
        "ring_all_reduce",
        all_reduce_receives_from_the_right,
        "wrong_peer",
        "rank 0 waited in irecv from rank 1 (its call 2); rank 1 sent to rank 2, not to rank 0",
    ),
    ("ring_all_reduce", all_reduce_on_a_copy, "not_in_place", "never wrote into `tensor`"),
    ("ring_all_reduce", all_reduce_rebinds_the_sum, "nothing_added", "holds only rank 0's own values"),
    ("ring_reduce_scatter", reduce_scatter_adds_into_the_segment_sent, "partial_sum", "every rank except"),
    (
        "ring_reduce_scatter",
        reduce_scatter_floor_segments,
        "floor_segments",
        "cut 10 values as 3 + 3 + 3 and leave",
    ),
    ("ring_all_gather", all_gather_by_the_collective, "used_collective", "it called dist.all_gather"),
]
