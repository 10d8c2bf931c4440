"""How many graphs ``torch.compile`` hands its backend for a model wrapped in DDP: DDPOptimizer's bucket rule.

When dynamo compiles a module that runs inside ``DistributedDataParallel`` (``torch._dynamo.config.optimize_ddp``,
on by default), ``torch/_dynamo/convert_frame.py`` builds ``DDPOptimizer(bucket_bytes_cap=ddp.bucket_bytes_cap)``
and lets it split the traced graph (``torch/_dynamo/backends/distributed.py``, ``DDPOptimizer.compile_fn``): it
walks the graph's nodes from the last to the first, the order in which backward makes the gradients ready, adds
each node's parameter bytes to the current bucket, and starts a new bucket at the next node once the current one
holds at least the cap. The first bucket's cap is ``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB): the
call passes no ``first_bucket_cap``. A bucket may therefore overflow its cap by the last parameters it took, and a
parameter larger than the cap closes the bucket it joins. Each bucket becomes one subgraph, compiled apart, so that
its gradients are ready, and DDP's hook can start their all-reduce, before the earlier subgraphs' backward runs.

This is that rule on a chain of layers (each layer's parameters used by one node, as a ``Linear``'s weight and
bias are), without torch: ``tests/test_compile.py`` checks it against the graphs a counting backend receives.
"""

from __future__ import annotations

MIB = 1 << 20
DEFAULT_FIRST_BUCKET_BYTES = MIB
"""``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``, which DDPOptimizer falls back to (no first_bucket_cap is
passed where dynamo builds it)."""


def ddp_optimizer_buckets(
    layer_bytes: list[int], bucket_cap_bytes: int, first_bucket_cap: int = DEFAULT_FIRST_BUCKET_BYTES
) -> list[list[int]]:
    """The layers (indices in forward order) of each subgraph DDPOptimizer makes, last bucket of backward first
    as DDPOptimizer lists them reversed: ``[[0, 1, ...], ..., [7]]`` in forward order. ``layer_bytes`` is each
    layer's parameter bytes in forward order (0 for a layer without parameters)."""
    if first_bucket_cap > bucket_cap_bytes:
        raise ValueError(
            f"a bucket cap of {bucket_cap_bytes:,} B is below DDPOptimizer's first bucket of {first_bucket_cap:,} B: "
            "torch asserts 'First bucket should be smaller/equal to other buckets'"
        )
    buckets: list[list[int]] = [[]]
    size = 0
    for layer in reversed(range(len(layer_bytes))):
        cap = first_bucket_cap if len(buckets) == 1 else bucket_cap_bytes
        if size >= cap:  # full before this layer: the layer starts the next bucket
            buckets.append([])
            size = 0
        buckets[-1].append(layer)
        size += layer_bytes[layer]
    if len(buckets) > 1 and size == 0:  # a preamble without parameters is fused into the bucket after it
        buckets[-2].extend(buckets.pop())
    return [sorted(bucket) for bucket in reversed(buckets)]


def ddp_optimizer_graphs(
    layer_bytes: list[int], bucket_cap_bytes: int, first_bucket_cap: int = DEFAULT_FIRST_BUCKET_BYTES
) -> int:
    """How many graphs the backend receives in one compile of a DDP-wrapped chain of layers."""
    return len(ddp_optimizer_buckets(layer_bytes, bucket_cap_bytes, first_bucket_cap))


def linear_layer_bytes(widths: list[int], bytes_per_value: int = 4) -> list[int]:
    """Each ``Linear(widths[i], widths[i + 1])``'s weight and bias, in bytes."""
    return [(a * b + b) * bytes_per_value for a, b in zip(widths, widths[1:])]
