"""A lab's report holds that lab's runs only (labs-1 L15): run from notebooks/, the labs share one results/."""

from __future__ import annotations

import json
from pathlib import Path

from distlab.gpu_report import lab
from distlab.gpu_report.run import Machine
from distlab.results import read_result

BOOK_DDP = Path(__file__).resolve().parents[1] / "book" / "results" / "ddp"


def test_a_labs_report_leaves_out_another_labs_files_in_the_same_folder(monkeypatch, tmp_path):
    """Reproduced in labs-1: the DDP lab's report took lab 0's three files as "the runs of lab_ddp_mnist"."""
    results = tmp_path / "results"
    results.mkdir()
    committed = next(p for p in sorted(BOOK_DDP.glob("*.json")) if read_result(p)["environment"]["world_size"] == 2)
    for name in ("lab0-single", "lab0-ddp", "mnist-ddp-dataloader", "mnist-ddp-step"):
        (results / f"{name}.json").write_text(committed.read_text())
    (results / "hardware.json").write_text(json.dumps({"gpus": []}))
    monkeypatch.setattr(Machine, "here", classmethod(lambda cls: Machine(0, 0, False, [])))
    written = {}
    monkeypatch.setattr(lab, "finish", lambda folder, machine, report: written.update(report) or folder)
    folder = lab.report_from_results(results, "lab_ddp_mnist", out=tmp_path / "reports", names=["mnist-*"])
    assert written["parts"][0]["files"] == ["mnist-ddp-dataloader.json", "mnist-ddp-step.json"]
    assert sorted(p.name for p in folder.iterdir()) == ["mnist-ddp-dataloader.json", "mnist-ddp-step.json"]
