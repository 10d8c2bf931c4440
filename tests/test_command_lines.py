"""Every command line the course runs or prints parses, checked on the CPU in seconds, nothing launched: the GPU
report's plan for machines of 0 to 8 GPUs, and every ``-m distlab.X ...`` line in the notebooks, the book, the
README and ``scripts/reproduce_results.sh``, with the notebooks' placement variables (``{DEVICE}``, ``{NPROC}``)
taken from :func:`distlab.runtime.place` for 0, 1 and 2 GPUs. Each entry point's ``main`` is made by
:func:`distlab.cli.entry_point` from the configuration it parses (``main.config``), so the check needs no guess
about which class that is.

The GPU report's first run (an H200, at af2257a) failed where this check would have caught it on any CPU:
``--device cuda`` given to ``distlab.bench.transfer``, whose parser refuses it."""

from __future__ import annotations

import ast
import functools
import importlib
import json
import os
import pkgutil
import re
import shlex
import types
from dataclasses import is_dataclass
from pathlib import Path

import pytest

import distlab.bench
import distlab.demos
from distlab.cli import parse_or_refuse
from distlab.errors import DistlabError
from distlab.gpu_report.run import Machine, plan
from distlab.labs.launch import entry_config
from distlab.runtime import Placement, place

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
H100 = "NVIDIA H100 80GB HBM3"
MACHINES = {
    "no GPU": Machine(0),
    "1x H200": Machine(1, 140 * GIB, True, ["NVIDIA H200"]),
    "2x T4": Machine(2, int(14.75 * GIB), False, ["Tesla T4"] * 2),
    "4x H100": Machine(4, 80 * GIB, True, [H100] * 4),
    "8x H100": Machine(8, 80 * GIB, True, [H100] * 8),
}
NO_CONFIG = {"distlab.demos.bad_inputs": "its main builds a plain argparse parser with --out alone"}
"""Entry points whose ``main`` parses no configuration class, so nothing here can check their command lines."""


def config_of(module: str) -> type | None:
    return entry_config(module)


def refusal(module: str, args: list[str]) -> str | None:
    """Why ``-m module args`` would be refused before it ran anything, or None if it parses and validates."""
    try:
        parse_or_refuse(config_of(module), args, module)
    except DistlabError as err:
        return str(err)
    except SystemExit as exit:  # argparse's own exit, should anything bypass the refusal
        return f"argparse exited with status {exit.code}"
    return None


# (a) the GPU report's plan


@pytest.mark.parametrize("machine", MACHINES.values(), ids=MACHINES.keys())
def test_every_part_of_the_gpu_report_parses_with_its_entry_points_config(machine):
    refused = []
    for part in plan(machine):
        if part.skip:
            continue
        assert config_of(part.target) is not None, f"{part.name}: {part.target}'s main names no configuration"
        args = [*part.args, "--out", "r", "--name", part.name]  # what run_part adds
        why = refusal(part.target, args)
        if why:
            refused.append(f"{part.name} ({part.nproc} ranks): -m {part.target} {' '.join(args)}: {why}")
    assert not refused, "GPU report parts that would fail before they measure anything:\n" + "\n".join(refused)


# (b) the command lines in the notebooks, the book, the README and the reproduction script

UNRESOLVED = "\x00unresolved\x00"
LAUNCHER = re.compile(r"python3?\b|torchrun|torch\.distributed\.run")
MODULE_COMMAND = re.compile(r"(?<!\S)-m\s+(distlab(?:\.\w+)*)\b(.*)")
END_OF_COMMAND = re.compile(r"\s#|;|&&|\|\||\||\)|`|\s\d?>")
SAFE_CALLS = {"str", "int", "float", "max", "min", "len", "list", "tuple", "sorted", "bool", "Path", "place"}
SAFE_METHODS = {"join", "cpu_count", "split", "replace", "strip", "lower", "upper", "exists", "is_file", "is_dir"}
"""What a notebook's assignments may call for this test to evaluate them: nothing that changes anything or asks
torch about the machine (``place`` is given the simulated GPU count)."""


