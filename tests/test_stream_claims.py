"""The pinned-memory chapter's verdicts, decided in the library and printed by the page: where "10-20 % faster
training" holds on the model's curves (stream_scenarios.claim_range), whether a host stages fast enough for
"10-15 % faster data transfer" (stream_scenarios.staging_claim), and what the page says of the copy model's errors
on a GPU run, with the explanation it gives only where the data show it (stream_results.error_claims). Each is
checked on small hand-made inputs, every branch reached, and on the committed results the page reads."""

from __future__ import annotations

import copy

import pytest

from distlab.predict import stream_results, stream_scenarios, streams
from support import committed_h200_copies_and_host

MiB = 1 << 20


# -- "10-20 % faster training": claim_range ---------------------------------------------------------------------


def test_a_claim_holds_only_where_the_curve_is_inside_its_band():
    """A curve that rises through 1.10-1.20 between x = 1 and x = 3 holds the claim there and nowhere else."""
    xs, ys = [0.5, 1.0, 2.0, 3.0, 4.0], [1.0, 1.1, 1.15, 1.2, 1.3]
    claim = stream_scenarios.claim_range(xs, ys)
    assert claim.ranges == ((1.0, 3.0),) and claim.best == 1.3
    assert claim.verdict() == "holds when one batch's copy takes **1 to 3 times** the step's compute"


def test_a_claim_that_holds_nowhere_says_the_largest_gain_instead():
    claim = stream_scenarios.claim_range([0.1, 1.0, 10.0], [1.0, 1.04, 1.06])
    assert claim.ranges == () and claim.best == 1.06
    assert claim.verdict() == "holds for no copy/compute ratio here: the largest predicted gain is 6 %"


def test_a_curve_that_passes_the_band_twice_holds_the_claim_in_two_ranges():
    claim = stream_scenarios.claim_range([1, 2, 3, 4, 5], [1.0, 1.2, 1.4, 1.2, 1.0], low=1.1, high=1.3)
    assert [pytest.approx(span) for span in claim.ranges] == [(1.5, 2.5), (3.5, 4.5)]
    assert "**1.5 to 2.5 and 3.5 to 4.5 times**" in claim.verdict()


# -- "10-15 % faster data transfer": staging_claim --------------------------------------------------------------


@pytest.mark.parametrize(
    ("stage_GBps", "verdict", "words"),
    [
        (14.0, "within", "within that range."),  # 15.75 / 14.0 = 1.125
        (20.0, "faster", "faster, so the gain is smaller."),  # staging outruns the link: pinning saves little
        (5.0, "slower", "slower, so the gain is larger."),  # 15.75 / 5 = 3.15
    ],
)
def test_a_hosts_staging_rate_is_within_faster_or_slower_than_the_claim_needs(stage_GBps, verdict, words):
    claim = stream_scenarios.staging_claim(stage_GBps, 15.75)
    assert claim.needed_GBps == pytest.approx((15.75 / 1.15, 15.75 / 1.10))
    assert (claim.verdict, claim.words()) == (verdict, words)


def test_the_staging_verdict_agrees_with_the_models_own_gain_on_one_large_copy():
    """The rule is the model's: a large pinned copy gains link / staging where staging is slower. A host within
    the range gains 10-15 % on a 1 GiB copy (a 2 MiB chunk fills the pipeline), a slower one more, a faster one less."""
    gains = {}
    for stage in (5.0, 14.0, 20.0):
        inputs = streams.Inputs(link_GBps=15.75, stage_GBps=stage)
        gains[stream_scenarios.staging_claim(stage, 15.75).verdict] = stream_scenarios.transfer_speedup(inputs, 1 << 30)
    assert gains["slower"] > 1.15 and 1.10 <= gains["within"] <= 1.15 and gains["faster"] < 1.10


def test_the_pages_claims_on_a_committed_hosts_staging_rate():
    """The committed H200 host's staging rate (11.9 GB/s), with the T4 link the page cites (15.75 GB/s): the page's
    curves and verdicts. Staging is the slower, so pinning gains up to link / staging (1.33x), more than 10-15 %."""
    host = committed_h200_copies_and_host()[1]
    link = streams.pcie_GBps(3, 16)
    inputs = stream_results.inputs_from_host_result(host, link, "cited")
    ratios = [round(10 ** (k / 8), 4) for k in range(-16, 9)]
    curves = stream_scenarios.speedup_curve(inputs, ratios, batch_bytes=64 * MiB)
    pinned = stream_scenarios.claim_range(ratios, curves["pinned + non_blocking"])
    side = stream_scenarios.claim_range(ratios, curves["pinned + non_blocking + side stream"])
    assert stream_scenarios.staging_claim(inputs.stage_GBps, link).verdict == "slower"
    assert 1.20 < pinned.best <= link / inputs.stage_GBps  # pinning saves at most the staging
    ((start, end),) = pinned.ranges
    assert start == pytest.approx(0.49, abs=0.01) and end == pytest.approx(1.9, abs=0.02)
    assert "**0.49 to 1.9 times**" in pinned.verdict()
    assert side.ranges and side.best > 2  # a side stream also hides the copy: it passes through the band early


