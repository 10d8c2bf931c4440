"""``python -m distlab.gpu_report``: every GPU path of the course, run and written as one report folder."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..cli import option, parse
from ..errors import run_main
from .run import write_report
from .schema import REPORT_FILE


@dataclass
class GpuReportConfig:
    """Run every GPU path the course has (on gloo ranks without a GPU) and write one report folder."""

    out: str = option("gpu-reports", "folder to write the report's folder into")
    contributor: str = option("", "your name or handle, shown with the report in the book (optional)")
    budget_s: float = option(600.0, "seconds for everything; a part that would start after them is skipped")
    quick: bool = option(False, "the smallest sizes that still run every path (what CI runs)")


def main(argv: list[str] | None = None) -> None:
    cfg = parse(GpuReportConfig, argv, "distlab.gpu_report")
    folder = write_report(Path(cfg.out), cfg.contributor, cfg.budget_s, cfg.quick)
    print(f"gpu_report: wrote {folder} ({REPORT_FILE}, the result files, the pictures); it passed the book's check.")
    if folder.name.startswith("cpu-"):
        print(
            "gpu_report: it ran on a CPU, to check every GPU path; the course collects reports from GPUs: run it "
            "there, then add the folder under book/results/gpu/ with a pull request."
        )
    else:
        print("gpu_report: to add it to the course, open a pull request that puts the folder under book/results/gpu/.")


if __name__ == "__main__":
    run_main(main)
