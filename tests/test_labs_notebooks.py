"""What the three labs say and run, read from their cells (labs-1 L1-L15): the first code cell, the set-up every lab
repeats from scripts/lab_setup.py, is left out of every check here."""

from __future__ import annotations

import ast
import fnmatch
import json
import re
import subprocess
from pathlib import Path

import pytest

from distlab.gpu_report.lab import lab_result_files

ROOT = Path(__file__).resolve().parents[1]
LABS = ("lab0_first_run", "lab_ddp_mnist", "lab_fsdp")


def cells(lab: str) -> list[dict]:
    """The lab's cells after its first code cell (the shared set-up), each with its source as one string."""
    notebook = json.loads((ROOT / "notebooks" / f"{lab}.ipynb").read_text())
    every = [{**cell, "source": "".join(cell["source"])} for cell in notebook["cells"]]
    first = next(i for i, cell in enumerate(every) if cell["cell_type"] == "code")
    return every[:first] + every[first + 1 :]


def code(lab: str) -> str:
    return "\n".join(cell["source"] for cell in cells(lab) if cell["cell_type"] == "code")


def prose(lab: str) -> str:
    return " ".join(" ".join(cell["source"].split()) for cell in cells(lab) if cell["cell_type"] == "markdown")


def test_lab0_writes_and_runs_the_ddp_chapters_program_before_the_librarys_runs():
    """L3: lab 0 wrote a 3-line script that calls the library; no process group, sampler or DDP in sight."""
    chapter = re.search(r"```\{code-cell\} ipython3\n(%%writefile ddp_minimal.py\n.*?)```",
                        (ROOT / "book" / "ddp.md").read_text(), re.S).group(1)  # fmt: skip
    sources = [cell["source"] for cell in cells("lab0_first_run") if cell["cell_type"] == "code"]
    written = next(i for i, s in enumerate(sources) if s.startswith("%%writefile ddp_minimal.py"))
    assert sources[written] == chapter.rstrip("\n"), "lab 0's program is the chapter's, word for word"
    launched = next(i for i, s in enumerate(sources) if re.search(r"^!.*ddp_minimal\.py", s, re.M))
    first_library_run = next(i for i, s in enumerate(sources) if "--run-name lab0-" in s)
    assert written < launched < first_library_run


@pytest.mark.parametrize("lab", LABS)
def test_every_lab_computes_its_speed_up_from_throughput_with_the_one_library_function(lab):
    """L1, L12: lab 0 divided whole-run times, the DDP lab the last epoch's times, the FSDP lab mean epoch times."""
    source = code(lab)
    assert "throughput_speedup(" in source
    assert not re.search(r"(epoch_time_s|total_time_s)['\"]\]\s*/|/\s*\w+\[['\"](epoch_time_s|total_time_s)", source)
    assert "samples per second of the last epoch, all ranks together" in prose(lab)


@pytest.mark.parametrize("lab", LABS)
def test_every_lab_says_why_the_distributed_runs_trail_after_a_short_run(lab):
    """L2: the tables showed DDP 4 to 40 points behind, and the readings said "the same model"."""
    assert re.search(r"(fewer|more) steps is (less|more) training", prose(lab))


def test_the_labs_show_the_equality_they_measure():
    """L2: lab 0 runs one rank at the global batch beside DDP; the DDP lab prints its single run at DDP's global
    batch against that DDP run."""
    assert "--run-name lab0-single-global" in code("lab0_first_run")
    assert "step_loss_differences(global_batch_run, ddp)" in code("lab0_first_run")
    ddp_lab = code("lab_ddp_mnist")
    assert "plots.same_training(" in ddp_lab and "largest_step_loss_difference(s, d)" in ddp_lab


def test_the_fsdp_lab_draws_with_the_library_in_one_call_each():
    """L4, L9: three cells drew 47, 56 and 46 lines of matplotlib, 17 in wide with 7 pt legends."""
    source = code("lab_fsdp")
    for inline in ("plt.subplots", ".barh(", "suptitle", "fontsize="):
        assert inline not in source, inline
    for figure in ("plot_training_runs(", "plot_state_against_prediction(", "plot_predicted_footprint(",
                   "plot_tokens_per_s(", "plot_fsdp_step_options("):  # fmt: skip
        assert f"plots.{figure}" in source, figure


def test_the_fsdp_lab_counts_torch_ddps_buckets():
    """L5: DDP at 16 bytes a parameter where the chapter counts torch DDP, buckets and all, at 20."""
    source = code("lab_fsdp")
    assert '"buckets": buckets' in source and 'buckets = held["gradients"] if wrap == "ddp"' in source
    assert "20 bytes a parameter, as the chapter *DDP or FSDP?* counts it" in prose("lab_fsdp")


def test_the_ddp_lab_names_its_step_variants_and_prints_their_spread():
    """L6: NaiveDDP, the clearest bar, went unnamed; one gap inside the quartiles was printed as communication."""
    assert "compare_with_torch_ddp(step)" in code("lab_ddp_mnist")
    text = prose("lab_ddp_mnist")
    assert "`NaiveDDP`" in text and "`BucketedDDP`" in text and "quartiles" in text


def test_the_fsdp_lab_does_not_set_a_cpu_measurement_beside_a_gpu_prediction():
    """L7: "measured 99,034 tokens/s ... PREDICTED 9,705,760-9,705,760 tokens/s" on one line of a CPU run."""
    cell = next(c["source"] for c in cells("lab_fsdp") if "gpu_predictions.predict(system, SMALL, wrap" in c["source"])
    assert "plots.number_range(" in cell
    measured_at = cell.index("measured {measured")
    assert cell.rfind("if OWN_GPU:", 0, measured_at) > cell.rfind("else:", 0, measured_at)


