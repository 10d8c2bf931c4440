"""The troubleshooting page's answers: decisions and counts every rank agrees on, in one collective each."""

import torch
import torch.distributed as dist


def agree_to_skip(bad_batch: bool) -> bool:
    flag = torch.tensor([1.0 if bad_batch else 0.0])  # a CPU tensor: a CUDA group carries gloo for it, beside NCCL
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def global_accuracy(correct: int, seen: int) -> float:
    counts = torch.tensor([correct, seen], dtype=torch.float64)
    dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()


def mismatched_collective(dumps):
    calls = [{call.sequence: call for call in dumps[rank]} for rank in (0, 1)]
    first = max(min(rank_calls) for rank_calls in calls)  # older calls are gone from one rank's ring buffer
    last = max(max(rank_calls) for rank_calls in calls)
    for sequence in range(first, last + 1):
        mine = [rank_calls.get(sequence) for rank_calls in calls]
        for rank in (0, 1):
            if mine[rank] is None:
                return rank, sequence, None  # its calls stop here: the other rank waits for it
        if (mine[0].collective, mine[0].sizes) != (mine[1].collective, mine[1].sizes):
            return 1, sequence, mine[1].collective
    return None
