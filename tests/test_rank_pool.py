"""The session rank pool (distlab.testing.RankPool): many calls on ranks started once, each rank's value back, and a
call that fails on any rank ends the pool, in words, so that the next call starts a fresh one."""

from __future__ import annotations

import os
import random
import time

import pytest
import torch
import torch.distributed as dist

from distlab.testing import RankFailed, RankPool, call_seed


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


def raise_then_collective(runtime):
    """The usual way a distributed test fails: one rank's check raises while its peer goes on to a collective."""
    if runtime.rank == 1:
        raise ValueError("rank 1's own assertion")
    dist.all_reduce(torch.ones(1))
    return "never"


def process_state(runtime):
    return {
        "environment": dict(os.environ),
        "cwd": os.getcwd(),
        "grad enabled": torch.is_grad_enabled(),
        "threads": torch.get_num_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "random.getstate()": random.getstate(),
    }


def changes_process_state(runtime, folder):
    os.environ["LEFT_BY_A_TEST"] = "1"
    os.environ.pop("WORLD_SIZE")
    os.chdir(folder)
    torch.set_grad_enabled(False)
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    random.seed(1234)
    return "changed"


def patches_a_library_module(runtime):
    from distlab.bench import sweep

    sweep.available_bytes = lambda: 42


def patches_a_library_module_and_undoes_it(runtime):
    from distlab.bench import sweep

    original, sweep.available_bytes = sweep.available_bytes, lambda: 42
    sweep.available_bytes = original
    return "undone"


def makes_a_group(runtime):
    dist.new_group([0, 1])


class _Link:
    pass


def collects_its_own_cycle(runtime):
    """What a collection in this rank walks (the objects not frozen), what it leaves (the frozen ones), and
    whether it still frees a cycle the rank made, as the group's teardown must free a model's."""
    import gc
    import weakref

    first, second = _Link(), _Link()
    first.other, second.other = second, first
    freed = weakref.ref(first)
    del first, second
    gc.collect()
    return len(gc.get_objects()), gc.get_freeze_count(), freed() is None


def draws(runtime):
    return torch.rand(1).item(), random.random()


def test_a_pool_runs_many_calls_on_the_same_ranks_and_returns_each_ranks_value(ranks2, ranks3):
    first = ranks2.run(summed_rank, 1)
    assert [row[:3] for row in first] == [(0, 2, 3.0), (1, 2, 3.0)]
    again = ranks2.run(summed_rank, 0)
    assert [row[3] for row in again] == [row[3] for row in first], "the same processes answer every call"
    assert [row[:3] for row in ranks3.run(summed_rank, 0)] == [(r, 3, 3.0) for r in range(3)]


def test_the_librarys_distributed_finds_the_pools_group_and_leaves_it(ranks2):
    assert ranks2.run(library_group) == [((0, 2), True), ((1, 2), True)]
    assert ranks2.run(summed_rank, 0)[0][2] == 1.0  # the group still works after


def test_a_ranks_collection_walks_what_the_rank_made_not_the_servers_imports(ranks2):
    # each rank's teardown collects (runtime._release_group): over torch's ~320,000 imported objects that was
    # 0.3 s a rank, half of a graded check; frozen at the fork, they are skipped and the rank's own cycles freed
    for walked, frozen, freed in ranks2.run(collects_its_own_cycle):
        assert frozen > max(100_000, walked), (walked, frozen)  # the pool's earlier calls made some of their own
        assert freed


def test_a_call_starts_as_a_fresh_rank_would_float32_by_default(ranks2):
    assert ranks2.run(changes_the_default_dtype) == [torch.float64] * 2
    assert ranks2.run(default_dtype) == [torch.float32] * 2


def test_an_exception_on_one_rank_is_raised_with_its_words_and_the_next_call_starts_a_fresh_pool():
    with RankPool(2, timeout_s=30) as pool:
        before = {row[3] for row in pool.run(summed_rank, 0)}
        with pytest.raises(
            RankFailed, match=r"(?s)raises_on_rank_1 failed \(call 2: .*\):\nrank 1: .*ValueError: rank 1 refuses"
        ):
            pool.run(raises_on_rank_1)
        after = {row[3] for row in pool.run(summed_rank, 0)}
        assert not before & after, "a fresh pool: new processes"


