"""``python -m distlab.gpu_report``: run here on the CPU (what CI runs), its report checked, broken on purpose, and
shown by the book's page with none, one and several reports. Without a GPU every part that can runs on gloo
ranks, and what cannot is listed with its reason."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from distlab.gpu_report import run, schema
from distlab.gpu_report.run import Machine, Part, plan, sized_presets
from distlab.gpu_report.summary import system_for
from distlab.labs.launch import entry_config, takes_placement
from distlab.results import committed_results
from distlab.runtime import place

GIB = 2**30
T4_PAIR = Machine(2, int(14.75 * GIB), False, ["Tesla T4", "Tesla T4"])
ONE_H100 = Machine(1, 79 * GIB, True, ["NVIDIA H100 80GB HBM3"])


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpu-reports")
    command = [sys.executable, "-m", "distlab.gpu_report", "--out", str(out), "--quick", "--contributor", "CI"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "passed the book's check" in done.stdout and "book/results/gpu/" in done.stdout
    (folder,) = [p for p in out.iterdir() if p.is_dir()]
    return folder


@pytest.mark.slow
def test_the_cpu_run_is_a_valid_report_that_says_what_it_skipped(cpu_report):
    assert schema.problems(cpu_report) == []
    report = schema.check(cpu_report)
    assert report["status"] == "complete"
    status = {part["name"]: part["status"] for part in report["parts"]}
    assert status == {"host": "ran", "copies": "skipped", "collectives": "ran", "sweep": "ran",
                      "fsdp-options": "ran", "batch-norm": "ran"}  # fmt: skip
    assert "CUDA" in next(p["reason"] for p in report["parts"] if p["name"] == "copies")
    assert any("cuda_peaks" in item["what"] for item in report["not_run"])
    assert report["environment"]["device_kind"] == "cpu" and report["contributor"] == "CI"
    assert "no GPU" in schema.label(report)
    sweep = report["summary"]["sweep"]
    assert {row["variant"] for row in sweep} == {"ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp-no-reshard"}
    assert all(row["model_s"] > 0 and row["predicted_s"] is None for row in sweep)  # no GPU, no cited prediction
    options = {row["variant"] for row in report["summary"]["fsdp_options"]}
    assert {"prefetch_depth_2", "offload", "checkpointing"} <= options
    collectives = {row["collective"] for row in report["summary"]["collectives"]}
    assert collectives == {"all_reduce", "all_gather", "reduce_scatter"}
    assert "SyncBatchNorm" in report["summary"]["batch_norm"]
    assert set(report["pictures"]) == {"bandwidth.png", "sweep.png"}


def test_every_gpu_path_runs_here_on_gloo_except_what_needs_cuda_itself():
    """The GPU plan's entry points are the CPU plan's, but the host-to-device copies, which the CPU report lists."""
    on_gpus = {part.target for part in plan(T4_PAIR) if not part.skip}
    on_cpu = {part.target for part in plan(Machine(0)) if not part.skip}
    assert on_gpus - on_cpu == {"distlab.bench.transfer"}
    assert all(part.nproc == 2 for part in plan(Machine(0)) if not part.skip and part.target != "distlab.bench.host")
    assert all("bf16" in part.args for part in plan(Machine(0)) if part.name == "sweep")  # the GPU's autocast path


def test_a_t4_pair_runs_fp16_and_one_gpu_skips_what_needs_two_ranks():
    t4 = {part.name: part for part in plan(T4_PAIR)}
    assert "fp16" in t4["sweep"].args and "bf16" not in ",".join(t4["fsdp-options"].args)
    assert t4["collectives"].nproc == 2 and not t4["collectives"].skip
    one = {part.name: part for part in plan(ONE_H100)}
    assert "one GPU per rank" in one["collectives"].skip and "two ranks" in one["batch-norm"].skip
    assert one["sweep"].nproc == 1 and "bf16" in one["sweep"].args
    assert sized_presets(T4_PAIR) == ["gpt-mini"]  # gpt-small's six strategies and a batch: over 70 % of a T4
    assert sized_presets(ONE_H100) == ["gpt-mini", "gpt-small"]  # FSDP2's own point needs more than 70 % of 80 GB
    # the last, FSDP2's own point; gpt-medium's thirteen builds (4.6 billion values drawn) leave the sweep's time
    h200 = ["gpt-mini", "gpt-small", "gpt-2.7b"]
    assert sized_presets(Machine(1, 140 * GIB, True, ["NVIDIA H200"])) == h200


ONE_H200 = Machine(1, 140 * GIB, True, ["NVIDIA H200"])
EIGHT_H100 = Machine(8, 80 * GIB, True, ["NVIDIA H100 80GB HBM3"] * 8)


@pytest.mark.parametrize("machine", [Machine(0), ONE_H200, T4_PAIR, EIGHT_H100], ids=lambda m: f"{m.gpus}gpus")
def test_a_part_is_told_where_it_runs_only_if_its_entry_point_takes_it_and_as_place_decided(machine):
    """The GPU report's finding 2: the plan passed --device to distlab.bench.transfer (chosen by module name),
    whose parser refuses it, so the copies part failed on every GPU machine."""
    every, alone = place(gpus=machine.gpus), place(1, gpus=machine.gpus)
    for part in plan(machine):
        told = "--device" in part.args or "--backend" in part.args
        assert told == takes_placement(entry_config(part.target)), (part.name, part.args)
        where = alone if part.target in ("distlab.bench.host", "distlab.bench.transfer") else every
        assert part.nproc == where.ranks or part.skip, (part.name, part.nproc, where)
        if told:
            assert " ".join(where.args) in " ".join(part.args), (part.name, part.args, where)
    copies = next(part for part in plan(machine) if part.target == "distlab.bench.transfer")
    assert "--device" not in copies.args and bool(copies.skip) == (machine.gpus == 0)


RAISES = """import torch.distributed as dist
dist.init_process_group("gloo")
raise RuntimeError("the rank's own words")
"""


@pytest.mark.slow
def test_a_report_with_a_failed_part_exits_non_zero_says_why_and_is_written_marked_failed(
    tmp_path, monkeypatch, capsys
):
    """The GPU report's finding 3: with 3 of its 4 parts failed it said "it passed the book's check" and exited
    0, and each reason was torchrun's report, not the rank's error."""
    from distlab.gpu_report.__main__ import main

    script = tmp_path / "raises.py"
    script.write_text(RAISES)
    parts = [Part("boom", "a rank that raises", str(script), nproc=1), Part("later", "nothing", skip="not here")]
    monkeypatch.setattr(run, "plan", lambda machine, quick=False: parts)
    with pytest.raises(SystemExit) as exited:
        main(["--out", str(tmp_path / "reports"), "--budget-s", "300"])
    assert exited.value.code == 1
    said = capsys.readouterr().out
    assert "passed the book's check" not in said and "marked failed" in said
    assert "boom: torchrun" in said and "RuntimeError: the rank's own words" in said
    (folder,) = (tmp_path / "reports").iterdir()
    report = schema.check(folder, failed_ok=True)  # written, and valid but for what failed
    assert report["status"] == "failed"
    boom = report["parts"][0]
    assert boom["status"] == "failed" and "rank 0: RuntimeError: the rank's own words" in boom["reason"]
    assert "error_file" not in boom["reason"] and "To enable traceback" not in boom["reason"]
    assert any(problem.startswith("part boom failed: ") for problem in schema.problems(folder))
    with pytest.raises(ValueError, match="part boom failed"):
        schema.read_reports(tmp_path / "reports")  # the book refuses it


@pytest.mark.parametrize(
    "name, system",
    [("Tesla T4", "T4x2"), ("NVIDIA A100-SXM4-40GB", "A100x2"), ("NVIDIA H100 80GB HBM3", "H100x8"),
     ("NVIDIA A100-SXM4-80GB", None), ("NVIDIA H200", "H200x1"), ("NVIDIA H200 NVL", None), ("NVIDIA H100 PCIe", None)],
)  # fmt: skip
def test_a_gpu_is_predicted_only_with_its_own_cited_figures(name, system):
    found = system_for([name])
    assert (found.name if found else None) == (None if system is None else system_for_key(system))


def system_for_key(key: str) -> str:
    from distlab.predict.gpu_specs import SYSTEMS

    return SYSTEMS[key].name


def _copy(report: Path, root: Path, name: str) -> Path:
    return Path(shutil.copytree(report, root / name))


def _replace(folder: Path, file: str, old: str, new: str) -> None:
    path = folder / file
    path.write_text(path.read_text().replace(old, new, 1))


def _edit(folder: Path, file: str, change) -> None:
    path = folder / file
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))


@pytest.mark.slow
@pytest.mark.parametrize(
    "breakage, says",
    [
        (lambda f: _edit(f, "sweep.json", lambda r: r["config"].update(out="/home/alice/runs")), "machine path"),
        (lambda f: _edit(f, "report.json", lambda r: r["environment"].pop("torch")), "no 'torch'"),
        (lambda f: _edit(f, "sweep.json", lambda r: r["environment"].update(hostname="alice-pc")), "names the machine"),
        (lambda f: _replace(f, "sweep.json", '"time_s": ', '"time_s": NaN, "x": '), "NaN"),
        (lambda f: (f / "collectives.json").unlink(), "missing"),
        (lambda f: (f / "host.json").write_bytes(b" " * (schema.LARGEST_FILE + 1)), "more than"),
        (lambda f: _edit(f, "report.json", lambda r: r["parts"][0].update(status="failed", reason="")), "a reason"),
        (lambda f: _edit(f, "fsdp-options.json", lambda r: r.pop("environment")), "not a distlab result"),
        (lambda f: _edit(f, "report.json", lambda r: r.update(schema="something/1")), "schema"),
        (lambda f: _edit(f, "report.json", lambda r: r["parts"][0].update(status="failed", reason="rank 0: boom")),
         "part host failed: rank 0: boom"),  # the book shows no report with a failed part
    ],
)  # fmt: skip
def test_a_broken_report_is_refused_in_one_line_that_says_why(cpu_report, tmp_path, breakage, says):
    folder = _copy(cpu_report, tmp_path, "broken")
    breakage(folder)
    found = schema.problems(folder)
    assert any(says in problem for problem in found), found
    with pytest.raises(ValueError, match="not a valid GPU report") as refused:
        schema.check(folder)
    assert "\n" not in str(refused.value)


@pytest.mark.slow
def test_the_page_with_no_report_one_and_several(cpu_report, tmp_path):
    assert schema.read_reports(tmp_path / "nowhere") == []
    assert schema.reports_markdown([]) == schema.NO_REPORT
    root = tmp_path / "gpu"
    _copy(cpu_report, root, "first")
    (one,) = schema.read_reports(root)
    table = schema.reports_markdown([one])
    assert table.count("\n") == 2 and "no GPU" in table and "CI" in table
    page = schema.report_markdown(one)
    assert page.startswith("**Measured on CPU") and "Not run:" in page and "copies (needs a CUDA device)" in page
    later = _copy(cpu_report, root, "second")
    _edit(later, "report.json", lambda r: r["environment"].update(date="2999-01-01T00:00:00+00:00"))
    several = schema.read_reports(root)
    assert [r["folder"].name for r in several] == ["first", "second"]
    assert schema.reports_markdown(several).count("\n") == 3


def test_every_committed_report_passes_the_check():
    schema.read_reports(committed_results("gpu"))  # refuses the first invalid one, naming why


@pytest.mark.slow
def test_a_labs_results_become_a_checked_report_and_nothing_to_report_says_so(cpu_report, tmp_path, capsys):
    from distlab.gpu_report.lab import report_from_results

    results = tmp_path / "results"
    results.mkdir()
    assert report_from_results(results, lab="lab_fsdp", out=tmp_path / "reports") is None
    assert "no result file" in capsys.readouterr().out
    shutil.copy(cpu_report / "sweep.json", results / "gpt-tiny-fsdp.json")
    (results / "hardware.json").write_text('{"gpus": []}')  # not a result file: left out
    folder = report_from_results(results, lab="lab_fsdp", out=tmp_path / "reports")
    report = schema.check(folder)
    assert report["parts"][0]["files"] == ["gpt-tiny-fsdp.json"] and "CPU" in capsys.readouterr().out


@pytest.mark.slow
def test_a_report_run_with_other_code_is_shown_with_what_ran_and_what_failed(tmp_path, capsys):
    """A report whose provenance file says what code ran is read with its failed parts, each named with the
    provenance's reason, below what ran; one without the provenance's three statements is refused."""
    from distlab.gpu_report.__main__ import main

    script = tmp_path / "raises.py"
    script.write_text(RAISES)
    parts = [Part("boom", "a rank that raises", str(script), nproc=1)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(run, "plan", lambda machine, quick=False: parts)
        with pytest.raises(SystemExit):
            main(["--out", str(tmp_path / "reports"), "--budget-s", "300"])
    capsys.readouterr()
    (folder,) = (tmp_path / "reports").iterdir()
    provenance = {"code": "commit abc", "changes": ["one line changed"], "says": "Kept until replaced."}
    (folder / schema.PROVENANCE_FILE).write_text(json.dumps(provenance | {"failed": {"boom": "fixed since"}}))
    (report,) = schema.read_reports(tmp_path / "reports")
    page = schema.report_markdown(report)
    assert "*Code that ran*: commit abc, with one line changed. Kept until replaced." in page
    assert "Failed: boom (fixed since)" in page
    (folder / schema.PROVENANCE_FILE).write_text(json.dumps({"code": "commit abc"}))
    with pytest.raises(ValueError, match="no changes, says"):
        schema.read_reports(tmp_path / "reports")


def test_each_sweep_row_says_how_far_its_predicted_arithmetic_outweighs_its_fixed_costs():
    """The first committed H200 report's points (8 x 256 tokens) are launch-bound: the course predicts their
    arithmetic at under a third of each strategy's fixed costs, and the page shows the ratio beside every row. The
    quick report's sized point (1016 x 256 tokens) is predicted compute-dominated for DDP and the course's ZeRO."""
    from distlab.gpu_report import summary
    from distlab.predict import gpu_predictions

    h200 = [r for r in schema.read_reports(committed_results("gpu")) if "H200" in schema.label(r)]
    (report,) = [r for r in h200 if not schema.is_quick(r)]
    system = gpu_predictions.system_for(report["environment"]["gpus"])
    for one in h200:
        for row in summary.of_report(one)["sweep"]:
            compute = gpu_predictions.compute_s(system.gpu, row["model"], row["tokens_per_rank"], 256, "bf16")
            fixed = gpu_predictions.fixed_s(row["model"], row["variant"], 1, system)
            assert row["compute_over_fixed"] == pytest.approx(compute / fixed)
            assert (row["compute_over_fixed"] < 1) == (row["tokens_per_rank"] == 2048)
            if row["tokens_per_rank"] > 2048 and row["variant"] in ("ddp", "zero1", "zero2", "zero3"):
                assert row["compute_over_fixed"] > gpu_predictions.COMPUTE_DOMINATED
    rows = summary.of_report(report)["sweep"]
    page = schema.report_markdown(report | {"summary": {"sweep": rows}})
    assert "compute / fixed costs, PREDICTED" in page and "| 0.043x |" in page
    assert schema.CITED_PREDICTIONS not in page  # the report said so when it ran: the course cites the H200 since


@pytest.mark.slow
def test_a_report_names_no_machine(cpu_report, tmp_path, monkeypatch):
    """No result file records the machine's name any more, and a report's files lose it wherever a command line or a
    log quoted it (F15: a hostname such as alice-laptop would have gone into the pull request)."""
    from distlab.results import environment

    assert "hostname" not in environment()
    folder = _copy(cpu_report, tmp_path, "named")
    # the short name first, as a set may give it: replacing it first would leave "<host>.home"
    monkeypatch.setattr(run, "machine_names", lambda: ["alice-laptop", "alice-laptop.home"])
    _edit(folder, "host.json", lambda r: r["environment"].update(command="ssh alice-laptop.home python -m x"))
    run.scrub(folder)
    text = (folder / "host.json").read_text()
    assert "alice-laptop" not in text and "ssh <host> python" in text
    assert schema.problems(folder) == []


def test_a_fit_whose_time_does_not_grow_with_size_shows_no_bandwidth_not_zero():
    """F16: a collective whose time fell as its size grew (a noisy CPU run) has no bandwidth to fit; the table says
    so instead of a fitted "0.00 GB/s"."""
    from distlab.gpu_report import summary

    rows = [
        {"collective": "all_gather", "impl": "ring", "bytes": size, "time_s": t, "busbw_GBps": size / t / 1e9}
        for size, t in ((1 << 16, 3e-3), (1 << 20, 2e-3), (1 << 22, 1e-3))
    ]
    (row,) = summary.collectives({"metrics": rows, "environment": {"world_size": 2}}, None)
    assert row["fit_bus_GBps"] is None
    environment = {"device_kind": "cpu", "date": "2026-11-27"}
    report = {"environment": environment, "parts": [], "summary": {"collectives": [row]}}
    assert "| no fit: time did not grow with size |" in schema.report_markdown(report)


@pytest.mark.slow
def test_a_several_rank_reports_model_column_says_it_lacks_each_strategys_own_cost(cpu_report):
    """F14: on one rank the model column carries each strategy's own cost, fitted on the same run; on several ranks
    no run measures that cost apart from what is sent, and each cell says it is left out."""
    from distlab.gpu_report import summary

    report = schema.check(cpu_report)
    rows = summary.of_report(report)["sweep"]
    assert rows and all(r["ranks"] == 2 and r["model_has_strategy_cost"] is False for r in rows)
    page = schema.report_markdown(report | {"summary": {"sweep": rows}})
    assert page.count("(without the strategy's own cost)") == len(rows)
    for h200 in [r for r in schema.read_reports(committed_results("gpu")) if "H200" in schema.label(r)]:
        page = schema.report_markdown(h200 | {"summary": summary.of_report(h200)})
        assert "without the strategy's own cost" not in page


def test_the_report_knows_the_machine_from_the_one_gpu_survey():
    """The report's machine is what the labs' and every result file's survey says (measure.hardware.survey), not a
    second reading of the GPUs: its count, its smallest GPU's memory, bf16 in hardware, the names."""
    from distlab.measure.hardware import survey

    facts = {"gpus": ["Tesla T4", "Tesla T4"], "memory_bytes": [15_828_320_256, 15_642_132_480], "bf16": False}
    assert Machine.from_survey(facts) == Machine(2, 15_642_132_480, False, ["Tesla T4", "Tesla T4"])
    assert Machine.from_survey({"gpus": [], "memory_bytes": [], "bf16": False}) == Machine(0)
    here = survey(topology=False)
    assert Machine.here() == Machine.from_survey(here) and {"memory_bytes", "bf16"} <= set(here)


