"""Typical wrong answers to the troubleshooting page's exercises."""

import torch
import torch.distributed as dist


def skip_alone(bad_batch):
    return bad_batch


def skip_when_all_agree(bad_batch):
    flag = torch.tensor([1.0 if bad_batch else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def share_only_when_bad(bad_batch):
    flag = torch.tensor([1.0 if bad_batch else 0.0])
    if bad_batch:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def mean_of_accuracies(correct, seen):
    accuracy = torch.tensor([correct / seen if seen else 0.0])
    dist.all_reduce(accuracy)
    return accuracy.item() / dist.get_world_size()


def own_accuracy(correct, seen):
    return correct / max(seen, 1)


def paired_by_position(dumps):
    for first, second in zip(dumps[0], dumps[1]):
        if (first.collective, first.sizes) != (second.collective, second.sizes):
            return 1, second.sequence, second.collective
    if len(dumps[0]) != len(dumps[1]):
        shorter = 0 if len(dumps[0]) < len(dumps[1]) else 1
        return shorter, dumps[1 - shorter][len(dumps[shorter])].sequence, None
    return None


def _by_sequence(dumps, same):
    calls = [{call.sequence: call for call in dumps[rank]} for rank in (0, 1)]
    first = max(min(rank_calls) for rank_calls in calls)
    for sequence in range(first, max(max(rank_calls) for rank_calls in calls) + 1):
        mine = [rank_calls.get(sequence) for rank_calls in calls]
        if None in mine:
            return same(mine, sequence)
        if not same(mine, sequence):
            return 1, sequence, mine[1].collective
    return None


def names_the_waiting_rank(dumps):
    def same(mine, sequence):
        if None in mine:  # the rank whose last call nobody matched
            waiting = 0 if mine[0] is not None else 1
            return waiting, sequence, mine[waiting].collective
        return (mine[0].collective, mine[0].sizes) == (mine[1].collective, mine[1].sizes)

    return _by_sequence(dumps, same)


def ignores_sizes(dumps):
    def same(mine, sequence):
        if None in mine:
            return mine.index(None), sequence, None
        return mine[0].collective == mine[1].collective

    return _by_sequence(dumps, same)


def counts_dropped_calls_as_missing(dumps):
    calls = [{call.sequence: call for call in dumps[rank]} for rank in (0, 1)]
    first = min(min(rank_calls) for rank_calls in calls)  # from the oldest call any rank holds
    for sequence in range(first, max(max(rank_calls) for rank_calls in calls) + 1):
        mine = [rank_calls.get(sequence) for rank_calls in calls]
        for rank in (0, 1):
            if mine[rank] is None:
                return rank, sequence, None
        if (mine[0].collective, mine[0].sizes) != (mine[1].collective, mine[1].sizes):
            return 1, sequence, mine[1].collective
    return None


MISTAKES = [
    ("agree_to_skip", skip_alone, "local_decision", "decided from its own batch"),
    ("agree_to_skip", skip_when_all_agree, "needs_every_rank", "One bad batch anywhere is enough"),
    ("agree_to_skip", share_only_when_bad, "collective_mismatch", "rank 1: all_reduce x1"),
    ("global_accuracy", mean_of_accuracies, "averaged_ratios", "divide once"),
    ("global_accuracy", own_accuracy, "local_accuracy", "this rank's own accuracy"),
    ("mismatched_collective", paired_by_position, "by_position", "pair them by call.sequence"),
    ("mismatched_collective", names_the_waiting_rank, "waiting_rank", "you named the rank that waits"),
    ("mismatched_collective", ignores_sizes, "ignored_sizes", "Compare call.sizes"),
    ("mismatched_collective", counts_dropped_calls_as_missing, "dropped_as_missing", "was not missed"),
]
