"""The copy model checked on copies it was not fitted to: each size of a GPU transfer result predicted from inputs
found on the other sizes only (distlab.predict.stream_results.leave_one_out_inputs), as the pinned-memory chapter
shows it next to the in-sample fit."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from distlab.predict import stream_results
from support import committed_h200_copies_and_host

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]


def _moved(record: dict, size: int) -> dict:
    """``record`` with everything measured at ``size`` changed: every copy three times slower, the clone ten."""
    out = copy.deepcopy(record)
    measured = out["metrics"]["ranks"][0]
    for row in measured["bandwidth"]:
        if row["bytes"] == size:
            row.update(time_s=3 * row["time_s"], host_blocked_s=3 * row["host_blocked_s"], GBps=row["GBps"] / 3)
    for row in measured["pinning_cost"]:
        if row["bytes"] == size:
            row["pageable_clone_s"] *= 10
    return out


def _predicted(rows: list[dict], key: str) -> dict:
    return {(r["bytes"], r["mode"]): r[f"{key}_GBps"] for r in rows}


def test_a_size_left_out_is_predicted_without_any_of_its_own_measurements():
    """Change everything measured at one size: its held-out predictions must not move (a point in its own fit would
    move them), while the in-sample fit of the extreme sizes, whose copies set the inputs, does."""
    record, host = committed_h200_copies_and_host()
    rows = stream_results.bandwidth_table(record, host=host)
    sizes = sorted({r["bytes"] for r in rows})
    assert len(sizes) >= 5 and all("held_out_GBps" in r for r in rows)
    for size in sizes:
        moved = stream_results.bandwidth_table(_moved(record, size), host=host)
        mine = [(size, r["mode"]) for r in rows if r["bytes"] == size]
        held, held_moved = _predicted(rows, "held_out"), _predicted(moved, "held_out")
        assert [held_moved[p] for p in mine] == [held[p] for p in mine], size
        fit, fit_moved = _predicted(rows, "after"), _predicted(moved, "after")
        if size in (sizes[0], 16 * MiB, sizes[-1]):  # the call and latency; the cache threshold; the link rate
            assert any(fit_moved[p] != pytest.approx(fit[p], rel=1e-3) for p in mine), size


def test_without_size_takes_out_every_measurement_of_that_size_and_nothing_else():
    record, _ = committed_h200_copies_and_host()
    measured = record["metrics"]["ranks"][0]
    left = stream_results.without_size(record, 16 * MiB)["metrics"]["ranks"][0]
    assert {r["bytes"] for r in left["bandwidth"]} == {r["bytes"] for r in measured["bandwidth"]} - {16 * MiB}
    assert len(left["bandwidth"]) == len(measured["bandwidth"]) - 8  # two directions, four modes
    assert {r["bytes"] for r in left["pinning_cost"]} == {r["bytes"] for r in measured["pinning_cost"]} - {16 * MiB}
    assert len(measured["bandwidth"]) == 56  # the record itself is untouched


def test_the_h200_copies_left_out_miss_by_more_than_the_fit_and_the_chapter_says_so():
    """The H200 run's figures as the chapter prints them, through stream_results.error_claims (the page's cell calls
    it and prints its numbers and its explanation): the fit (in-sample) and each size left out."""
    record, host = committed_h200_copies_and_host()
    claims = stream_results.error_claims(record, host=host)
    fit, held = claims["fit"], claims["held_out"]
    assert fit["rows"] == held["rows"] == 20
    assert fit["mean_abs"] == pytest.approx(0.048, abs=0.005) and fit["max_abs"] == pytest.approx(0.17, abs=0.01)
    assert held["mean_abs"] == pytest.approx(0.097, abs=0.005) and held["max_abs"] == pytest.approx(0.40, abs=0.01)
    worst = held["worst"]
    assert (worst["bytes"], worst["mode"]) == (16 * MiB, "pageable+non_blocking")
    assert worst["held_out_error"] == pytest.approx(-0.40, abs=0.01)  # predicted too slow: staged at the DRAM rate
    assert claims["small_fit"]["rows"] == claims["small_held_out"]["rows"] == 8
    assert claims["small_fit"]["max_abs"] == pytest.approx(0.52, abs=0.01)
    assert claims["small_held_out"]["max_abs"] == pytest.approx(0.69, abs=0.01)
    # left out, the 16 MiB clone no longer marks 16 MiB as cached: the threshold falls to 4 MiB, and the page says so
    assert claims["cache_bytes"] == {"fit": 16 * MiB, "held_out": 4 * MiB}
    assert stream_results.leave_one_out_inputs(record, 16 * MiB, host=host).cache_bytes == 4 * MiB
    assert "the threshold falls to 4 MiB" in claims["why"]
    table = stream_results.markdown_table(claims["rows"])
    assert "size left out of the fit" in table and "| 16 MiB | pageable+non_blocking | 11.35 |" in table
    page = " ".join((ROOT / "book" / "pinned_memory.md").read_text().split())
    assert "found on, and so far checked only against, this one run" in page and "**fit**" in page
