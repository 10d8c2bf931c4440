"""Typical wrong answers to the communication hooks chapter's exercise, each with the mistake its check must name."""

import math

from distlab.predict.traffic import powersgd_values


def _ring(values, world_size):
    return 2 * (world_size - 1) / world_size * values * 4


def every_tensor_compressed(shapes, rank, world_size):
    values = sum((s[0] + math.prod(s) // s[0]) * min(s[0], math.prod(s) // s[0], rank) for s in shapes)  # biases too
    return _ring(values, world_size)


def forgot_uncompressed(shapes, rank, world_size):
    values = sum(v for v, compressed in (powersgd_values(s, rank) for s in shapes) if compressed)  # biases dropped
    return _ring(values, world_size)


def only_p(shapes, rank, world_size):
    values = 0
    for s in shapes:
        v, compressed = powersgd_values(s, rank)
        values += s[0] * min(s[0], math.prod(s) // s[0], rank) if compressed else v  # P sent, Q forgotten
    return _ring(values, world_size)


def columns_from_last_dim(shapes, rank, world_size):
    values = sum(powersgd_values((math.prod(s) // s[-1], s[-1]), rank)[0] for s in shapes)  # (rest, last) matrices
    return _ring(values, world_size)


def values_not_ring_bytes(shapes, rank, world_size):
    return sum(powersgd_values(s, rank)[0] for s in shapes) * 4  # the tensor's bytes, not a rank's ring share


MISTAKES = [
    ("powersgd_bytes_sent", every_tensor_compressed, "every_tensor_compressed", "the chapter's MLP"),
    ("powersgd_bytes_sent", forgot_uncompressed, "forgot_uncompressed", "PowerSGD rank 1 on 2 ranks"),
    ("powersgd_bytes_sent", only_p, "only_p", "expected"),
    ("powersgd_bytes_sent", columns_from_last_dim, "columns_from_last_dim", "a small CNN"),
    ("powersgd_bytes_sent", values_not_ring_bytes, "values_not_ring_bytes", "PowerSGD rank 4 on 4 ranks"),
]
