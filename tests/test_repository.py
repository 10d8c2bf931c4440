"""The repository keeps its promises: CI runs the README's commands, and
every committed result carries its provenance."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_commands_the_site_tests_and_the_kaggle_stack_in_order():
    readme = (ROOT / "README.md").read_text()
    test, build = (
        "pip install -r requirements.txt && python -m pytest",
        "pip install -r requirements.txt && jupyter-book build book",
    )
    assert test in readme and build in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert "set -euo pipefail" in ci
    for part in (
        "readme_tests",
        "readme_book",
        "site_tests",
        "kaggle_tier_ddp_labs",
        "kaggle_tier_other_labs",
        "kaggle_default_tier",
    ):
        assert f"{part}() {{" in ci, f".ci/run defines no {part}"
    assert f"readme_tests() {{ {test}; }}" in ci and f"readme_book() {{ {build}; }}" in ci
    calls = [line.split()[-1] for line in ci.splitlines() if line.startswith("timed ")]
    assert calls == ["main_stack", "lint", "readme_tests", "readme_book", "other_tiers", "last_parts"]
    # the slow and stress tiers alone; the site's tests and Kaggle's two tiers side by side after them
    assert "side_by_side site_tests kaggle_tier_ddp_labs kaggle_tier_other_labs kaggle_default_tier" in ci
    assert '-k "$DDP_LABS"' in ci and '-k "not ($DDP_LABS)"' in ci  # the two halves: every lab in one of them
    assert 'DISTLAB_BUILT_PAGES="$PWD/_build/.jupyter_cache/executed"' in ci  # the slow tier reads the build's runs
    assert "ruff check src tests scripts" in ci and "ruff format --check src tests scripts" in ci
    assert "tests/test_site.py tests/test_browser.py" in ci and "DISTLAB_REQUIRE_SITE=1" in ci
    assert "--no-deps" in ci and ".ci/kaggle-requirements.txt" in ci
    kaggle = (ROOT / ".ci" / "kaggle-requirements.txt").read_text().splitlines()
    assert {"torch==2.10.0", "torchvision==0.25.0", "accelerate==1.13.0"} <= set(kaggle)
    site_lines = [line.strip() for line in (ROOT / "scripts" / "check_site.sh").read_text().splitlines()]
    assert build in site_lines and any("tests/test_site.py tests/test_browser.py" in line for line in site_lines)


def test_ci_runs_every_tier_but_the_gpus_and_the_default_tier_on_both_stacks():
    """Each marker of pyproject.toml but gpu (and quick, a part of gpu) is selected by a pytest command of
    .ci/run, and the default tier (no marker) by two: the README's on the main stack and Kaggle's."""
    import re
    import tomllib

    from _pytest.mark.expression import Expression

    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    tiers = {line.split(":")[0] for line in options["markers"]} - {"gpu", "quick"}
    default = re.search(r"-m '([^']+)'", options["addopts"]).group(1)
    ci = (ROOT / ".ci" / "run").read_text()
    expressions = [
        m.group(1) if m else default
        for m in (
            re.search(r'-m "([^"]+)"', line)
            for line in ci.splitlines()
            if "pytest" in line and "tests/test_site.py tests/" not in line
        )
    ]
    expressions = [Expression.compile(e) for e in expressions]

    def runs(marks: set[str]) -> int:
        return sum(e.evaluate(lambda name, **_: name in marks) for e in expressions)

    assert tiers == {"slow", "stress", "kaggle"}
    assert all(runs({tier}) >= 1 for tier in tiers), {tier: runs({tier}) for tier in tiers}
    assert runs(set()) == 2 and runs({"gpu"}) == 0


def test_book_toc_and_labs_are_wired():
    assert (ROOT / "book" / "_toc.yml").resolve() == (ROOT / "_toc.yml").resolve()
    assert (ROOT / "book" / "labs").resolve() == (ROOT / "notebooks").resolve()


def _committed_result_files() -> list[Path]:
    """Every JSON file a run wrote under book/results: not a GPU report's provenance, which people write to say
    what code ran."""
    return [p for p in sorted((ROOT / "book" / "results").rglob("*.json")) if p.name != "provenance.json"]


def test_committed_results_carry_their_environment():
    for path in _committed_result_files():
        env = json.loads(path.read_text())["environment"]
        for key in ("torch", "backend", "world_size", "date", "command"):
            assert key in env, f"{path} lacks environment[{key!r}]"


def test_committed_cpu_results_were_measured_with_the_pinned_torch():
    """The book is built with constraints.txt's torch: the CPU results it plots were measured with the same one
    (``scripts/reproduce_results.sh`` re-measures them after the pin moves)."""
    pinned = re.search(r"^torch==(\S+)$", (ROOT / "constraints.txt").read_text(), re.MULTILINE).group(1)
    for path in _committed_result_files():
        env = json.loads(path.read_text())["environment"]
        if env.get("device") == "cpu":
            assert env["torch"].split("+")[0] == pinned, f"{path} was measured with torch {env['torch']}, not {pinned}"


def test_nothing_the_book_reads_is_git_ignored():
    """A clean checkout must hold every file the chapters read (the book is built from one)."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    book_files = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "book").rglob("*")
        if p.is_file() and "_build" not in p.parts and ".ipynb_checkpoints" not in p.parts
    ]
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", *book_files], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    assert not ignored, f"git ignores files the book needs: {ignored}"


