"""A lab's own runs as a GPU report: what the lab measured, in the form the book's "Measured on GPUs" shows.

The last cell of every lab calls :func:`report_from_results` on the folder its runs wrote their result files
into. The report holds those files, the machine's environment, and what the lab did not run; it is checked
as the book checks a contribution, and the cell says how to contribute it.
"""

from __future__ import annotations

import fnmatch
import shutil
from collections.abc import Sequence
from pathlib import Path

from ..results import read_result
from .run import Machine, finish, new_folder, not_run

CONTRIBUTE = (
    "To add it to the course: download the folder (on Kaggle, from the Output panel), and open a pull request "
    "that puts it under book/results/gpu/; the page 'Measured on GPUs' then shows it, labelled with your GPUs."
)


def lab_result_files(results: str | Path, names: Sequence[str] | None = None) -> list[Path]:
    """The ``*.json`` files in ``results`` whose names (without ``.json``) match one of the glob patterns ``names``
    (every one when ``names`` is None): a lab names its own runs, so the labs may share one ``results/``."""
    paths = sorted(Path(results).glob("*.json"))
    if names is None:
        return paths
    return [path for path in paths if any(fnmatch.fnmatchcase(path.stem, pattern) for pattern in names)]


def report_from_results(
    results: str | Path,
    lab: str,
    out: str | Path = "gpu-reports",
    contributor: str = "",
    names: Sequence[str] | None = None,
):
    """The distlab result files in ``results`` (others are left out) as one report folder under ``out``;
    its path, or None (with one line saying why) when there is nothing to report or it fails the check. With
    ``names`` (glob patterns of the run names ``lab`` wrote), only those: another lab's files in the same folder
    stay out of this lab's report."""
    files, world_sizes = [], []
    for path in lab_result_files(results, names):
        try:
            record = read_result(path)
        except (OSError, ValueError):  # not a result file: the hardware facts, a checkpoint's meta
            continue
        files.append(path)
        world_sizes.append(record.get("environment", {}).get("world_size") or 1)
    if not files:
        print(f"{lab}: no result file in {results}/ yet: run the lab's cells above first, then this one")
        return None
    machine = Machine.here()
    ranks = max(world_sizes)  # what the lab's runs were placed on, as their files say, never decided again here
    folder = new_folder(Path(out), machine, ranks)
    for path in files:
        shutil.copy(path, folder / path.name)
    what = f"the runs of {lab}"
    part = {"name": lab, "what": what, "status": "ran", "ranks": ranks, "files": [p.name for p in files]}
    rest = {
        "what": "the course's other GPU paths",
        "reason": "a lab runs its own: python -m distlab.gpu_report runs all",
    }
    report = {"contributor": contributor or None, "ranks": ranks, "parts": [part], "summary": {}}
    try:
        finish(folder, machine, report | {"not_run": [rest, *not_run(machine)]})
    except ValueError as err:
        print(f"{lab}: the report in {folder} did not pass the book's check: {err}")
        return None
    print(f"{lab}: wrote the report {folder} ({len(files)} result files); it passed the book's check.")
    if machine.gpus:
        print(CONTRIBUTE)
    else:
        print("It ran on a CPU: checked like a GPU report, but the course collects reports from GPUs.")
    return folder
