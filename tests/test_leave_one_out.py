"""A model is checked only on points it was not fitted to: the cost model's leave-one-out
(``costmodel.leave_one_out``), what a GPU report's summary and the pages show of it, and each GPU row's regime.

The one-rank strategy law (fitted per strategy on the H200 run's three presets) and the CPU sweeps' cost model (the
compute fit over a run's presets, the law over the one-rank sweep's) predict each point with that point left out of
every fit: a point's own measurements must not move its prediction, and the other points' must."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from distlab.gpu_report import schema, summary
from distlab.predict import costmodel
from distlab.results import committed_results, read_result

ROOT = Path(__file__).resolve().parents[1]
FIRST_H200 = committed_results("gpu", "nvidia-h200-1x-20261127-055504")
QUICK_H200 = committed_results("gpu", "nvidia-h200-1x-20261128-174427")


def _cpu(n: int) -> dict:
    return read_result(committed_results("sweep", f"sweep-{n}xcpu.json"))


def _scaled(record: dict, key: tuple[str, int], factor: float) -> dict:
    """The record with one point's every time (its bare step, its parts, each strategy's step) scaled."""
    record = copy.deepcopy(record)
    for preset in record["metrics"]["presets"]:
        if costmodel.point_key(preset) == key:
            for part in ("time_s", "compute_s", "optimizer_s"):
                preset["local"][part] *= factor
            for row in preset["variants"]:
                row["time_s"] *= factor
    return record


def _reports() -> tuple[dict, dict]:
    """The two committed H200 reports, as the book reads them (the first with its provenance)."""
    reports = {r["folder"].name: r for r in schema.read_reports(committed_results("gpu"))}
    return reports[FIRST_H200.name], reports[QUICK_H200.name]


def _predictions(rows: list[dict]) -> dict:
    return {(r["model"], r["tokens_per_rank"], r["variant"]): r["predicted_s"] for r in rows}


@pytest.mark.parametrize("source", ["first H200 run", "CPU, 1 rank", "CPU, 2 ranks"])
def test_a_point_left_out_is_in_none_of_its_own_fits(source):
    """Scaling one point's measurements tenfold leaves its own prediction exactly where it was, and moves every
    other point's: were the point in its own fit (the compute fit, or the strategy law, here or in the one-rank run),
    its prediction would move with it."""
    if source == "first H200 run":
        record, one_rank = read_result(FIRST_H200 / "sweep.json"), None  # its own one-rank run
    else:
        record, one_rank = _cpu(int(source[5])), _cpu(1)
    before = _predictions(costmodel.leave_one_out(record, one_rank))
    assert len(before) == 18
    for key in [costmodel.point_key(p) for p in costmodel.calibrated(record["metrics"]["presets"])]:
        # the point scaled wherever it was measured: in the record, and in the one-rank run the law comes from
        scaled = _scaled(record, key, 10.0)
        scaled_one = None if one_rank is None else _scaled(one_rank, key, 10.0)
        after = _predictions(costmodel.leave_one_out(scaled, scaled_one))
        mine = {k for k in before if k[:2] == key}
        assert len(mine) == 6 and all(after[k] == pytest.approx(before[k], rel=1e-12) for k in mine), key
        assert all(after[k] != pytest.approx(before[k], rel=1e-3) for k in before if k not in mine), key


def test_the_in_sample_fit_is_not_the_test():
    """The fit of every point (one_rank_calibration's "after", what the pages once called a test of the model's form)
    moves with each point's own measurements; left out, the errors are wider. On the first H200 run: within 13 % fitted,
    up to 25 % left out."""
    record = read_result(FIRST_H200 / "sweep.json")
    fitted = [r["after_error"] for r in costmodel.one_rank_calibration(record)]
    tested = [r["time_error"] for r in costmodel.leave_one_out(record)]
    assert max(map(abs, fitted)) < 0.15 < max(map(abs, tested)) < 0.3
    key = ("gpt-small", 2048)
    moved = costmodel.one_rank_calibration(_scaled(record, key, 10.0))
    pairs = zip(moved, costmodel.one_rank_calibration(record))
    mine = [(a, b) for a, b in pairs if (a["model"], a["tokens_per_rank"]) == key]
    same = [a for a, b in mine if a["after_s"] == pytest.approx(b["after_s"])]
    assert len(mine) == 6 and not same  # in its own fit: its prediction follows its measurement


def test_too_few_points_leave_nothing_to_leave_out():
    """Two calibrated points (the quick report's two gpt-mini sizes) cannot fix two rates from one: no left-out
    prediction rather than a line through a single point."""
    quick = read_result(QUICK_H200 / "sweep.json")
    assert len(costmodel.calibrated(quick["metrics"]["presets"])) == 2 == costmodel.LEAVE_ONE_OUT_MINIMUM - 1
    assert costmodel.leave_one_out(quick) == []


def test_a_reports_summary_and_table_show_the_left_out_model_and_call_the_fit_a_fit():
    first, quick = _reports()
    rows = summary.of_report(first)["sweep"]
    tested = _predictions(costmodel.leave_one_out(read_result(FIRST_H200 / "sweep.json")))
    for row in rows:
        assert row["left_out_s"] == pytest.approx(tested[row["model"], row["tokens_per_rank"], row["variant"]])
        assert row["calibrated_points"] == 3
    page = schema.report_markdown(first | {"summary": {"sweep": rows}})
    assert "cost model ms, this point left out of its fit (error)" in page
    assert "fit ms, every point of the run in it, this one too (error)" in page
    assert "with each point left out of its own fit: from -25 % to +19 %, median |error| 6 %, over 18 points" in page
    assert "its own calibration" not in page and "tests the model's form" not in page
    quick_rows = summary.of_report(quick)["sweep"]
    assert all(r["left_out_s"] is None and r["calibrated_points"] == 2 for r in quick_rows)
    page = schema.report_markdown(quick | {"summary": {"sweep": quick_rows}})
    assert page.count("2 calibrated points: too few to leave one out") == len(quick_rows)
    assert "too few calibrated points to leave one out" in page


def test_every_h200_row_says_its_ranks_and_regime():
    """One rank sends nothing, and says so in each row; a launch-bound row says it measures the host; the first
    report's CUDA peaks are the whole process's; the quick report is called one."""
    first, quick = _reports()
    first |= {"summary": summary.of_report(first)}
    page = schema.report_markdown(first)
    rows = [line for line in page.splitlines() if line.startswith("| gpt-")]
    assert len(rows) == 18
    assert all("| 1 (nothing sent) |" in r and "(launch-bound: measures the host)" in r for r in rows)
    assert all(r.count("(whole process)") == 2 for r in rows) and "are the whole process's" in page
    assert "One rank: nothing is sent between ranks" in page
    quick |= {"summary": summary.of_report(quick)}
    page = schema.report_markdown(quick)
    assert page.startswith("**Measured on 1 x NVIDIA H200** (2026-11-28, quick report)")
    rows = {line.split(" | ")[1]: line for line in page.splitlines() if line.startswith("| gpt-mini, 260,096")}
    assert set(rows) == {"ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp-no-reshard"}
    assert "launch-bound" not in rows["ddp"] and "the host may show" in rows["fsdp"]  # predicted 2.0x, under 3
    assert "whole process" not in page  # each strategy's CUDA peak with that strategy alone
    assert page.count("(launch-bound: measures the host)") == 6  # the 8 x 256 point


def test_the_first_reports_provenance_says_its_summary_and_picture_are_stale_and_the_book_recomputes():
    says = _reports()[0]["provenance"]["says"]
    assert "as the code wrote them on 2026-11-27, and is stale" in says
    assert "The book recomputes every table and figure from the result files" in says
    assert "CUDA peaks are the whole process's" in says
    readme = (QUICK_H200 / "README.md").read_text()
    assert "one rank" in readme and "a fit (both\npoints in it)" in readme and "74d198f" in readme
    assert schema.problems(QUICK_H200) == [] and schema.is_quick(schema.check(QUICK_H200))


def test_the_pages_show_the_left_out_errors_and_no_bare_h200_step():
    """The DDP-vs-FSDP page checks its model on points left out of its fits and recomputes every GPU report; its H200
    lines carry their ranks and compute ratio; the GPU page gives the GPU tier the time it measured."""
    page = (ROOT / "book" / "ddp_vs_fsdp.md").read_text()
    assert "costmodel.leave_one_out(SWEEP[n], SWEEP[1])" in page and "LEFT OUT" in page and "FITTED" in page
    assert "summary.of_report(report)" in page and 'report["summary"]' not in page
    assert "nothing sent between ranks" in page and "compute / fixed costs" in page
    assert "three GPU systems" not in page and "five GPU systems" in page
    results = (ROOT / "book" / "gpu_results.md").read_text()
    assert "a few minutes on one GPU" not in results and "tests/gpu-runs" in results
    assert "(each strategy measured alone)" not in results and "whole process" in results
    assert "tests the model's form" not in results and "**left out**" in results
    assert "about a millisecond per collective call whatever it sends" not in results
    assert "one H200 host with one rank (nothing sent)" in results