def _pages() -> list[Path]:
    """README, chapters and labs: every place a reader copies a command or an import from."""
    return [ROOT / "README.md", *sorted((ROOT / "book").glob("*.md")), *sorted((ROOT / "notebooks").glob("*.ipynb"))]


def _text(page: Path) -> str:
    if page.suffix == ".ipynb":
        return "\n".join("".join(cell["source"]) for cell in json.loads(page.read_text())["cells"])
    return page.read_text()


def _defined_names(path: Path) -> set[str]:
    """``name`` and ``Class.method`` for every def and class in a file."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                members = [item for item in node.body if isinstance(item, (ast.FunctionDef, ast.ClassDef))]
                names |= {f"{node.name}.{item.name}" for item in members}
    return names


def test_every_literalinclude_and_pyobject_resolves():
    includes = 0
    for page in sorted((ROOT / "book").glob("*.md")):
        for match in re.finditer(r"```\{literalinclude\}\s+(\S+)\n((?::\w+:.*\n)*)", page.read_text()):
            includes += 1
            path = (page.parent / match.group(1)).resolve()
            assert path.is_file(), f"{page.name}: {match.group(1)} does not exist"
            obj = re.search(r":pyobject:\s*(\S+)", match.group(2))
            if obj:
                name = obj.group(1)
                assert name in _defined_names(path), f"{page.name}: {name} is not defined in {match.group(1)}"
    assert includes >= 10  # the guard reads the includes it means to guard


def test_every_distlab_module_and_import_on_a_page_resolves():
    checked = 0
    for page in _pages():
        text = _text(page)
        for module in re.findall(r"-m (distlab(?:\.\w+)+)", text) + re.findall(r"\"(distlab(?:\.\w+)+)\"", text):
            checked += 1
            assert importlib.util.find_spec(module) is not None, f"{page.name}: no module {module}"
        for module, names in re.findall(r"from (distlab(?:\.\w+)*) import ([\w, ]+)", text):
            imported = importlib.import_module(module)
            for name in (n.strip() for n in names.split(",")):
                checked += 1
                has = hasattr(imported, name) or importlib.util.find_spec(f"{module}.{name}") is not None
                assert has, f"{page.name}: {module} has no {name}"
    assert checked >= 20


def _modules_drawn_in_readme(readme: str) -> list[str]:
    """Module paths the README's layout draws under ``src/distlab/``, folders followed by indentation."""
    drawn, folders, inside = [], [], False
    for line in readme.splitlines():
        if line.startswith("src/distlab/"):
            inside = True
            continue
        if inside and not line.startswith("  "):
            break
        if inside:
            indent, entry = len(line) - len(line.lstrip()), line.split()[0]
            folders = [(i, name) for i, name in folders if i < indent]
            if entry.endswith("/"):
                folders.append((indent, entry))
            elif entry.endswith(".py"):
                drawn.append("".join(name for _, name in folders) + entry)
    return drawn