def _safe(node: ast.AST) -> bool:
    for inner in ast.walk(node):
        if isinstance(inner, ast.Call):
            func = inner.func
            if not (
                (isinstance(func, ast.Name) and func.id in SAFE_CALLS)
                or (isinstance(func, ast.Attribute) and func.attr in SAFE_METHODS)
            ):
                return False
        if isinstance(inner, (ast.Lambda, ast.NamedExpr, ast.Await, ast.Yield)):
            return False
    return True


def _names_only(target: ast.AST) -> bool:
    if isinstance(target, ast.Name):
        return True
    if isinstance(target, ast.Starred):
        return _names_only(target.value)
    return isinstance(target, (ast.Tuple, ast.List)) and all(_names_only(t) for t in target.elts)


def _run_assignments(statements: list[ast.stmt], ns: dict, protected: dict) -> None:
    """Run a cell's plain assignments (and the branch of an ``if`` its test picks) in ``ns``; skip the rest."""
    for stmt in statements:
        try:
            if isinstance(stmt, ast.Assign) and all(map(_names_only, stmt.targets)) and _safe(stmt.value):
                exec(compile(ast.Module([stmt], []), "<cell>", "exec"), ns)
            elif isinstance(stmt, ast.AugAssign) and _names_only(stmt.target) and _safe(stmt.value):
                exec(compile(ast.Module([stmt], []), "<cell>", "exec"), ns)
            elif isinstance(stmt, ast.If) and _safe(stmt.test):
                chosen = eval(compile(ast.Expression(stmt.test), "<cell>", "eval"), ns)
                _run_assignments(stmt.body if chosen else stmt.orelse, ns, protected)
        except Exception:  # a name the test cannot know (what torch or the kernel would say): left undefined
            pass
        ns.update(protected)


def _expand(line: str, ns: dict) -> str:
    """IPython's ``{expression}`` substitution in a ``!`` line, for the expressions this test can evaluate."""

    def value(match: re.Match) -> str:
        try:
            tree = ast.parse(match.group(1), mode="eval")
            if _safe(tree):
                return str(eval(compile(tree, "<line>", "eval"), ns))
        except Exception:
            pass
        return UNRESOLVED

    return re.sub(r"\{([^{}]+)\}", value, line)


def _notebook_namespace(placement: Placement) -> dict:
    """A kernel's names as the set-up cells leave them on a machine of ``placement.gpus`` GPUs."""
    seeds = {"GPUS": placement.gpus}  # the machine: never the notebook's own look at torch.cuda
    defaults = {"NPROC": placement.ranks, "DEVICE": placement.device, "BACKEND": placement.backend, "P": placement}
    tools = {"sys": types.SimpleNamespace(executable="python"), "os": os, "Path": Path}
    return {**tools, **defaults, **seeds, "place": functools.partial(place, gpus=placement.gpus)}


def _code_of(source: str) -> str:
    """A cell's Python, its ``!`` and ``%`` lines made ``pass`` (indentation kept)."""
    lines = [re.sub(r"^(\s*)[!%].*$", r"\1pass", line) for line in source.splitlines()]
    return "\n".join(lines)


def _joined(text: str) -> list[tuple[int, str]]:
    """(line number, line) with backslash continuations joined."""
    out, pending, start = [], "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    return out + ([(start, pending)] if pending else [])


def _markdown_commands(text: str, where: str) -> list[tuple[str, str]]:
    """The lines of fenced code blocks, and inline code spans (which may wrap), of a markdown text."""
    found, prose, fenced, first = [], [], [], 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            if first:
                found += [(f"{where}:{first + start - 1}", joined) for start, joined in _joined("\n".join(fenced))]
                fenced, first = [], 0
            else:
                fenced, first = [], number + 1
            continue
        (fenced if first else prose).append(line)
    for span in re.findall(r"`([^`]+)`", "\n".join(prose)):
        found.append((f"{where} (inline)", " ".join(span.split())))
    return found


