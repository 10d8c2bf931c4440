"""Typical wrong answers to the compile chapter's exercise, each with the mistake its check must name."""


def graphs_one_cap_for_all(layer_bytes, bucket_cap_mb):
    cap, graphs, size = int(bucket_cap_mb * 2**20), 1, 0
    for nbytes in reversed(layer_bytes):
        if size >= cap:
            graphs, size = graphs + 1, 0
        size += nbytes
    return graphs - (graphs > 1 and size == 0)


def graphs_counted_forward(layer_bytes, bucket_cap_mb):
    cap, graphs, size = int(bucket_cap_mb * 2**20), 1, 0
    for nbytes in layer_bytes:
        if size >= (2**20 if graphs == 1 else cap):
            graphs, size = graphs + 1, 0
        size += nbytes
    return graphs - (graphs > 1 and size == 0)


def graphs_never_over_cap(layer_bytes, bucket_cap_mb):
    cap, graphs, size = int(bucket_cap_mb * 2**20), 1, 0
    for nbytes in reversed(layer_bytes):
        if size and size + nbytes > (2**20 if graphs == 1 else cap):
            graphs, size = graphs + 1, 0
        size += nbytes
    return graphs


def graphs_total_over_cap(layer_bytes, bucket_cap_mb):
    return -(-sum(layer_bytes) // int(bucket_cap_mb * 2**20))


MISTAKES = [
    ("ddp_compiled_graphs", graphs_one_cap_for_all, "first_bucket_cap_ignored", "bucket_cap_mb=3: got 3, expected 4"),
    ("ddp_compiled_graphs", graphs_counted_forward, "forward_order", "widening: 0.5, 1, 2, 4, 8 MiB"),
    ("ddp_compiled_graphs", graphs_never_over_cap, "never_over_cap", "bucket_cap_mb=3: got 5, expected 4"),
    ("ddp_compiled_graphs", graphs_total_over_cap, "total_over_cap", "bucket_cap_mb=1: got 9, expected 8"),
]


def graphs_in_megabytes(layer_bytes, bucket_cap_mb):
    cap, graphs, size = int(bucket_cap_mb * 10**6), 1, 0
    for nbytes in reversed(layer_bytes):
        if size >= (10**6 if graphs == 1 else cap):
            graphs, size = graphs + 1, 0
        size += nbytes
    return graphs - (graphs > 1 and size == 0)


def graphs_with_an_empty_front_graph(layer_bytes, bucket_cap_mb):
    cap, graphs, size = int(bucket_cap_mb * 2**20), 1, 0
    for nbytes in reversed(layer_bytes):
        if size >= (2**20 if graphs == 1 else cap):
            graphs, size = graphs + 1, 0
        size += nbytes
    return graphs


MISTAKES += [
    ("ddp_compiled_graphs", graphs_in_megabytes, "megabytes", "ten layers of 1,000,000 bytes"),
    ("ddp_compiled_graphs", graphs_with_an_empty_front_graph, "empty_front_graph", "a dropout (no parameters)"),
]