def test_the_readme_draws_every_module_of_the_tree():
    package = ROOT / "src" / "distlab"
    modules = {p.relative_to(package).as_posix() for p in package.rglob("*.py") if p.name != "__init__.py"}
    drawn = _modules_drawn_in_readme((ROOT / "README.md").read_text())
    assert len(drawn) == len(set(drawn)), "one line per module"
    assert set(drawn) == modules, f"missing: {sorted(modules - set(drawn))}, absent: {sorted(set(drawn) - modules)}"
    # a package's line is the first line of its __init__ docstring, which says what belongs there (tests/test_layout.py)
    readme = (ROOT / "README.md").read_text()
    for init in sorted(package.glob("*/__init__.py")):
        summary = ast.get_docstring(ast.parse(init.read_text())).splitlines()[0]
        drawn_as = rf"^  {init.parent.name}/ +{re.escape(summary)}$"
        assert re.search(drawn_as, readme, re.M), f"README: draw {init.parent.name}/ as its docstring says: {summary}"


def test_committed_results_are_found_from_a_checkouts_root_when_distlab_is_installed_elsewhere(tmp_path):
    """On Kaggle's stack distlab is the installed wheel, outside any checkout: run from a checkout's root, the
    chapters' and tests' committed results are that checkout's."""
    shutil.copytree(ROOT / "src" / "distlab", tmp_path / "site" / "distlab")
    found = subprocess.run(
        [sys.executable, "-c", "from distlab.results import committed_results; print(committed_results('zero'))"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path / "site")},
    )  # fmt: skip
    assert found.returncode == 0, found.stderr[-2000:]
    assert found.stdout.strip() == str(ROOT / "book" / "results" / "zero")


def test_every_claim_reads_as_written():
    """YAML reads an unquoted " #" as the start of a comment: a claim's citation would end there, silently."""
    import yaml

    path = ROOT / "book" / "claims.yml"
    loaded = {claim["id"]: claim for claim in yaml.safe_load(path.read_text()) if isinstance(claim, dict)}
    cut = []
    for line in path.read_text().splitlines():
        key, _, value = line.strip().lstrip("- ").partition(": ")
        if value and not value.startswith(("'", '"', "[", "{", "|", ">")) and " #" in value:
            cut.append(f"{key}: {value[:60]}")
    assert not cut, f"quote these values, or YAML cuts them at ' #': {cut}"
    assert "issue #552" in loaded["kaggle-nccl-works"]["why"]


# What the pages say about FSDP2's reduce dtype, and numbers they quote, against torch and the committed results
# (content review 3: F2, F10, F11, F13, F17, F20).

FP32_CALLED_TORCHS_DEFAULT = (
    "torch's mixed-precision defaults",
    "torch's default mixed-precision dtypes",
    "torch's default dtypes",
    "torch's default under autocast",
    "default `reduce_dtype=fp32`",
    "as torch does it by default",
)


def test_every_page_and_ci_remove_the_scratch_folders_they_make():
    """A page's scratch folder is a TemporaryDirectory (removed at a normal exit) that its last cell also removes:
    the book's build stops each kernel after a grace period of 2.5 s (jupyter_client's shutdown_wait_time / 2),
    before its exit handlers run, and each build left about 100 MB in /tmp. CI's scratch holds two
    virtualenvs (about 14 GB) and is removed however the run ends."""
    pages = [page for page in sorted((ROOT / "book").glob("*.md")) if "tempfile" in page.read_text()]
    assert len(pages) >= 6
    for page in pages:
        text = page.read_text()
        assert "mkdtemp" not in text, f"{page.name} makes a folder nothing removes"
        assert text.count("scratch = tempfile.TemporaryDirectory(") == 1, page.name
        last_cell = text.rsplit("```{code-cell}", 1)[1]
        assert ":tags: [remove-cell]" in last_cell and "scratch.cleanup()" in last_cell, page.name
    ci = (ROOT / ".ci" / "run").read_text()
    assert "trap clean_up EXIT" in ci and 'rm -rf "$scratch"' in ci


