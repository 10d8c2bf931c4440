"""``python -m distlab.gpu_report``: every GPU path of the course, run and written as one report folder.

It exits 0 only when every part ran or was skipped with a reason, and the folder passed the book's check; a part
that failed still leaves the folder, marked failed, and the command names each failed part with its reason and
exits 1."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..cli import entry_point, option
from ..errors import run_main
from .run import write_report
from .schema import REPORT_FILE, check, failed_parts


@dataclass
class GpuReportConfig:
    """Run every GPU path the course has (on gloo ranks without a GPU) and write one report folder."""

    out: str = option("gpu-reports", "folder to write the report's folder into")
    contributor: str = option("", "your name or handle, shown with the report in the book (optional)")
    budget_s: float = option(600.0, "seconds for everything; a part that would start after them is skipped")
    quick: bool = option(False, "the smallest sizes that still run every path (what CI runs)")


@entry_point(GpuReportConfig, "distlab.gpu_report")
def main(cfg: GpuReportConfig) -> None:
    folder = write_report(Path(cfg.out), cfg.contributor, cfg.budget_s, cfg.quick)
    report = check(folder, failed_ok=True)
    failed = failed_parts(report)
    if failed:
        print(f"gpu_report: wrote {folder}, marked failed: {len(failed)} of its {len(report['parts'])} parts failed, "
              "so it does not pass the book's check:")  # fmt: skip
        for part in failed:
            print(f"gpu_report:   {part['name']}: {part['reason']}")
        print("gpu_report: fix what failed (each line above is the job's own error) and run it again.")
        raise SystemExit(1)
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
