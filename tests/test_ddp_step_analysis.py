"""The DDP chapter's measured claims, decided by distlab.bench.ddp_step's analysis functions (review 5's B11).

The page prints what these functions return; its prose says what the committed runs under book/results/ddp show:
the bucketed variants within torch DDP's spread and the naive one apart from it on ResNet-18, the first
all-reduce starting during backward, and some of the all-reduce time running on after backward has ended.
"""

from pathlib import Path

import pytest

from distlab.bench.ddp_step import (
    communication_after_backward,
    compare_with_torch_ddp,
    merged_intervals,
    within_spread,
)
from distlab.results import read_result

RESULTS = Path(__file__).resolve().parents[1] / "book" / "results" / "ddp"


def _row(name: str, q1_ms: float, median_ms: float, q3_ms: float) -> dict:
    return {"variant": name, "time_q1_s": q1_ms / 1e3, "time_s": median_ms / 1e3, "time_q3_s": q3_ms / 1e3}


def test_within_spread_means_the_interquartile_ranges_overlap():
    reference = _row("torch DDP 25 MB", 10, 11, 12)
    assert within_spread(_row("a", 11, 12, 13), reference)  # overlapping on the right
    assert within_spread(_row("b", 8, 9, 10), reference)  # touching at 10
    assert within_spread(_row("c", 10.5, 11, 11.5), reference)  # inside
    assert not within_spread(_row("d", 12.5, 13, 14), reference)  # wholly above
    assert not within_spread(_row("e", 5, 6, 9.9), reference)  # wholly below


def test_the_table_marks_each_variant_against_torch_ddp_and_the_compute_floor():
    record = {
        "metrics": {
            "variants": [
                _row("local (no sync)", 4, 5, 6),
                _row("NaiveDDP", 14, 15, 16),
                _row("BucketedDDP 1 MB", 9, 10.5, 11),
                _row("torch DDP 25 MB", 9, 10, 12),
            ]
        }
    }
    table = {row["variant"]: row for row in compare_with_torch_ddp(record)}
    assert {name: row["verdict"] for name, row in table.items()} == {
        "local (no sync)": "apart",
        "NaiveDDP": "apart",
        "BucketedDDP 1 MB": "within",
        "torch DDP 25 MB": "reference",
    }
    assert table["NaiveDDP"]["exposed_ms"] == pytest.approx(10)
    assert table["NaiveDDP"]["ratio_to_torch_ddp"] == pytest.approx(1.5)


def test_overlapping_all_reduces_are_merged_before_they_are_added():
    assert merged_intervals([(9, 14), (3, 5), (4, 7), (7, 8)]) == [(3, 8), (9, 14)]


def _timeline_record() -> dict:
    """Forward 0-2 ms, backward 2-10 ms in two ops, three all-reduces (two overlapping), the last ending at 14."""
    intervals = [
        ("compute", "forward", 0, 2),
        ("compute", "ConvolutionBackward0", 2, 5),
        ("compute", "AddmmBackward0", 7, 3),
        ("communication", "gloo:all_reduce", 3, 2),
        ("communication", "gloo:all_reduce", 4, 3),
        ("communication", "gloo:all_reduce", 9, 5),
    ]
    return {
        "metrics": {
            "timeline": [{"lane": lane, "name": n, "start_ms": s, "dur_ms": d} for lane, n, s, d in intervals],
            "timeline_bucket_cap_mb": 5.0,
            "variants": [{"variant": "BucketedDDP 5 MB", "time_s": 0.007}],
        }
    }


def test_communication_after_backward_counts_only_the_tail_past_backward():
    found = communication_after_backward(_timeline_record())
    assert (found["backward_start_ms"], found["backward_end_ms"]) == (2, 10)
    assert found["first_all_reduce_ms"] == 3 and found["last_all_reduce_end_ms"] == 14
    assert found["all_reduce_ms"] == pytest.approx(4 + 5)  # [3, 7] and [9, 14], not 2 + 3 + 5
    assert found["after_backward_ms"] == pytest.approx(4)  # [10, 14]
    assert found["share_after"] == pytest.approx(4 / 9)
    assert found["step_ms"] == 14 and found["profiled_over_median"] == pytest.approx(2)


def test_a_timeline_without_all_reduces_says_so():
    record = _timeline_record()
    record["metrics"]["timeline"] = [i for i in record["metrics"]["timeline"] if i["lane"] == "compute"]
    with pytest.raises(ValueError, match="no all-reduce"):
        communication_after_backward(record)


def test_on_the_committed_resnet18_run_the_bucketed_variants_match_torch_ddp_and_the_naive_one_does_not():
    """ddp.md: "the naive version pays for its many small, late all-reduces, while the bucketed steps come close
    to torch DDP"."""
    record = read_result(RESULTS / "ddp-step-resnet18-2xcpu.json")
    table = {row["variant"]: row for row in compare_with_torch_ddp(record)}
    assert table["NaiveDDP"]["verdict"] == "apart"
    assert table["local (no sync)"]["verdict"] == "apart"
    bucketed = [row for name, row in table.items() if name.startswith("BucketedDDP")]
    assert bucketed and all(row["verdict"] == "within" for row in bucketed)


def test_on_the_committed_resnet18_timeline_the_all_reduces_start_in_backward_and_run_on_after_it():
    """ddp.md: the first bucket's all-reduce starts while backward runs; the overlap is partial (the all-reduces
    go on after backward has ended, and the step waits for them); the profiled step is longer than the median."""
    found = communication_after_backward(read_result(RESULTS / "ddp-step-resnet18-2xcpu.json"))
    assert found["backward_start_ms"] <= found["first_all_reduce_ms"] < found["backward_end_ms"]
    assert 0 < found["after_backward_ms"] < found["all_reduce_ms"]
    assert found["last_all_reduce_end_ms"] > found["backward_end_ms"]
    assert found["profiled_over_median"] > 1
