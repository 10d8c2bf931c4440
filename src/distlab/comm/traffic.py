"""Bytes each rank sends, counted from the collectives it calls (the derivation they are checked
against is :func:`distlab.predict.traffic.expected_bytes_per_step`).

Every collective of ``torch.distributed`` (DDP's buckets, FSDP2's
all-gathers, the course's ZeRO) passes through PyTorch's dispatcher as a
``c10d`` operator, so one dispatch mode sees them all. Each call is counted
at the volume a ring algorithm sends per rank for it (the convention of
nccl-tests' bus bandwidth, and of the ZeRO paper's 2Ψ / 3Ψ):

=========================  ==========================  ===================
collective                 ``S`` is                    bytes sent per rank
=========================  ==========================  ===================
all-reduce                 the tensor                  ``2 (n-1)/n · S``
all-gather                 the gathered output         ``(n-1)/n · S``
reduce-scatter             the input being reduced     ``(n-1)/n · S``
broadcast                  the tensor                  ``S`` (ring: each rank forwards it once)
send                       the tensor                  ``S``
=========================  ==========================  ===================

It counts what the algorithm needs, not what a backend happens to do: gloo
runs a reduce-scatter as a whole all-reduce underneath, and sends more.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# c10d operator name -> (collective, which argument holds S, bytes-per-rank factor as a function of n)
_COLLECTIVES = {
    "allreduce_": ("all_reduce", 0, lambda n: 2 * (n - 1) / n),
    "allreduce_coalesced_": ("all_reduce", 0, lambda n: 2 * (n - 1) / n),
    "_allgather_base_": ("all_gather", 0, lambda n: (n - 1) / n),
    "allgather_into_tensor_coalesced_": ("all_gather", 0, lambda n: (n - 1) / n),
    "allgather_": ("all_gather", 0, lambda n: (n - 1) / n),
    "_reduce_scatter_base_": ("reduce_scatter", 1, lambda n: (n - 1) / n),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, lambda n: (n - 1) / n),
    "reduce_scatter_": ("reduce_scatter", 1, lambda n: (n - 1) / n),
    "broadcast_": ("broadcast", 0, lambda n: 1.0 if n > 1 else 0.0),
    "send": ("send", 0, lambda n: 1.0),
}


def _device_type(arg) -> str | None:
    """The device of the first tensor in a (nested) list of tensors."""
    if isinstance(arg, torch.Tensor):
        return arg.device.type
    if isinstance(arg, (list, tuple)):
        return next((d for d in map(_device_type, arg) if d is not None), None)
    return None


def _nbytes(arg) -> int:
    """Bytes of a tensor, or of a (nested) list of tensors, as the c10d operators receive them."""
    if isinstance(arg, torch.Tensor):
        return arg.numel() * arg.element_size()
    if isinstance(arg, (list, tuple)):
        return sum(_nbytes(item) for item in arg)
    return 0


class TrafficCounter(TorchDispatchMode):
    """Inside ``with TrafficCounter(world_size) as counted:``, every collective this
    rank calls is added to ``counted.bytes_sent`` and ``counted.calls``, by collective, and to
    ``counted.bytes_by_device`` by the device type of its tensors: on a CUDA run with NCCL, every byte of a
    training step is on ``cuda`` (a ``cpu`` byte there went through the group's gloo leg, slowly)."""

    def __init__(self, world_size: int):
        super().__init__()
        self.world_size = world_size
        self.bytes_sent: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes_by_device: dict[str, float] = defaultdict(float)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and func._opname in _COLLECTIVES:
            collective, which, factor = _COLLECTIVES[func._opname]
            sent = factor(self.world_size) * _nbytes(args[which])
            self.bytes_sent[collective] += sent
            self.bytes_by_device[_device_type(args[which]) or "unknown"] += sent
            self.calls[collective] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total_bytes(self) -> float:
        return sum(self.bytes_sent.values())

    def summary(self) -> dict[str, dict[str, float]]:
        return {name: {"bytes_sent": sent, "calls": self.calls[name]} for name, sent in sorted(self.bytes_sent.items())}
