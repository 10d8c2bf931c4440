"""The compile chapter's answer: how many graphs torch.compile hands its backend for a model wrapped in DDP.

Written for reading: the library's version is :func:`distlab.predict.compiled_ddp.ddp_optimizer_graphs`, the rule
of ``DDPOptimizer.compile_fn`` in ``torch/_dynamo/backends/distributed.py``.
"""


def ddp_compiled_graphs(layer_bytes: list[int], bucket_cap_mb: float) -> int:
    cap, first_cap = int(bucket_cap_mb * 2**20), 2**20  # dynamo passes DDP's cap, and no first cap: 1 MiB
    graphs, size = 1, 0
    for nbytes in reversed(layer_bytes):  # backward makes the last layer's gradients ready first
        if size >= (first_cap if graphs == 1 else cap):  # the bucket was full before this layer: a new graph
            graphs, size = graphs + 1, 0
        size += nbytes  # a layer joins the bucket even if it overflows the cap
    if graphs > 1 and size == 0:  # layers without parameters at the front join the graph after them
        graphs -= 1
    return graphs