def test_a_call_that_hangs_ends_within_the_pools_time_and_says_which_rank():
    with RankPool(2, timeout_s=3) as pool:
        pool.run(summed_rank, 0)  # started: the time bounds the call, not the start
        started = time.monotonic()
        with pytest.raises(RankFailed, match="rank 0: gave no answer within 3 s"):
            pool.run(waits_for_a_peer_that_never_sends)
        assert time.monotonic() - started < 20


def test_a_rank_that_dies_ends_the_call_in_one_line():
    with RankPool(2, timeout_s=30) as pool:
        with pytest.raises(RankFailed, match=r"rank 1: ended \(exit code 3\)"):
            pool.run(dies_on_rank_1)


def test_a_rank_that_raises_while_its_peer_is_in_a_collective_is_named_at_once_with_its_words():
    """B1: the pool read the ranks in order and waited on rank 0, stuck in a collective for rank 1, until the
    call's timeout; then it named rank 0 and dropped rank 1's exception. It now waits on every rank at once."""
    timeout_s = 60
    with RankPool(2, timeout_s=timeout_s) as pool:
        pool.run(summed_rank, 0)  # started: the bound is on the call, not the start
        started = time.monotonic()
        with pytest.raises(RankFailed) as failed:
            pool.run(raise_then_collective)
        took = time.monotonic() - started
    words = str(failed.value)
    assert "rank 1: Traceback" in words and "ValueError: rank 1's own assertion" in words, words
    assert "rank 0: still in the call (waiting for a peer?)" in words, words
    assert f"seed {call_seed(2, 0)} + rank" in words, words
    assert took < timeout_s / 3, f"the call failed only after {took:.0f} s, near the pool's {timeout_s} s timeout"


def test_a_call_finds_the_process_as_a_fresh_rank_would_whatever_the_last_call_changed(ranks2, tmp_path):
    """B2: the environment, the working directory, grad mode, threads, the deterministic flag and Python's
    random state a call changes are put back after it (the seeds aside, which every call sets)."""
    before = ranks2.run(process_state)
    assert ranks2.run(changes_process_state, tmp_path) == ["changed"] * 2
    after = ranks2.run(process_state)
    for rank, (was, now) in enumerate(zip(before, after)):
        was.pop("random.getstate()"), now.pop("random.getstate()")  # each call seeds it: compared below
        assert now == was, f"rank {rank}"
    assert ranks2.run(draws) != ranks2.run(draws)


def test_python_random_is_put_back_after_a_call():
    """B2: the generator's state is restored, not only reseeded (a call's state is the same whatever ran before)."""
    from distlab.testing import _process_state, _restore

    state = _process_state()
    expected = random.random()
    random.setstate(state[-1])
    random.seed(1234)
    _restore(state)
    assert random.random() == expected


def test_a_call_that_leaves_what_cannot_be_undone_fails_in_words():
    """B2: a patched library module or a new process group would reach every later call: the pool refuses the
    call that leaves one (and a patch undone before the call returns is fine)."""
    with RankPool(2, timeout_s=30) as pool:
        assert pool.run(patches_a_library_module_and_undoes_it) == ["undone"] * 2
        with pytest.raises(RankFailed, match=r"distlab\.bench\.sweep\.available_bytes rebound.*use run_ranks"):
            pool.run(patches_a_library_module)
        with pytest.raises(RankFailed, match=r"makes_a_group left behind what the pool cannot undo \(1 new process"):
            pool.run(makes_a_group)


def test_each_call_is_seeded_by_its_number_and_rank(ranks2):
    """B3: a call drew from a generator seeded afresh (torch.seed()), so a failure that depended on a draw did not
    happen again; and nothing held that a call was seeded at all."""
    for _ in range(2):
        drawn = ranks2.run(draws)
        for rank, (torch_draw, python_draw) in enumerate(drawn):
            seed = call_seed(ranks2.calls, rank)
            assert torch_draw == torch.rand(1, generator=torch.Generator().manual_seed(seed)).item(), rank
            assert python_draw == random.Random(seed).random(), rank
        assert drawn[0] != drawn[1], "each rank its own seed"
