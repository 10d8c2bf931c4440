"""Typical wrong answers to the pinned-memory chapter's exercises, each with the mistake its check must name."""


def copy_pageable_at_link_rate(nbytes, pinned, link_GBps, stage_GBps, chunk_bytes=2 << 20):
    return nbytes / (link_GBps * 1e9)


def copy_stage_then_send(nbytes, pinned, link_GBps, stage_GBps, chunk_bytes=2 << 20):
    if pinned:
        return nbytes / (link_GBps * 1e9)
    return nbytes / (stage_GBps * 1e9) + nbytes / (link_GBps * 1e9)


def copy_at_the_slower_rate(nbytes, pinned, link_GBps, stage_GBps, chunk_bytes=2 << 20):
    if pinned:
        return nbytes / (link_GBps * 1e9)
    return nbytes / (min(link_GBps, stage_GBps) * 1e9)


def copy_in_gibibytes(nbytes, pinned, link_GBps, stage_GBps, chunk_bytes=2 << 20):
    return nbytes / (link_GBps * 2**30)


def read_safe_once_non_blocking_is_off(pinned, non_blocking, wait):
    return not non_blocking or wait != "none"


def read_safe_after_any_wait(pinned, non_blocking, wait):
    return not (pinned and non_blocking) or wait != "none"


def read_always_safe(pinned, non_blocking, wait):
    return True


def read_pageable_is_the_risky_one(pinned, non_blocking, wait):
    return pinned or wait != "none"


# The answers a fifth review wrote and graded (its section 4)


def copy_forgets_the_partial_chunk(nbytes, pinned, link_GBps, stage_GBps, chunk_bytes=2 << 20):  # W17
    link, stage = link_GBps * 1e9, stage_GBps * 1e9
    if pinned:
        return nbytes / link
    staged = sent = 0.0
    free = [0.0, 0.0]
    for index in range(nbytes // chunk_bytes):  # whole chunks only
        staged = max(staged, free[index % 2]) + chunk_bytes / stage
        sent = max(sent, staged) + chunk_bytes / link
        free[index % 2] = sent
    return sent


MISTAKES = [
    ("h2d_copy_time", copy_pageable_at_link_rate, "pageable_as_pinned", "from pageable memory: got"),
    ("h2d_copy_time", copy_stage_then_send, "stage_then_send", "5 MiB from pageable memory"),
    ("h2d_copy_time", copy_at_the_slower_rate, "no_pipeline_fill", "64 KiB from pageable memory: got 0.0131072"),
    ("h2d_copy_time", copy_in_gibibytes, "gibibytes", "64 KiB from pinned memory"),
    ("d2h_read_hazard", read_safe_once_non_blocking_is_off, "pageable_async", "pageable memory, non_blocking=True"),
    ("d2h_read_hazard", read_safe_after_any_wait, "event_before_copy", "wait='event_before_copy'"),
    ("d2h_read_hazard", read_always_safe, "pinned_non_blocking_safe", "seeing 'initial'"),
    ("d2h_read_hazard", read_pageable_is_the_risky_one, "blocking_stale", "pageable memory, non_blocking=False"),
    ("h2d_copy_time", copy_forgets_the_partial_chunk, "partial_chunk", "64 KiB from pageable memory: got 0 ms"),
]
