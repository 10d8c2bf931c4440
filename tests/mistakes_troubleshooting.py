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


MISTAKES = [
    ("agree_to_skip", skip_alone, "local_decision", "decided from its own batch"),
    ("agree_to_skip", skip_when_all_agree, "needs_every_rank", "One bad batch anywhere is enough"),
    ("agree_to_skip", share_only_when_bad, "collective_mismatch", "rank 1: all_reduce x1"),
    ("global_accuracy", mean_of_accuracies, "averaged_ratios", "divide once"),
    ("global_accuracy", own_accuracy, "local_accuracy", "this rank's own accuracy"),
]
