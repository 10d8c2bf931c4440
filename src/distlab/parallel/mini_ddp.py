"""Data parallelism from scratch: the naive version beside the bucketed one.

Both keep the core of torch DDP's contract: rank 0's parameters and buffers
are broadcast at construction, and when ``loss.backward()`` returns every
gradient holds the average over ranks. ``no_sync()`` skips the averaging for
accumulation micro-steps, as torch DDP's does.

They leave out four things torch DDP does: broadcasting rank 0's buffers
before every forward (``broadcast_buffers``, which keeps BatchNorm statistics
equal across ranks); launching bucket all-reduces strictly in bucket order,
so that every rank posts the same collectives in the same order; rebuilding
buckets after the first iteration from the order gradients arrived; and a
1 MiB first bucket.

* :class:`NaiveDDP` waits for backward to finish, then all-reduces each
  gradient on its own: one collective per parameter, none of it overlapped.
* :class:`BucketedDDP` packs gradients into size-capped buckets in reverse
  order of registration (roughly the order backward produces them) and
  launches each bucket's all-reduce asynchronously the moment its last
  gradient is ready, so communication runs while backward still computes.
  Buckets are launched in the order they complete; that order is the same on
  every rank because every rank runs the same backward graph (torch DDP does
  not rely on it).

The communication itself lives in :mod:`torch.distributed` (or any
all-reduce you pass in, such as :func:`distlab.comm.collectives.ring_all_reduce`);
these wrappers only decide *when* and *on what* to call it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import DistlabError

AllReduce = Callable[[torch.Tensor], object]


def _queue_after_backward(callback: Callable[[], None]) -> None:
    # Runs ``callback`` once the autograd engine has finished this backward
    # pass, before ``loss.backward()`` returns to the caller (torch DDP's
    # reducer finalises the same way).
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def broadcast_from_rank0(module: nn.Module, group=None) -> None:
    """Every rank starts from rank 0's parameters and buffers."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor.data, src=src, group=group)


class DataParallelWrapper(nn.Module):
    """What both wrappers share: the wrapped ``module``, the broadcast, ``no_sync``."""

    def __init__(self, module: nn.Module, group=None):
        super().__init__()
        if not dist.is_initialized():
            raise DistlabError(
                "mini_ddp needs a process group: start it with distlab.runtime.distributed() or torchrun"
            )
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.require_sync = True
        self._callback_queued = False
        self.bucket_of: dict[torch.Tensor, object] = {}  # a bucketed wrapper's: each parameter's bucket
        if any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
            return  # no weights yet: a wrapper that materialises them from one seed hooks them then
        broadcast_from_rank0(module, group)
        self._hook_gradients()

    def _hook_gradients(self) -> None:
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._gradient_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside keep their gradients local (and accumulate them)."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    def _on_first_gradient(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            _queue_after_backward(self._after_backward)

    def _after_backward(self) -> None:
        self._callback_queued = False
        self.finish_gradient_sync()

    def _gradient_ready(self, param: torch.Tensor) -> None:
        """The hook on every trainable parameter. Under ``no_sync()`` the gradient stays local; otherwise the
        first gradient of a backward queues the sync at its end, and a bucketed wrapper gets each gradient in
        its bucket (:meth:`_bucket_ready`)."""
        if not self.require_sync:
            return
        self._on_first_gradient()
        if param in self.bucket_of:
            self._bucket_ready(self.bucket_of[param], param)

    def _bucket_ready(self, bucket, param: torch.Tensor) -> None:
        """``param``'s gradient is ready and belongs to ``bucket``: what a bucketed wrapper does with it."""

    def finish_gradient_sync(self) -> None:
        raise NotImplementedError


class NaiveDDP(DataParallelWrapper):
    """After backward: one blocking all-reduce per parameter, then divide."""

    def __init__(self, module: nn.Module, group=None, all_reduce: AllReduce | None = None):
        super().__init__(module, group)
        self.all_reduce = all_reduce or (lambda t: dist.all_reduce(t, group=self.group))

    def finish_gradient_sync(self) -> None:
        for grad in self.gradients():
            self.all_reduce(grad)
            grad.div_(self.world_size)

    def gradients(self) -> list[torch.Tensor]:
        """Every trainable parameter's gradient, or one sentence naming a parameter that got none."""
        for p in self.params:
            if p.grad is None:
                raise DistlabError(_unused_parameter_message(self.module, p))
        return [p.grad for p in self.params]


class _Bucket:
    """A flat buffer of several gradients, all-reduced as one tensor."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.offsets = {}
        offset = 0
        for p in params:
            self.offsets[p] = offset
            offset += p.numel()
        first = params[0]
        self.flat = torch.zeros(offset, dtype=first.dtype, device=first.device)
        self.ready: set[int] = set()
        self.work = None

    def copy_in(self, p: torch.Tensor) -> None:
        start = self.offsets[p]
        self.flat[start : start + p.numel()].copy_(p.grad.reshape(-1))
        self.ready.add(id(p))

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.params)

    def copy_out(self) -> None:
        for p in self.params:
            start = self.offsets[p]
            p.grad.copy_(self.flat[start : start + p.numel()].view_as(p.grad))

    def reset(self) -> None:
        self.ready.clear()
        self.work = None


def bucket_groups(params: list[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """The parameters of each bucket: reverse registration order (roughly the order backward produces
    their gradients), a new bucket whenever the cap would be passed or the dtype changes."""
    groups, current, size = [], [], 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > cap_bytes or p.dtype != current[0].dtype):
            groups.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    return groups + ([current] if current else [])


def make_buckets(params: list[torch.Tensor], cap_bytes: int) -> list[_Bucket]:
    """One all-reduce buffer per bucket of :func:`bucket_groups`."""
    return [_Bucket(group) for group in bucket_groups(params, cap_bytes)]


class BucketedDDP(DataParallelWrapper):
    """Buckets of gradients, all-reduced asynchronously while backward runs."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, group=None):
        super().__init__(module, group)
        self.buckets = make_buckets(self.params, int(bucket_cap_mb * 2**20))
        self.bucket_of = {p: b for b in self.buckets for p in b.params}

    def _bucket_ready(self, bucket: _Bucket, param: torch.Tensor) -> None:
        bucket.copy_in(param)
        if bucket.complete:
            bucket.flat.div_(self.world_size)  # average before summing: no overflow in low precision
            bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)

    def finish_gradient_sync(self) -> None:
        for bucket in self.buckets:
            if bucket.work is None:
                missing = next(p for p in bucket.params if id(p) not in bucket.ready)
                for other in self.buckets:  # leave no collective half-posted
                    if other.work is not None:
                        other.work.wait()
                    other.reset()
                raise DistlabError(_unused_parameter_message(self.module, missing))
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.copy_out()
            bucket.reset()

    def bucket_sizes(self) -> list[int]:
        """Bytes per bucket, in launch order."""
        return [b.flat.numel() * b.flat.element_size() for b in self.buckets]


def _unused_parameter_message(module: nn.Module, param: torch.Tensor) -> str:
    name = next((n for n, p in module.named_parameters() if p is param), "?")
    return (
        f"parameter {name!r} got no gradient in this backward, so its bucket was never reduced: "
        "every trainable parameter must take part in the loss (freeze unused ones with requires_grad_(False))"
    )