def test_no_page_calls_an_fp32_reduce_scatter_torchs_default():
    """torch's MixedPrecisionPolicy.reduce_dtype is None, which reduces in param_dtype (tests/test_gpu_predictions.py
    runs it): an fp32 reduce-scatter is the course's policy, and the pages, the ledger and the library say so."""
    files = [
        "book/ddp_vs_fsdp.md", "book/fsdp_from_scratch.md", "book/claims.yml", "book/_static/calculator.html",
        "src/distlab/exercises/costs.py", "src/distlab/predict/gpu_predictions.py", "src/distlab/predict/calculator.py",
    ]  # fmt: skip
    found = [
        f"{name}: {phrase!r}"
        for name in files
        for phrase in FP32_CALLED_TORCHS_DEFAULT
        if phrase in " ".join((ROOT / name).read_text().split())
    ]
    assert not found, found
    page = (ROOT / "book" / "ddp_vs_fsdp.md").read_text()
    assert "torch's default for `reduce_dtype` is None" in page


def test_the_t4_advice_names_fp16_not_bf16():
    """A T4 has no bf16 arithmetic units (fsdp2_in_practice.md): the rule about Kaggle's T4s must not send a reader
    to bf16 reductions."""
    page = (ROOT / "book" / "ddp_vs_fsdp.md").read_text()
    rule = page[page.index("5. **Bandwidth and GPU count**") : page.index("(ddp-vs-fsdp-calculator)=")]
    assert "reduce_dtype=bf16" not in rule and "the 16-bit format is fp16" in rule and "no bf16" in rule


def test_full_shard_sends_less_than_half_as_much_again_because_the_root_is_gathered_once():
    """ddp_vs_fsdp.md's sweep: ZeRO-3 and FULL_SHARD send more than DDP but less than 1.5x (the root is gathered
    once), the page prints the ratio, and the further below 1.5x the larger the root's share."""
    from distlab.models import build_model
    from distlab.predict.memory import shard_unit_shapes
    from distlab.results import read_result

    page = (ROOT / "book" / "ddp_vs_fsdp.md").read_text()
    assert "sent[name] / sent['ddp']" in page and "half as much again\n  (a second" not in page
    record = read_result(ROOT / "book" / "results" / "sweep" / "sweep-2xcpu.json")
    ratios = {}
    for preset in record["metrics"]["presets"]:
        sent = {row["variant"]: sum(t["bytes_sent"] for t in row["traffic"].values()) for row in preset["variants"]}
        for name in ("zero3", "fsdp"):
            assert 1 < sent[name] / sent["ddp"] < 1.5, (preset["model"], name)
        units = shard_unit_shapes(build_model(preset["model"], device="meta"))
        values = [sum(shape.numel() for shape in unit) for unit in units]
        ratios[values[-1] / sum(values)] = sent["fsdp"] / sent["ddp"]
    assert [ratios[share] for share in sorted(ratios)] == sorted(ratios.values(), reverse=True)


def test_torch_chunk_leaves_the_last_ranks_fewer_rows_or_none():
    """fsdp2_in_practice.md: FSDP2 shards dim 0 as torch.chunk does, pieces of ceil(rows / N)."""
    import torch

    assert [len(p) for p in torch.chunk(torch.arange(10), 4)] == [3, 3, 3, 1]
    assert [len(p) for p in torch.chunk(torch.arange(6), 4)] == [2, 2, 2]  # rank 3 holds nothing
    page = (ROOT / "book" / "fsdp2_in_practice.md").read_text()
    assert "a row more than the last" not in page and "torch.chunk(torch.arange(rows), 4)" in page


def test_one_root_unit_was_the_slower_at_every_committed_world_size():
    """fsdp2_in_practice.md says the root-only unit made the step slower at both world sizes, against the defaults
    and against keeping each block (the same bytes): what the committed options runs show, computed on the page."""
    from distlab.results import read_result

    paths = sorted((ROOT / "book" / "results" / "fsdp").glob("fsdp-options-gpt-mini-*xcpu.json"))
    assert len(paths) == 2
    for path in paths:
        rows = {row["variant"]: row for row in read_result(path)["metrics"]["variants"]}
        assert rows["root_only"]["time_s"] > max(rows["fsdp"]["time_s"], rows["keep_after_forward"]["time_s"]), path
    page = (ROOT / "book" / "fsdp2_in_practice.md").read_text()
    assert "rows['root_only']['time_s'] / rows['fsdp']['time_s']" in page
    assert "faster or slower (compare the two world sizes)" not in " ".join(page.split())
