"""Typical wrong answers to the first-run page's exercise, each with the mistake its check must name."""

import torch.distributed as dist


def mean_forgets_to_divide(value):
    total = value.clone()
    dist.all_reduce(total)
    return total


def mean_on_rank_zero_only(value):
    total = value.clone()
    if dist.get_rank() == 0:
        dist.all_reduce(total)
    return total / dist.get_world_size()


def mean_by_reduce(value):
    total = value.clone()
    dist.reduce(total, dst=0)
    return total / dist.get_world_size()


def mean_in_place(value):
    dist.all_reduce(value)
    return value / dist.get_world_size()


def mean_of_own_value(value):
    return value.clone()


# The answers a fifth review wrote and graded (its section 4)


def mean_by_reduce_then_broadcast(value):  # V6: reduce to rank 0, divide there, broadcast
    total = value.clone()
    dist.reduce(total, dst=0)
    if dist.get_rank() == 0:
        total /= dist.get_world_size()
    dist.broadcast(total, src=0)
    return total


ALTERNATIVES = [
    ("global_mean", mean_by_reduce_then_broadcast),
]

MISTAKES = [
    ("global_mean", mean_forgets_to_divide, "summed", "the sum over the 3 ranks"),
    ("global_mean", mean_on_rank_zero_only, "collective_mismatch", "rank 0: all_reduce x1"),
    ("global_mean", mean_by_reduce, "reduce_to_one_rank", "dist.reduce"),
    ("global_mean", mean_in_place, "changed_input", "now holds"),
    ("global_mean", mean_of_own_value, "no_collective", "called no collective"),
]
