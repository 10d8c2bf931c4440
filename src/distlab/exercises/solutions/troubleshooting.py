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
