"""Typical wrong answers to the cost chapter's exercises, each with the mistake its check must name."""


def ring_time_reduce_scatter_only(collective, nbytes, n, alpha_s, bandwidth):
    return (n - 1) * alpha_s + (n - 1) / n * nbytes / bandwidth


def ring_time_whole_tensor_per_hop(collective, nbytes, n, alpha_s, bandwidth):
    hops = 2 * (n - 1) if collective == "all_reduce" else n - 1
    return hops * alpha_s + hops * nbytes / bandwidth


def ring_time_latency_once(collective, nbytes, n, alpha_s, bandwidth):
    hops = 2 * (n - 1) if collective == "all_reduce" else n - 1
    return alpha_s + hops / n * nbytes / bandwidth


def ring_time_every_collective_twice(collective, nbytes, n, alpha_s, bandwidth):
    return 2 * (n - 1) * alpha_s + 2 * (n - 1) / n * nbytes / bandwidth


def sent_fsdp_as_ddp(strategy, parameters, n, reduce_bytes, gather_bytes):
    share = (n - 1) / n
    if strategy in ("ddp", "fsdp"):
        return 2 * share * parameters * reduce_bytes
    gathers = 1
    return share * parameters * (reduce_bytes + gathers * gather_bytes)


def sent_without_backward_gather(strategy, parameters, n, reduce_bytes, gather_bytes):
    share = (n - 1) / n
    if strategy == "ddp":
        return 2 * share * parameters * reduce_bytes
    return share * parameters * (reduce_bytes + gather_bytes)


def sent_in_the_gradient_dtype(strategy, parameters, n, reduce_bytes, gather_bytes):
    share = (n - 1) / n
    gathers = 3 if strategy == "fsdp" else 2
    return gathers * share * parameters * reduce_bytes


def sent_always_reducing_fp32(strategy, parameters, n, reduce_bytes, gather_bytes):
    share = (n - 1) / n
    if strategy == "ddp":
        return 2 * share * parameters * 4
    gathers = 2 if strategy == "fsdp" else 1
    return share * parameters * (4 + gathers * gather_bytes)


def sent_whole_tensor(strategy, parameters, n, reduce_bytes, gather_bytes):
    gathers = 2 if strategy == "fsdp" else 1
    if strategy == "ddp":
        return 2 * parameters * reduce_bytes
    return parameters * (reduce_bytes + gathers * gather_bytes)


def sent_zero_without_gather(strategy, parameters, n, reduce_bytes, gather_bytes):
    share = (n - 1) / n
    if strategy in ("zero1", "zero2"):
        return share * parameters * reduce_bytes
    gathers = 2 if strategy == "fsdp" else 1
    if strategy == "ddp":
        return 2 * share * parameters * reduce_bytes
    return share * parameters * (reduce_bytes + gathers * gather_bytes)


# The answers a fifth review wrote and graded (its section 4)


def ring_time_n_hops(collective, nbytes, n, alpha_s, bandwidth):  # W15: n hops a phase, not n - 1
    hops = 2 * n if collective == "all_reduce" else n
    return hops * alpha_s + hops / n * nbytes / bandwidth


def sent_zero_as_all_reduce_and_gather(strategy, parameters, n, reduce_bytes, gather_bytes):  # W16
    share = (n - 1) / n
    if strategy == "ddp":
        return 2 * share * parameters * reduce_bytes
    if strategy in ("zero1", "zero2"):
        return 2 * share * parameters * reduce_bytes + share * parameters * gather_bytes
    gathers = 2 if strategy == "fsdp" else 1
    return share * parameters * (reduce_bytes + gathers * gather_bytes)


# Over a frozen base (the practice chapter's exercise)


def frozen_every_gradient_reduced(strategy, parameters, trainable, n, bytes_per_value):
    share = (n - 1) / n
    if strategy == "ddp":
        return 2 * share * parameters * bytes_per_value
    gathers = 2 if strategy == "fsdp" else 1
    return share * (gathers + 1) * parameters * bytes_per_value


def frozen_weights_not_gathered(strategy, parameters, trainable, n, bytes_per_value):
    share = (n - 1) / n
    gathers = {"ddp": 1, "fsdp": 2, "fsdp-no-reshard": 1}[strategy]
    return share * (gathers + 1) * trainable * bytes_per_value  # only the adapters gathered


def frozen_whole_tensor(strategy, parameters, trainable, n, bytes_per_value):
    if strategy == "ddp":
        return 2 * trainable * bytes_per_value
    gathers = 2 if strategy == "fsdp" else 1
    return (gathers * parameters + trainable) * bytes_per_value


MISTAKES = [
    ("ring_collective_time", ring_time_reduce_scatter_only, "reduce_scatter_only", "all_reduce of 4 KiB on 2 ranks"),
    ("ring_collective_time", ring_time_whole_tensor_per_hop, "whole_tensor_per_hop", "got 13.448 us, expected 12.424"),
    ("ring_collective_time", ring_time_latency_once, "latency_once", "2 hops x 5.7 us"),
    ("ring_collective_time", ring_time_every_collective_twice, "all_reduce_factor", "reduce_scatter of 4 KiB"),
    ("bytes_sent_per_step", sent_fsdp_as_ddp, "forgot_backward_gather", "fsdp, 124,439,808 parameters"),
    ("bytes_sent_per_step", sent_without_backward_gather, "forgot_backward_gather", "expected 0.746639 GB (1.5 x)"),
    ("bytes_sent_per_step", sent_in_the_gradient_dtype, "wrong_dtype", "16-bit parameters"),
    ("bytes_sent_per_step", sent_zero_without_gather, "zero_without_gather", "zero1, 124,439,808 parameters"),
    ("bytes_sent_per_step", sent_whole_tensor, "whole_tensor", "ddp, 124,439,808 parameters"),
    ("bytes_sent_per_step", sent_always_reducing_fp32, "reduced_in_fp32", "FSDP2's default with a 16-bit param_dtype"),
    ("ring_collective_time", ring_time_n_hops, "n_hops", "got 24.848 us, expected 12.424 us"),
    ("bytes_sent_per_step", sent_zero_as_all_reduce_and_gather, "zero_all_reduced", "(1.5 x the gradients' bytes)"),
    ("frozen_base_bytes_sent", frozen_every_gradient_reduced, "frozen_gradients_reduced", "4,194,304 of"),
    ("frozen_base_bytes_sent", frozen_weights_not_gathered, "frozen_weights_not_gathered", "fsdp, 4,194,304 of"),
    ("frozen_base_bytes_sent", frozen_whole_tensor, "whole_tensor", "ddp, 4,194,304 of 6,738,415,616"),
]
