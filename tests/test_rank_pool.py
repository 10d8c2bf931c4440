"""The session rank pool (distlab.jobs.RankPool): many calls on ranks started once, each rank's value back, and a
call that fails on any rank ends the pool, in words, so that the next call starts a fresh one."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from distlab.jobs import RankFailed, RankPool


def summed_rank(runtime, offset: int):
    value = torch.tensor([float(runtime.rank + offset)])
    dist.all_reduce(value)
    return runtime.rank, runtime.world_size, value.item(), os.getpid()


def library_group(runtime):
    """What the library's own ``distributed()`` finds inside a call: the pool's group, left alone when it ends."""
    from distlab.runtime import distributed

    with distributed("cpu") as inner:
        seen = (inner.rank, inner.world_size)
    return seen, dist.is_initialized()


def changes_the_default_dtype(runtime):
    torch.set_default_dtype(torch.float64)
    return torch.get_default_dtype()


def default_dtype(runtime):
    return torch.get_default_dtype()


def raises_on_rank_1(runtime):
    if runtime.rank == 1:
        raise ValueError("rank 1 refuses")
    return "fine"


def waits_for_a_peer_that_never_sends(runtime):
    if runtime.rank == 0:
        dist.recv(torch.zeros(1), src=1)
    return "never"


def dies_on_rank_1(runtime):
    if runtime.rank == 1:
        os._exit(3)
    return "alive"


def test_a_pool_runs_many_calls_on_the_same_ranks_and_returns_each_ranks_value(ranks2, ranks3):
    first = ranks2.run(summed_rank, 1)
    assert [row[:3] for row in first] == [(0, 2, 3.0), (1, 2, 3.0)]
    again = ranks2.run(summed_rank, 0)
    assert [row[3] for row in again] == [row[3] for row in first], "the same processes answer every call"
    assert [row[:3] for row in ranks3.run(summed_rank, 0)] == [(r, 3, 3.0) for r in range(3)]


def test_the_librarys_distributed_finds_the_pools_group_and_leaves_it(ranks2):
    assert ranks2.run(library_group) == [((0, 2), True), ((1, 2), True)]
    assert ranks2.run(summed_rank, 0)[0][2] == 1.0  # the group still works after


def test_a_call_starts_as_a_fresh_rank_would_float32_by_default(ranks2):
    assert ranks2.run(changes_the_default_dtype) == [torch.float64] * 2
    assert ranks2.run(default_dtype) == [torch.float32] * 2


def test_an_exception_on_one_rank_is_raised_with_its_words_and_the_next_call_starts_a_fresh_pool():
    with RankPool(2, timeout_s=30) as pool:
        before = {row[3] for row in pool.run(summed_rank, 0)}
        with pytest.raises(RankFailed, match=r"(?s)raised on 1 of 2 ranks:\nrank 1: .*ValueError: rank 1 refuses"):
            pool.run(raises_on_rank_1)
        after = {row[3] for row in pool.run(summed_rank, 0)}
        assert not before & after, "a fresh pool: new processes"


def test_a_call_that_hangs_ends_within_the_pools_time_and_says_which_rank():
    with RankPool(2, timeout_s=3) as pool:
        pool.run(summed_rank, 0)  # started: the time bounds the call, not the start
        started = time.monotonic()
        with pytest.raises(RankFailed, match="rank 0 gave no answer within 3 s"):
            pool.run(waits_for_a_peer_that_never_sends)
        assert time.monotonic() - started < 20


def test_a_rank_that_dies_ends_the_call_in_one_line():
    with RankPool(2, timeout_s=30) as pool:
        with pytest.raises(RankFailed, match=r"rank 1 ended \(exit code 3\)"):
            pool.run(dies_on_rank_1)
