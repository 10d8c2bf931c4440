"""The compile chapter's exercise: how many graphs DDPOptimizer splits a compiled model into, for a bucket cap.

Arithmetic, run on one rank and graded on a grid against :func:`distlab.predict.compiled_ddp.ddp_optimizer_graphs`
(``tests/test_compile.py`` checks that against the graphs a counting backend receives); a wrong answer is compared
with what each typical mistake would give on the same inputs.
"""

from __future__ import annotations

import math

from ..predict.compiled_ddp import MIB, ddp_optimizer_graphs, linear_layer_bytes
from .catalog import Exercise
from .trial import Trial

MODELS = (
    ("8 x Linear(512, 512) and ReLU, the page's", [b for b in linear_layer_bytes([512] * 9) for b in (b, 0)]),
    ("an embedding of 32 MiB, then 6 layers of 2 MiB", [32 * MIB] + [2 * MIB] * 6),
    ("widening: 0.5, 1, 2, 4, 8 MiB", [MIB // 2, MIB, 2 * MIB, 4 * MIB, 8 * MIB]),
    ("narrowing: 8, 4, 2, 1, 0.5 MiB", [8 * MIB, 4 * MIB, 2 * MIB, MIB, MIB // 2]),
    ("ten layers of 1,000,000 bytes, just under 1 MiB", [10**6] * 10),  # 2**20 and 10**6 cut them apart
    ("a dropout (no parameters), then four layers of 2 MiB", [0] + [2 * MIB] * 4),
)
CAPS_MB = (1, 3, 5, 25)


def _closing_before_overflow(layer_bytes: list[int], cap: int) -> int:
    """A bucket that never exceeds its cap: a layer that would overflow it starts the next one."""
    graphs, size = 1, 0
    for nbytes in reversed(layer_bytes):
        limit = MIB if graphs == 1 else cap
        if size and size + nbytes > limit:
            graphs, size = graphs + 1, 0
        size += nbytes
    return graphs


def _front_opens_a_graph(layer_bytes: list[int], cap: int) -> int:
    """The rule without its preamble step: parameterless layers at the front keep a graph of their own."""
    graphs, size = 1, 0
    for nbytes in reversed(layer_bytes):
        if size >= (MIB if graphs == 1 else cap):
            graphs, size = graphs + 1, 0
        size += nbytes
    return graphs


def _mistakes(layer_bytes: list[int], cap_mb: float) -> list[tuple[str, int]]:
    cap = int(cap_mb * MIB)
    return [
        ("megabytes", ddp_optimizer_graphs(layer_bytes, int(cap_mb * 10**6), first_bucket_cap=10**6)),
        ("empty_front_graph", _front_opens_a_graph(layer_bytes, cap)),
        ("first_bucket_cap_ignored", ddp_optimizer_graphs(layer_bytes, cap, first_bucket_cap=cap)),
        ("forward_order", ddp_optimizer_graphs(layer_bytes[::-1], cap)),
        ("never_over_cap", _closing_before_overflow(layer_bytes, cap)),
        ("total_over_cap", math.ceil(sum(layer_bytes) / cap)),
    ]


def graphs_trial(t: Trial, fn) -> None:
    for model, layer_bytes in MODELS:
        with t.case(model):
            for cap_mb in CAPS_MB:
                expected = ddp_optimizer_graphs(layer_bytes, int(cap_mb * MIB))
                got = t.call(fn, list(layer_bytes), cap_mb)
                if got == expected:
                    continue
                mistake = next((k for k, v in _mistakes(layer_bytes, cap_mb) if v == got), None)
                t.fail("graphs", f"bucket_cap_mb={cap_mb}: got {got!r}, expected {expected}", mistake)
    t.note("the first graph (the last layers) holds 1 MiB whatever the cap: dynamo builds DDPOptimizer without "
           "DDP's first_bucket_cap")  # fmt: skip


EXERCISES = (
    Exercise(
        name="ddp_compiled_graphs",
        page="compile",
        task="Return how many graphs torch.compile hands its backend for a chain of layers wrapped in DDP with "
        "`bucket_cap_mb`: `layer_bytes` is each layer's parameter bytes in forward order (0 for a layer without "
        "parameters). DDPOptimizer walks the layers from the last, adds each one's bytes to the current bucket, "
        "and starts a new bucket (a new graph) at the next layer once the bucket holds at least its cap; the "
        "first bucket's cap is 1 MiB.",
        signature="def ddp_compiled_graphs(layer_bytes: list[int], bucket_cap_mb: float) -> int:",
        solution="compile.ddp_compiled_graphs",
        library="distlab.predict.compiled_ddp.ddp_optimizer_graphs",
        trial=graphs_trial,
        ranks=1,
        mistakes={
            "first_bucket_cap_ignored": "the first bucket (the last layers, whose gradients are ready first) closes "
            "at 1 MiB whatever bucket_cap_mb says: dynamo builds DDPOptimizer without a first_bucket_cap, so it "
            "takes torch.distributed._DEFAULT_FIRST_BUCKET_BYTES.",
            "megabytes": "bucket_cap_mb counts mebibytes: DDP multiplies it by 1024 * 1024, and the first bucket "
            "is 2**20 bytes, so a layer of 1,000,000 bytes does not fill it.",
            "empty_front_graph": "layers without parameters before the first layer that has some open no graph "
            "of their own: with no bytes to reduce they join the graph after them.",
            "forward_order": "count from the last layer: DDPOptimizer walks the graph in reverse, the order in "
            "which backward makes the gradients ready.",
            "never_over_cap": "a layer joins the bucket even when it overflows the cap: DDPOptimizer checks the "
            "size before each layer and starts a new bucket only once the bucket already holds at least the cap.",
            "total_over_cap": "the graphs are not the total bytes over the cap: buckets hold whole layers, a layer "
            "larger than the cap closes the bucket it joins, and the first bucket's cap is 1 MiB.",
        },
    ),
)