@pytest.mark.parametrize("lab", LABS)
def test_every_lab_says_its_first_cell_is_plumbing_before_the_learner_reads_it(lab):
    """L8: the first code a learner met was 68-87 lines of install and placement code, unannounced."""
    notebook = json.loads((ROOT / "notebooks" / f"{lab}.ipynb").read_text())
    first = next(i for i, cell in enumerate(notebook["cells"]) if cell["cell_type"] == "code")
    before = " ".join("".join(cell["source"]) for cell in notebook["cells"][:first])
    assert "plumbing, not distributed training" in before


SCRIPTS = [("lab_ddp_mnist", "ddp_train.py", "*DDP*"), ("lab_fsdp", "fsdp_train.py", "*FSDP2 in practice*")]


@pytest.mark.parametrize(("lab", "script", "chapter"), SCRIPTS)
def test_each_labs_script_says_it_is_its_chapters(lab, script, chapter):
    """L10: neither lab named the chapter that shows its script, or the test that holds the two identical."""
    text = prose(lab)
    assert f"`scripts/{script}`" in text and chapter in text and "a test keeps the two identical" in text


@pytest.mark.parametrize("lab", LABS)
def test_no_lab_suggests_a_diff_across_kernels(lab):
    """L11: "diff ddp_train.py fsdp_train.py": two labs write the two files, on Kaggle in two kernels."""
    assert "diff ddp_train.py fsdp_train.py" not in prose(lab) + code(lab)


def test_the_ddp_labs_script_plot_counts_steps_from_one():
    """L13: one loss plot numbered its steps from 0, every other from 1."""
    assert "numbers = range(1, len(steps) + 1)" in code("lab_ddp_mnist")


def test_the_fsdp_lab_counts_the_things_it_lists():
    """L14: "This lab does two things", then items 1, 2 and 3."""
    opening = cells("lab_fsdp")[0]["source"]
    items = len(re.findall(r"^\d+\. ", opening, re.M))
    words = {2: "two", 3: "three", 4: "four"}
    assert f"does\n{words[items]} things" in opening or f"does {words[items]} things" in opening


def run_names(lab: str) -> set[str]:
    """The result files a lab's cells write, by name (an f-string's fields filled as a CPU play fills them)."""
    fill = {"SMALL": "gpt-tiny", "wrap": "ddp"}
    found = set()
    for pattern in (r"--run-name (\S+)", r"--name (\S+)", r"results/([\w{}-]+)\.json", r'run_script\(f?"([^"]+)"'):
        for name in re.findall(pattern, code(lab)):
            name = re.sub(r"\{([^}]*)\}", lambda m: fill.get(m.group(1), "x"), name)
            if name != "x":
                found.add(name)
    return found


def report_names(lab: str) -> list[str]:
    """The ``names`` the lab's report cell hands report_from_results (a list, or a variable the cell assigns)."""
    cell = next(c["source"] for c in cells(lab) if "report_from_results(" in c["source"])
    tree = ast.parse(cell)
    lists = {t.id: ast.literal_eval(node.value) for node in ast.walk(tree)
             if isinstance(node, ast.Assign) and isinstance(node.value, ast.List)
             for t in node.targets if isinstance(t, ast.Name)}  # fmt: skip
    call = next(
        n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "report_from_results"
    )
    value = next(k.value for k in call.keywords if k.arg == "names")
    return lists[value.id] if isinstance(value, ast.Name) else ast.literal_eval(value)


def test_each_labs_report_takes_its_own_runs_from_a_shared_results_folder(tmp_path):
    """L15: run from notebooks/, the labs share results/, and the DDP lab's report took lab 0's files as its own."""
    names = {lab: run_names(lab) for lab in LABS}
    assert (
        names["lab0_first_run"] >= {"lab0-single", "lab0-single-global"} and "mnist-ddp-step" in names["lab_ddp_mnist"]
    )
    for lab_names in names.values():
        for name in lab_names:
            (tmp_path / f"{name}.json").write_text("{}")
    for lab in LABS:
        taken = {path.stem for path in lab_result_files(tmp_path, report_names(lab))}
        assert taken == names[lab], (lab, sorted(taken ^ names[lab]))


def test_the_reports_the_labs_write_in_notebooks_are_ignored():
    """L15: notebooks/gpu-reports/, which every lab writes when run from the checkout, was not ignored."""
    ignored = subprocess.run(["git", "check-ignore", "-q", "notebooks/gpu-reports/cpu-1x/report.json"], cwd=ROOT)
    assert ignored.returncode == 0


def test_lab_result_files_takes_every_file_without_names(tmp_path):
    for name in ("lab0-ddp", "mnist-ddp-step"):
        (tmp_path / f"{name}.json").write_text("{}")
    assert [p.stem for p in lab_result_files(tmp_path)] == ["lab0-ddp", "mnist-ddp-step"]
    assert [p.stem for p in lab_result_files(tmp_path, ["mnist-*"])] == ["mnist-ddp-step"]
    assert fnmatch.fnmatchcase("lab0-single-global", "lab0-*")


def test_the_pinned_lab_finds_the_committed_gpu_copies_it_draws_beside_yours():
    """T10 (gpu-audit-2): the pinned lab looked for committed copies under results/transfer, which holds none, so it
    always said "no committed GPU reference result yet"; the GPU reports' copies.json are where they are."""
    import json

    from distlab.results import committed_results

    cells = json.loads((ROOT / "notebooks" / "lab_pinned_memory.ipynb").read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    where = re.findall(r'committed_results\("(\w+)"\)\.glob\("([^"]+)"\)', code)
    assert where, "the lab reads no committed reference"
    assert all(sorted(committed_results(kind).glob(pattern)) for kind, pattern in where), where
