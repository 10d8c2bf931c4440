"""FSDP1 (``FullyShardedDataParallel``) as the reference notes configure it.

FSDP1 is deprecated in favour of FSDP2, which :mod:`distlab.parallel.fsdp2`
uses; it stays here so that the notes' own configuration can run next to
FSDP2 and be seen to train the same weights. The map from each of its options
to FSDP2 and to distlab's flags is :mod:`distlab.demos.fsdp_maps`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, FullyShardedDataParallel, MixedPrecision
from torch.distributed.fsdp import ShardingStrategy as FSDP1Sharding
from torch.distributed.fsdp.wrap import _recursive_wrap, size_based_auto_wrap_policy, transformer_auto_wrap_policy

from ..runtime import Runtime

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


WrapPolicy = Callable[..., bool]
"""A function auto-wrap policy: ``policy(module, recurse, nonwrapped_numel) -> bool``."""

NOTES_MIN_NUM_PARAMS = 1_000_000
"""The notes' size-based threshold: more than the whole CNN (405,898 parameters)."""


def wrap_fsdp1(
    model: nn.Module,
    runtime: Runtime,
    sharding_strategy: str = "FULL_SHARD",
    min_num_params: int = NOTES_MIN_NUM_PARAMS,
    backward_prefetch: str | None = "BACKWARD_PRE",
    *,
    transformer_layer_cls: set[type[nn.Module]] | None = None,
    forward_prefetch: bool = False,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
    use_orig_params: bool = False,
    sync_module_states: bool = False,
    device_mesh: DeviceMesh | None = None,
) -> FullyShardedDataParallel:
    """The notes' FSDP1 wrapper, options by name. ``transformer_layer_cls`` swaps the
    size-based policy for the transformer-based one (Accelerate's ``TRANSFORMER_BASED_WRAP``);
    HYBRID_SHARD needs a 2-D ``device_mesh`` (replicate, shard)."""
    if transformer_layer_cls:
        policy: WrapPolicy = partial(transformer_auto_wrap_policy, transformer_layer_cls=set(transformer_layer_cls))
    else:
        policy = partial(size_based_auto_wrap_policy, min_num_params=min_num_params)
    low_precision = param_dtype is not None or reduce_dtype is not None
    return FullyShardedDataParallel(
        model,
        sharding_strategy=FSDP1Sharding[sharding_strategy],
        auto_wrap_policy=policy,
        backward_prefetch=BackwardPrefetch[backward_prefetch] if backward_prefetch else None,
        forward_prefetch=forward_prefetch,
        mixed_precision=MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype) if low_precision else None,
        cpu_offload=CPUOffload(offload_params=cpu_offload),
        use_orig_params=use_orig_params,
        sync_module_states=sync_module_states,
        device_mesh=device_mesh,
        # Without a device FSDP1 looks for an accelerator, and on a CPU-only machine raises
        # "FSDP needs a non-CPU accelerator device"; the runtime's device is the right one on CUDA too.
        device_id=runtime.device,
    )


def policy_units(model: nn.Module, policy: WrapPolicy) -> list[str]:
    """Names of the submodules FSDP1 makes units of under a function auto-wrap
    ``policy``; the rest of the model goes to the root unit, which FSDP1 always makes."""
    wrapped: list[nn.Module] = []

    def note(module: nn.Module, **_: Any) -> nn.Module:
        wrapped.append(module)
        return module

    # torch's own traversal, called the way FullyShardedDataParallel calls it on its root,
    # so the answer is FSDP1's rather than a re-implementation that could drift from it.
    _recursive_wrap(model, policy, note, ignored_modules=set(), ignored_params=set(), only_wrap_children=True)
    order = [module for _, module in model.named_modules()]
    names = {module: name for name, module in model.named_modules()}
    return [names[module] for module in sorted(wrapped, key=order.index)]


def size_based_units(model: nn.Module, min_num_params: int = NOTES_MIN_NUM_PARAMS) -> list[str]:
    """The submodules ``size_based_auto_wrap_policy(min_num_params=...)`` wraps ([]: the root
    alone). Without mixed precision, which also wraps each BatchNorm on its own."""
    return policy_units(model, partial(size_based_auto_wrap_policy, min_num_params=min_num_params))