def _notebook_commands(path: Path, placement: Placement) -> list[tuple[str, str]]:
    """A notebook's ``!`` lines, expanded with the kernel's names on this placement's machine, a script the
    notebook writes that runs a distlab entry point's ``main`` read as ``-m`` that module; and the commands of
    its markdown cells."""
    ns, found, scripts = _notebook_namespace(placement), [], {}
    protected = {"GPUS": placement.gpus}
    for index, cell in enumerate(json.loads(path.read_text())["cells"]):
        source = "".join(cell["source"])
        where = f"{path.relative_to(ROOT)} cell {index}"
        if cell["cell_type"] == "markdown":
            found += _markdown_commands(source, where)
            continue
        if cell["cell_type"] != "code":
            continue
        written = re.match(r"%%writefile\s+(\S+)\n", source)
        if written:
            runs = re.search(r"^from (distlab(?:\.\w+)+) import main$", source, re.M)
            if runs:
                scripts[written.group(1)] = runs.group(1)
            continue
        if source.startswith("%%"):
            continue
        try:
            _run_assignments(ast.parse(_code_of(source)).body, ns, protected)
        except SyntaxError:
            pass
        for line in source.splitlines():
            if line.lstrip().startswith("!"):
                command = _expand(line.lstrip()[1:], ns)
                for script, module in scripts.items():
                    command = re.sub(rf"(?<!\S){re.escape(script)}(?!\S)", f"-m {module}", command)
                found.append((where, command))
    return found


def _script_commands(path: Path) -> list[tuple[str, str]]:
    """``scripts/reproduce_results.sh``: its ``run RANKS MODULE ARGS`` lines as the ``run`` function runs them
    (``--device cpu`` added), and its plain ``python -m`` lines; loop variables take their first value."""
    found = []
    for number, line in _joined(path.read_text()):
        line = re.sub(r"\$\{?(n|r)\}?", lambda m: {"n": "2", "r": "1"}[m.group(1)], line)
        ran = re.match(r"\s*run\s+\S+\s+(distlab[\w.]*)(.*)$", line)
        if ran:
            line = f"python -m {ran.group(1)} {END_OF_COMMAND.split(ran.group(2))[0]} --device cpu"
        found.append((f"{path.relative_to(ROOT)}:{number}", line))
    return found


def module_command(line: str) -> tuple[str, list[str]] | None:
    """``(module, arguments)`` of a ``python``/``torchrun`` line that runs ``-m distlab...``; None for any other
    line; ValueError when its arguments cannot be known here (an unresolved expression, an ellipsis)."""
    match = MODULE_COMMAND.search(line)
    if not match or not LAUNCHER.search(line[: match.start()]):
        return None
    rest = END_OF_COMMAND.split(match.group(2))[0]
    if UNRESOLVED in rest or "$" in rest or "..." in rest:
        raise ValueError(f"arguments unknown here: {rest.strip()!r}")
    return match.group(1), shlex.split(rest)


def every_command() -> list[tuple[str, str, str]]:
    """(placement, where, line) of every candidate line, the notebooks' once per placement."""
    lines = []
    for path in [ROOT / "README.md", *sorted((ROOT / "book").rglob("*.md"))]:
        if "_build" not in path.parts:
            found = _markdown_commands(path.read_text(), str(path.relative_to(ROOT)))
            lines += [("", where, line) for where, line in found]
    lines += [("", where, line) for where, line in _script_commands(ROOT / "scripts" / "reproduce_results.sh")]
    placements = {place(gpus=g) for g in (0, 1, 2)} | {place(2, gpus=g) for g in (0, 1, 2)}
    for placement in sorted(placements, key=lambda p: (p.gpus, p.ranks, p.backend)):
        label = f"{placement.gpus} GPU(s), {placement.ranks} {placement.backend} rank(s) on {placement.device}"
        for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
            lines += [(label, where, line) for where, line in _notebook_commands(notebook, placement)]
    return lines


