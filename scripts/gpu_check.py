"""The GPU check for a maintainer with ten minutes of one GPU: one command, one folder, a non-zero exit on any failure.

    python scripts/gpu_check.py gpu-check                    # pip installs tests/gpu-requirements.txt first
    python scripts/gpu_check.py gpu-check --wheels wheels    # no network: install from a folder of wheels
    python scripts/gpu_check.py gpu-check --full             # the whole GPU tier (20 minutes or more)

From a checkout, on a machine with a CUDA GPU and torch. It installs what the GPU tier needs beyond torch, pytest
and matplotlib (``tests/gpu-requirements.txt``, every package pinned; never torch: the torchvision it needs is the
release built for the torch already there, installed without its dependencies where it is missing), runs the GPU
tier's quick selection (``pytest -m "gpu and quick"``: every GPU code path once, about 6 minutes on one GPU, 7.5
on two) with its durations, and keeps the quick GPU report that selection runs. The folder holds:

    environment.txt   the GPUs (nvidia-smi), Python, torch, CUDA, NCCL, the commit
    install.log       what pip did
    tier.log          pytest's output, every test's result and the durations of all of them
    durations.txt     every test's time, slowest first, from tier.xml
    tier.xml          pytest's JUnit XML
    report/           the quick GPU report (python -m distlab.gpu_report --quick), as the book reads one
    summary.txt       one line a step: what ran, how long, passed or failed

Without a GPU, or without torch, it says so in one line and exits 2: the GPU tier would only skip.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "tests" / "gpu-requirements.txt"
SELECTIONS = {"quick": "gpu and quick", "full": "gpu"}
STOP_S = {"quick": 600, "full": 3600}
"""When the tier is stopped. The quick selection's time on one GPU and on two is estimated test by test by
``tests/gpu_quick_estimate.py``, and ``tests/test_gpu_paths_on_cpu.py`` holds both under 80 % of this stop."""


def torchvision_for(torch_version: str) -> str:
    """The torchvision release built for a torch release: torch 2.N pairs with torchvision 0.(N + 15)
    (2.10 -> 0.25, 2.11 -> 0.26, 2.14 -> 0.29), as pytorch/vision's release table lists them."""
    major, minor = (int(part) for part in torch_version.split("+")[0].split(".")[:2])
    if major != 2:
        raise SystemExit(f"gpu_check: torch {torch_version}: the GPU tier needs torch 2.10 or newer")
    return f"torchvision=={0}.{minor + 15}.*"


def pip_install(args: list[str], wheels: Path | None, log) -> int:
    where = ["--no-index", "--find-links", str(wheels)] if wheels else []
    command = [sys.executable, "-m", "pip", "install", "--no-input", "--disable-pip-version-check", *where, *args]
    log.write(f"$ {shlex.join(command)}\n")
    log.flush()
    return subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode


def install(out: Path, wheels: Path | None) -> str:
    """Install the tier's packages; '' when done, else why not."""
    import torch

    with open(out / "install.log", "w") as log:
        if pip_install(["-r", str(REQUIREMENTS)], wheels, log) != 0:
            return f"pip could not install {REQUIREMENTS.relative_to(ROOT)}: install.log says why"
        if importlib.util.find_spec("torchvision") is None:  # never its dependencies: they would bring another torch
            if pip_install(["--no-deps", torchvision_for(torch.__version__)], wheels, log) != 0:
                return f"pip could not install {torchvision_for(torch.__version__)}: install.log says why"
    return ""


def environment(out: Path) -> None:
    lines = []
    git = ["git", "-C", str(ROOT)]
    gpus = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv"]
    for command in (gpus, [*git, "rev-parse", "HEAD"], [*git, "status", "--short"]):
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=60)
            lines.append(f"$ {shlex.join(command)}\n{done.stdout}{done.stderr}")
        except (OSError, subprocess.TimeoutExpired) as err:
            lines.append(f"$ {shlex.join(command)}\n{err}\n")
    import torch

    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-"
    lines.append(
        f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}\n"
    )
    (out / "environment.txt").write_text("\n".join(lines))


def durations(xml: Path) -> list[tuple[float, str, str]]:
    """Every test's time, its name and its outcome, slowest first, from pytest's JUnit XML."""
    rows = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        rows.append((float(case.get("time", 0)), f"{case.get('classname')}::{case.get('name')}", outcome))
    return sorted(rows, reverse=True)


