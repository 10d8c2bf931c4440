"""The communication hooks chapter's answer: the bytes a rank sends in a step under PowerSGD. Written for reading:
the library's version is :func:`distlab.predict.traffic.powersgd_bytes_per_step`.
"""


def powersgd_bytes_sent(shapes: list[tuple[int, ...]], rank: int, world_size: int) -> float:
    values = 0
    for shape in shapes:
        rows = shape[0]
        columns = 1
        for size in shape[1:]:  # every dimension after the first: a convolution's in_channels x kh x kw
            columns *= size
        kept = min(rows, columns, rank)
        if (rows + columns) * kept * 2 < rows * columns:  # worth compressing: P and Q, each kept columns wide
            values += (rows + columns) * kept
        else:  # all-reduced whole (a bias, a small matrix)
            values += rows * columns
    return 2 * (world_size - 1) / world_size * values * 4  # fp32, each rank's share of a ring all-reduce
