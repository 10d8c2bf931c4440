"""The cost chapter's answers: a ring collective's time, and the bytes each strategy sends in one step.

Written for reading: the library's versions are ``CollectiveModel.nccl`` in :mod:`distlab.predict.costmodel` (the
time) and :func:`distlab.predict.traffic.expected_bytes_per_step` (the bytes, in one dtype; the GPU predictions
count each collective in its own, :func:`distlab.predict.costmodel.collective_calls`).
"""


def ring_time(collective: str, nbytes: float, n: int, alpha_s: float, bandwidth: float) -> float:
    hops = {"all_reduce": 2 * (n - 1), "reduce_scatter": n - 1, "all_gather": n - 1}[collective]
    # every hop pays the latency once and moves one n-th of the tensor over the link
    return hops * alpha_s + hops / n * nbytes / bandwidth


def bytes_sent_per_step(strategy: str, parameters: int, n: int, reduce_bytes: int, gather_bytes: int) -> float:
    share = (n - 1) / n  # what a ring sends from each rank, per byte of the whole tensor, per phase
    if strategy == "ddp":  # one all-reduce of the gradients: a reduce-scatter and an all-gather
        return 2 * share * parameters * reduce_bytes
    gathers = 2 if strategy == "fsdp" else 1  # FULL_SHARD gathers again in backward
    # zero1, zero2, fsdp, fsdp-no-reshard: reduce-scatter the gradients, all-gather the parameters
    return share * parameters * (reduce_bytes + gathers * gather_bytes)


def frozen_base_bytes_sent(strategy: str, parameters: int, trainable: int, n: int, bytes_per_value: int) -> float:
    share = (n - 1) / n  # what a ring sends from each rank, per byte of the whole tensor, per phase
    if strategy == "ddp":  # frozen parameters have no gradient: only the trainable ones are all-reduced
        return 2 * share * trainable * bytes_per_value
    gathers = 2 if strategy == "fsdp" else 1  # every parameter, frozen too, is gathered to compute with
    return share * (gathers * parameters + trainable) * bytes_per_value