def run_tier(out: Path, selection: str, timeout_s: float) -> tuple[int, str]:
    """pytest on the GPU tier, its output in tier.log; the exit status and one line."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
               PYTHONUNBUFFERED="1", DISTLAB_GPU_CHECK_REPORT=str(out / "report"))  # fmt: skip
    # tests/conftest.py's GPU_FILES
    tier = ["tests/test_gpu.py", "tests/test_gpu_labs.py", "tests/test_gpu_fp16.py", "tests/test_gpu_compile.py"]
    command = [sys.executable, "-m", "pytest", "-m", SELECTIONS[selection], *tier,
               "-rA", "--durations=0", f"--junitxml={out / 'tier.xml'}", "-p", "no:cacheprovider"]  # fmt: skip
    with open(out / "tier.log", "w") as log:
        log.write(f"$ {shlex.join(command)}\n")
        log.flush()
        try:
            code = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout_s).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            return 124, f"the {selection} selection ran past {timeout_s:.0f} s and was stopped: tier.log shows how far"
    if not (out / "tier.xml").is_file():
        return code or 1, "pytest wrote no tier.xml: tier.log says why"
    rows = durations(out / "tier.xml")
    (out / "durations.txt").write_text("".join(f"{s:8.1f} s  {outcome:<7}  {name}\n" for s, name, outcome in rows))
    counts = {kind: sum(1 for *_, outcome in rows if outcome == kind) for kind in ("passed", "failed", "error",
                                                                                    "skipped")}  # fmt: skip
    said = ", ".join(f"{n} {kind}" for kind, n in counts.items() if n)
    return code, f"pytest -m '{SELECTIONS[selection]}': {said or 'nothing ran'} (exit {code})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder to write (made if missing; must be empty if it exists)")
    parser.add_argument("--wheels", type=Path, help="install from this folder of wheels, without the network")
    parser.add_argument("--full", action="store_true", help="the whole GPU tier, not its quick selection")
    parser.add_argument("--no-install", action="store_true", help="the packages are there already")
    parser.add_argument("--timeout-s", type=float, default=None, help="stop the tier after this (quick: 600 s)")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:  # a virtualenv without torch: say so, not a traceback
        print("gpu_check: torch is not installed in this Python: run it with the Python that has the GPU's torch",
              file=sys.stderr)  # fmt: skip
        return 2
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here (torch.cuda.is_available() is False): the GPU tier would only skip; "
              "run it on a machine with one", file=sys.stderr)  # fmt: skip
        return 2
    if args.out.exists() and any(args.out.iterdir()):
        print(f"gpu_check: {args.out} is not empty: name a new folder", file=sys.stderr)
        return 2
    if args.wheels is not None and not args.wheels.is_dir():
        print(f"gpu_check: --wheels {args.wheels} is not a folder", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    out, started, summary, failed = args.out.resolve(), time.perf_counter(), [], False

    def step(name: str, problem: str, began: float, ok: bool) -> None:
        line = f"{name}: {'ok' if ok else 'FAILED'} in {time.perf_counter() - began:.0f} s"
        line += f": {problem}" if problem else ""
        print(f"gpu_check: {line}", flush=True)
        summary.append(line)

    began = time.perf_counter()
    environment(out)
    step("environment", "", began, True)
    if not args.no_install:
        began = time.perf_counter()
        problem = install(out, args.wheels)
        step("install", problem, began, not problem)
        failed |= bool(problem)
    if not failed:
        selection = "full" if args.full else "quick"
        began = time.perf_counter()
        print(f"gpu_check: the GPU tier's {selection} selection, output in {out / 'tier.log'} ...", flush=True)
        code, said = run_tier(out, selection, args.timeout_s or STOP_S[selection])
        step("tier", said, began, code == 0)
        failed |= code != 0
        if not (out / "report" / "report.json").is_file() and not any((out / "report").glob("*/report.json")):
            summary.append("report: none written (the report's test did not run or stopped before writing)")
            failed = True
    total = time.perf_counter() - started
    summary.append(f"total: {total:.0f} s; {'FAILED' if failed else 'passed'}")
    (out / "summary.txt").write_text("\n".join(summary) + "\n")
    print(f"gpu_check: {'FAILED' if failed else 'passed'} in {total:.0f} s; {out} holds the logs and the report")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