def test_a_quick_report_on_a_gpu_sweeps_the_launch_bound_point_and_one_sized_preset():
    """``--quick`` (the GPU tests' report) keeps the sweep to its launch-bound point and its smallest sized preset:
    the FSDP2 point, a 2.7-billion-parameter model, has a GPU test of its own."""
    h200 = Machine(1, 140 * GIB, True, ["NVIDIA H200"])
    (full,) = [part for part in plan(h200) if part.name == "sweep"]
    (quick,) = [part for part in plan(h200, quick=True) if part.name == "sweep"]
    assert "--fsdp2-point" in full.args and "--fsdp2-point" not in quick.args
    assert quick.args[quick.args.index("--models") + 1] == "gpt-mini"
    first_sized = full.args[full.args.index("--batch-sizes") + 1].split(",")[0]
    assert quick.args[quick.args.index("--batch-sizes") + 1] == first_sized


def test_t6_the_scrub_keeps_the_topologys_legend_and_takes_every_path(tmp_path, monkeypatch):
    """T6 (gpu-audit-2): the scrub read ``d:`` and JSON's escaped newline as a Windows drive, so every committed
    report's topology said "Legen<path>  X    = Self". A drive is one letter on its own: windows' and unix paths
    still go, in JSON (``C:\\\\Users``) as in text, and the legend stays."""
    monkeypatch.setattr(run, "machine_names", lambda: [])
    topology = "\tGPU0\tGPU1\nGPU0\t X \tNV18\n\nLegend:\n\n  X    = Self\n  NV#  = Connection traversing NVLinks"
    record = {"topology": topology, "windows": "C:\\Users\\alice\\run", "after_a_newline": "ran\nD:\\work\\x",
              "unix": "/home/alice/x"}  # fmt: skip
    (tmp_path / "report.json").write_text(json.dumps(record, indent=1))
    run.scrub(tmp_path)
    scrubbed = json.loads((tmp_path / "report.json").read_text())
    assert scrubbed["topology"] == topology
    assert scrubbed["windows"] == "<path>" and scrubbed["after_a_newline"] == "ran\n<path>"
    assert scrubbed["unix"] == "<path>"
    assert schema.MACHINE_PATH.search("see C:\\Users\\alice in the log")  # a text file's path, one backslash
    assert not schema.MACHINE_PATH.search(json.dumps({"topology": topology}))


def test_t6_the_committed_reports_topology_lost_its_legend_to_the_old_scrub():
    """What the old scrub wrote into the committed H200 reports (kept as measured): the regular expression now finds
    no path in the topology it would have written, so a report scrubbed from now on keeps its legend."""
    committed = json.loads((committed_results("gpu") / "nvidia-h200-1x-20261128-174427" / "report.json").read_text())
    topology = committed["environment"]["topology"]
    assert "Legen<path>" in topology
    assert not schema.MACHINE_PATH.search(json.dumps(topology.replace("Legen<path>", "Legend:\n\n")))