def check_commands(lines: list[tuple[str, str, str]]) -> tuple[list[str], set[str], list[str], list[str]]:
    """(what parsed, modules whose main names no configuration, what was refused, what could not be resolved)."""
    checked, unconfigured, refused, unknown = [], set(), [], []
    for placement, where, line in lines:
        try:
            command = module_command(line)
        except ValueError as err:
            unknown.append(f"{where}: {err}")
            continue
        if command is None:
            continue
        module, args = command
        if config_of(module) is None:
            unconfigured.add(module)
            continue
        if {"-h", "--help"} & set(args):
            continue
        why = refusal(module, args)
        label = f"{where}{f' [{placement}]' if placement else ''}: -m {module} {' '.join(args)}"
        (refused.append(f"{label}: {why}") if why else checked.append(label))
    return checked, unconfigured, refused, unknown


def test_every_distlab_command_line_in_the_notebooks_book_readme_and_script_parses():
    checked, unconfigured, refused, unknown = check_commands(every_command())
    assert not refused, "command lines their entry point refuses:\n" + "\n".join(refused)
    assert unconfigured <= set(NO_CONFIG), f"entry points with no configuration to check: {unconfigured}"
    sources = {label.split(":")[0].split(" cell ")[0].split(" (inline)")[0] for label in checked}
    # the lines this test finds today: it fails if the extraction silently stops finding them
    assert len({label.split(" [")[0] for label in checked}) >= 30, (checked, unknown)
    assert {"README.md", "scripts/reproduce_results.sh"} <= sources, sources
    assert len({source for source in sources if source.startswith("book/")}) >= 3, sources
    assert len({source for source in sources if source.startswith("notebooks/")}) >= 3, (sources, unknown)


def test_the_command_line_check_finds_a_refused_flag_an_invalid_value_and_a_notebook_variable():
    page = "```bash\ntorchrun --nproc_per_node=2 -m distlab.bench.transfer --device cuda \\\n  --out r\n```\n"
    page += "and `python -m distlab.bench.sweep\n--models gpt-nope` inline, `-m distlab.train` alone (no launcher)\n"
    lines = [("", where, line) for where, line in _markdown_commands(page, "page.md")]
    _, _, refused, _ = check_commands(lines)
    assert len(refused) == 2 and "unrecognized arguments: --device cuda" in refused[0], refused
    assert "unknown preset 'gpt-nope'" in refused[1]
    ns = _notebook_namespace(place(gpus=0))
    _run_assignments(ast.parse('RUN = " ".join(["--device", DEVICE, "--batch-size", "0"])').body, ns, {})
    line = _expand("{sys.executable} -m distlab.train --strategy ddp {RUN} {UNKNOWN}", ns)
    with pytest.raises(ValueError, match="unknown here"):
        module_command(line)
    _, _, refused, _ = check_commands([("", "cell", line.replace(UNRESOLVED, ""))])
    assert len(refused) == 1 and "--batch-size must be at least 1" in refused[0]


# (c) every entry point names its configuration


def _entry_points() -> list[types.ModuleType]:
    modules = []
    for package in (distlab.bench, distlab.demos):
        for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            module = importlib.import_module(info.name)
            if callable(getattr(module, "main", None)):
                modules.append(module)
    return modules


def test_every_bench_and_demo_entry_point_names_the_config_its_main_parses():
    missing = []
    for module in _entry_points():
        if module.__name__ in NO_CONFIG:
            continue
        config = getattr(module.main, "config", None)
        if not (isinstance(config, type) and is_dataclass(config)):
            missing.append(module.__name__)
    assert len(_entry_points()) >= 13
    assert not missing, f"entry points whose main is not made by distlab.cli.entry_point(<its config>): {missing}"
    report = importlib.import_module("distlab.gpu_report.__main__")
    assert entry_config("distlab.gpu_report") is report.GpuReportConfig