# -- the errors of the copy model on a GPU run: error_claims ----------------------------------------------------


SIZES = (1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB)
HOST = {"metrics": {"staging_copy": [{"bytes": 64 * MiB, "chunk_bytes": 2 * MiB, "GBps": 10.0}],
                    "memory_copy": {"bytes": 64 * MiB, "GBps": 5.0}}}  # fmt: skip


def _made_run(off_at: int, *, clones: bool = True) -> dict:
    """A transfer result the model itself wrote (link 20 GB/s, one host's staging rates, sources of 16 MiB and
    less kept in the caches by their clone() timing), with the pageable non_blocking copy of ``off_at`` bytes
    measured three times slower than predicted: the worst copy, whichever way it is predicted."""
    truth = streams.Inputs(link_GBps=20.0, stage_GBps=10.0, api_s=5e-6, stage_dram_GBps=5.0, cache_bytes=16 * MiB)
    rows = stream_scenarios.predicted_bandwidth(truth, SIZES)
    for row in rows:
        if (row["bytes"], row["mode"]) == (off_at, "pageable+non_blocking"):
            row.update(time_s=3 * row["time_s"], GBps=row["GBps"] / 3)
    cost = [{"bytes": n, "pageable_clone_s": n / (20e9 if n <= 16 * MiB else 5e9)} for n in SIZES]
    return {"metrics": {"ranks": [{"bandwidth": rows, "pinning_cost": cost if clones else []}]}}


def test_the_worst_copy_left_out_is_explained_where_its_own_clone_set_the_cache_threshold():
    """16 MiB is the largest size whose clone() ran fast: left out, the threshold falls to 4 MiB and the model stages
    a 16 MiB source at the DRAM rate. That is what the page then says."""
    claims = stream_results.error_claims(_made_run(16 * MiB), host=HOST)
    assert (claims["held_out"]["worst"]["bytes"], claims["held_out"]["worst"]["mode"]) == (
        16 * MiB,
        "pageable+non_blocking",
    )
    assert claims["cache_bytes"] == {"fit": 16 * MiB, "held_out": 4 * MiB}
    assert claims["why"].startswith("Left out, the 16 MiB `clone()` no longer marks a 16 MiB source")
    assert "the threshold falls to 4 MiB" in claims["why"]


def test_no_explanation_where_leaving_the_worst_size_out_leaves_the_threshold_alone():
    """The worst copy at 4 MiB: without it the threshold is still 16 MiB, so the cache says nothing about its miss."""
    claims = stream_results.error_claims(_made_run(4 * MiB), host=HOST)
    assert claims["held_out"]["worst"]["bytes"] == 4 * MiB
    assert claims["cache_bytes"] == {"fit": 16 * MiB, "held_out": 16 * MiB} and claims["why"] == ""


def test_no_explanation_and_no_threshold_without_clone_timings():
    claims = stream_results.error_claims(_made_run(16 * MiB, clones=False), host=HOST)
    assert claims["cache_bytes"] == {"fit": None, "held_out": None} and claims["why"] == ""


def test_the_errors_split_at_a_mebibyte_and_count_only_what_was_predicted():
    """Copies of 1 MiB and more in ``fit`` and ``held_out``, smaller ones in ``small_*``; no host, no claims."""
    run = _made_run(16 * MiB)
    run["metrics"]["ranks"][0]["bandwidth"] += [
        dict(row, bytes=256 << 10)
        for row in stream_scenarios.predicted_bandwidth(streams.Inputs(20.0, 10.0), [256 << 10])
    ]
    claims = stream_results.error_claims(run, host=HOST)
    assert claims["fit"]["rows"] == claims["held_out"]["rows"] == 4 * len(SIZES)
    assert claims["small_fit"]["rows"] == claims["small_held_out"]["rows"] == 4
    assert claims["held_out"]["max_abs"] == pytest.approx(abs(claims["held_out"]["worst"]["held_out_error"]))
    assert stream_results.error_claims(copy.deepcopy(run), host=None) is None  # no staging rate: nothing to predict
