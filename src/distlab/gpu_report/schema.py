"""What a GPU report holds, the check it must pass before the book shows it, and the markdown the book prints.

A report is a folder: ``report.json`` (this schema), the result files of what ran (each a distlab result
with its environment), and pictures. :func:`problems` lists everything wrong with one, in one line each;
:func:`read_reports` reads the valid reports under a folder (``book/results/gpu``) and refuses an invalid one.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path
from typing import Any

from ..plots.gpu_report import regime
from ..plots.gpu_report import report_label as label
from ..predict.gpu_predictions import COMPUTE_DOMINATED, system_for
from ..results import SCHEMA as RESULT_SCHEMA

REPORT_SCHEMA = "distlab.gpu_report/1"
REPORT_FILE = "report.json"
PROVENANCE_FILE = "provenance.json"
HOSTNAME_KEY = re.compile(r'"hostname"\s*:')
"""A machine's name as a result file once recorded it: a report is shared, and names no machine."""
CITED_PREDICTIONS = "predictions from cited GPU specifications"
"""What a report's ``not_run`` calls the predictions, where the course cites nothing for its GPU."""
PROVENANCE_KEYS = ("code", "changes", "says")
"""What :data:`PROVENANCE_FILE` must say, beside a report measured with code other than a commit of the course as it
is (an earlier commit with local changes, say), or one whose method predates a fix: what ran, in words the page
shows. Such a report is shown with its failed parts, each labelled."""
STATUSES = ("ran", "skipped", "failed")
REPORT_STATUSES = ("complete", "failed")
"""A report's own status: ``failed`` when any of its parts failed. It is written all the same, so whoever ran it
can read why; the book shows only complete ones."""
ENVIRONMENT_KEYS = ("torch", "python", "gpus", "device_kind", "cuda", "nccl", "date", "gpu_count")
LARGEST_FILE = 8 * 2**20
LARGEST_REPORT = 32 * 2**20
LARGEST_NUMBER = 1e18
MACHINE_PATH = re.compile(
    r"(/home/|/root/|/Users/|/kaggle/|/tmp/|/var/folders/|/private/|(?:(?<!\w)|(?<=\\[nrt]))[A-Za-z]:\\)[^\s\"']*"
)
r"""A path that names someone's machine: a report is shared, and its files must not carry one. A Windows drive is
one letter standing alone (or after an escaped newline or tab, in JSON), then a backslash: ``C:\\Users`` in JSON,
``C:\Users`` in text; the ``d:`` of a word before JSON's ``\n`` (``"Legend:\n"``) is none."""
TEXT_SUFFIXES = (".json", ".md", ".txt")


def _numbers(value: Any, where: str):
    """Every number in a JSON value, with where it is."""
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield where, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _numbers(item, f"{where}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _numbers(item, f"{where}[{index}]")


def _load(path: Path) -> Any:
    """JSON, with NaN and Infinity refused (Python's json would accept them)."""

    def refuse(constant: str):
        raise ValueError(f"{constant} is not a measurement")

    return json.loads(path.read_text(), parse_constant=refuse)


def _file_problems(folder: Path, name: str) -> list[str]:
    path = folder / name
    if "/" in name or "\\" in name or name.startswith("."):
        return [f"{name}: a report's files sit in its folder, by plain name"]
    if not path.is_file():
        return [f"{name}: listed in {REPORT_FILE} but missing"]
    if path.stat().st_size > LARGEST_FILE:
        return [f"{name}: {path.stat().st_size:,} bytes, more than {LARGEST_FILE:,}"]
    if path.suffix != ".json":
        return []
    try:
        record = _load(path)
    except ValueError as err:
        return [f"{name}: not JSON a report may hold ({err})"]
    if record.get("schema") != RESULT_SCHEMA or "environment" not in record:
        return [f"{name}: not a distlab result file (schema {RESULT_SCHEMA!r} with its environment)"]
    return [f"{name}: {where} = {number}" for where, number in _numbers(record, "") if not _sane(number)][:3]


def _sane(number: float) -> bool:
    return math.isfinite(number) and abs(number) < LARGEST_NUMBER


def failed_parts(report: dict) -> list[dict]:
    """The parts of a report that should have run and did not (each with its reason)."""
    return [part for part in report.get("parts") or [] if isinstance(part, dict) and part.get("status") == "failed"]


def problems(folder: str | Path, *, failed_ok: bool = False) -> list[str]:
    """Everything that keeps a report folder from the book, one line each (empty: valid). Checked: the schema,
    the report's status (a part that failed keeps it out, with its reason), the environment (versions, GPUs,
    date), each part's status and reason, every file listed (present, small, a distlab result with its
    environment, numbers finite and of sane size), and no machine path anywhere. ``failed_ok``: everything but
    the failed parts (what ``python -m distlab.gpu_report`` checks before it says which parts failed)."""
    folder = Path(folder)
    try:
        report = _load(folder / REPORT_FILE)
    except FileNotFoundError:
        return [f"{folder.name}: no {REPORT_FILE}"]
    except ValueError as err:
        return [f"{folder.name}/{REPORT_FILE}: not JSON a report may hold ({err})"]
    found = []
    if report.get("schema") != REPORT_SCHEMA:
        found.append(f"{REPORT_FILE}: schema is {report.get('schema')!r}, not {REPORT_SCHEMA!r}")
    failed, status = failed_parts(report), report.get("status", "complete")
    if status not in REPORT_STATUSES:
        found.append(f"{REPORT_FILE}: status {status!r}, not one of {', '.join(REPORT_STATUSES)}")
    elif "status" in report and (status == "failed") != bool(failed):
        found.append(f"{REPORT_FILE}: status {status!r} with {len(failed)} failed part(s)")
    if not failed_ok:
        found += [f"part {part.get('name', '?')} failed: {part.get('reason') or 'no reason given'}" for part in failed]
    environment = report.get("environment") or {}
    found += [f"{REPORT_FILE}: environment has no {key!r}" for key in ENVIRONMENT_KEYS if key not in environment]
    parts = report.get("parts")
    if not isinstance(parts, list) or not parts:
        found.append(f"{REPORT_FILE}: no parts")
        parts = []
    for part in parts:
        name = part.get("name", "?")
        if part.get("status") not in STATUSES:
            found.append(f"part {name}: status {part.get('status')!r}, not one of {', '.join(STATUSES)}")
        if part.get("status") != "ran" and not part.get("reason"):
            found.append(f"part {name}: {part.get('status')} without a reason")
        for file in part.get("files", []):
            found += _file_problems(folder, file)
    found += [f"{REPORT_FILE}: {where} = {n}" for where, n in _numbers(report, "") if not _sane(n)][:3]
    total = 0
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        total += path.stat().st_size
        if path.suffix in TEXT_SUFFIXES and path.stat().st_size <= LARGEST_FILE:
            text = path.read_text(errors="replace")
            match = MACHINE_PATH.search(text)
            if match:
                found.append(f"{path.relative_to(folder)}: a machine path, {match.group(0)[:60]!r}")
            if HOSTNAME_KEY.search(text):
                found.append(f"{path.relative_to(folder)}: names the machine (a 'hostname'): a shared report does not")
    if total > LARGEST_REPORT:
        found.append(f"the folder holds {total:,} bytes, more than {LARGEST_REPORT:,}")
    return found


def check(folder: str | Path, *, failed_ok: bool = False) -> dict:
    """The report in ``folder``, or ValueError with every problem in one line (``failed_ok``: as
    :func:`problems`)."""
    found = problems(folder, failed_ok=failed_ok)
    if found:
        raise ValueError(f"{Path(folder).name} is not a valid GPU report: " + "; ".join(found))
    return _load(Path(folder) / REPORT_FILE) | {"folder": Path(folder)}


def read_reports(root: str | Path) -> list[dict]:
    """Every report folder under ``root``, checked, oldest first; none if ``root`` does not exist. A report
    with a :data:`PROVENANCE_FILE` carries it as ``report["provenance"]``, and may hold failed parts."""
    root = Path(root)
    folders = sorted(p.parent for p in root.glob(f"*/{REPORT_FILE}")) if root.is_dir() else []
    reports = []
    for folder in folders:
        provenance = _provenance(folder)
        report = check(folder, failed_ok=provenance is not None)
        reports.append(report | ({"provenance": provenance} if provenance is not None else {}))
    return sorted(reports, key=lambda report: report["environment"]["date"])


def _provenance(folder: Path) -> dict | None:
    path = folder / PROVENANCE_FILE
    if not path.is_file():
        return None
    provenance = _load(path)
    missing = [key for key in PROVENANCE_KEYS if not provenance.get(key)]
    if missing:
        raise ValueError(f"{folder.name}/{PROVENANCE_FILE}: no {', '.join(missing)}")
    return provenance


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows])


NO_REPORT = (
    "No GPU report is committed yet: run `python -m distlab.gpu_report` on a machine with GPUs and add its "
    "folder under `book/results/gpu/` (the section below says how)."
)


def reports_markdown(reports: list[dict]) -> str:
    """One row per report: what it ran on, its versions, when, and who ran it if they said."""
    if not reports:
        return NO_REPORT
    rows = []
    for report in reports:
        env = report["environment"]
        rows.append(
            [
                label(report),
                "quick" if is_quick(report) else "full",
                env.get("interconnect") or "unknown",
                env["torch"],
                env["cuda"] or "none",
                env["nccl"] or "none",
                env["date"][:10],
                report.get("contributor") or "not given",
            ]
        )
    return _table(["measured on", "report", "interconnect", "torch", "CUDA", "NCCL", "date", "run by"], rows)


def is_quick(report: dict) -> bool:
    """Whether the report is a quick one (``--quick``: the launch-bound point and one sized preset)."""
    return "--quick" in (report["environment"].get("command") or "")


def report_markdown(report: dict) -> str:
    """One report: each strategy measured against the course's models, the collectives' bus bandwidth, the
    copies, and what did not run and why. Every number is labelled with the hardware it was measured on, and
    every sweep row with its regime: its ranks (one rank sends nothing) and its predicted compute over its fixed
    costs, a launch-bound row saying that it measures the host."""
    summary = report.get("summary", {})
    blocks = _heading_blocks(report) + _sweep_blocks(summary.get("sweep", []))
    blocks += _measured_tables(summary)
    blocks += _what_did_not_run(report)
    return "\n\n".join(blocks)


def _heading_blocks(report: dict) -> list[str]:
    """Where and when it was measured, and which code ran."""
    kind = ", quick report" if is_quick(report) else ""
    blocks = [f"**Measured on {label(report)}** ({report['environment']['date'][:10]}{kind})"]
    provenance = report.get("provenance")
    if provenance:
        changes = "; ".join(provenance["changes"])
        blocks.append(f"*Code that ran*: {provenance['code']}, with {changes}. {provenance['says']}")
    return blocks


def _sweep_blocks(sweep: list[dict]) -> list[str]:
    """Each strategy's step against the models, with its regime and the caveats its numbers need."""
    if not sweep:
        return []
    blocks = []
    if all(r["ranks"] == 1 for r in sweep):
        blocks.append(
            "One rank: nothing is sent between ranks, so these rows measure what each strategy costs around the "
            "same arithmetic, not its communication. A row whose fixed costs are predicted to outweigh its "
            "arithmetic is launch-bound: it measures the host (Python, launches, hooks) more than the GPU; one "
            f"whose predicted compute is under {COMPUTE_DOMINATED:.0f}x its fixed costs may still show the host."
        )
    rows = [
        [
            _point(r),
            r["variant"],
            _ranks(r),
            f"{1e3 * r['measured_s']:.1f}",
            _rate(r),
            "" if r.get("compute_over_fixed") is None else f"{r['compute_over_fixed']:.2g}x",
            _left_out_ms(r),
            _model_ms(r),
            _range(r.get("predicted_s")) if r.get("predicted_s") or not r.get("unpredicted") else r["unpredicted"],
            _mib(r.get("counted_peak")),
            _cuda(r, "cuda_max_allocated"),
            _cuda(r, "cuda_max_reserved"),
        ]
        for r in sweep
    ]
    blocks.append(
        _table(
            [
                "preset, tokens per rank",
                "strategy",
                "ranks",
                "measured ms",
                "achieved TFLOP/s (share of the cited peak)",
                "compute / fixed costs, PREDICTED",
                "cost model ms, this point left out of its fit (error)",
                "fit ms, every point of the run in it, this one too (error)",
                "PREDICTED ms from cited specs (arithmetic, optimizer, collectives; no fixed costs)",
                "counted MiB",
                "CUDA max allocated MiB",
                "CUDA max reserved MiB",
            ],
            rows,
        )
    )
    blocks += _model_errors(sweep)
    if any(r.get("cuda_alone") is False for r in sweep):
        blocks.append(
            "CUDA's counters in this sweep are the whole process's: it built every strategy and a calibration "
            "copy at once, so they are not each strategy's own (the counted bytes are). Later sweeps take each "
            "strategy's peak with that strategy alone."
        )
    return blocks


def _measured_tables(summary: dict) -> list[str]:
    """The collectives' bandwidth, the copies, FSDP2's options and BatchNorm under DDP, each where measured."""
    blocks = []
    collectives = summary.get("collectives", [])
    if collectives:
        rows = [
            [
                c["collective"],
                c["impl"],
                _size(c["bytes"]),
                f"{c['busbw_GBps']:.2f}",
                "no fit: time did not grow with size" if c["fit_bus_GBps"] is None else f"{c['fit_bus_GBps']:.2f}",
                f"{1e6 * c['fit_alpha_s']:.1f}",
                c.get("cited_busbw_GBps") or "none",
            ]
            for c in collectives
        ]
        blocks.append(
            _table(
                [
                    "collective",
                    "implementation",
                    "largest size",
                    "bus GB/s there",
                    "alpha-beta fit, GB/s",
                    "fit alpha, us",
                    "cited for this GPU, GB/s",
                ],
                rows,
            )
        )
    copies = summary.get("copies", [])
    if copies:
        rows = [[c["direction"], c["mode"], _size(c["bytes"]), f"{c['GBps']:.2f}"] for c in copies]
        blocks.append(_table(["copy", "memory", "size", "GB/s"], rows))
    options = summary.get("fsdp_options", [])
    if options:
        rows = [
            [
                o["variant"],
                o["change"],
                f"{1e3 * o['time_s']:.1f}",
                f"{o['vs_default']:.2f}x",
                _mib(o.get("cuda_max_allocated")),
            ]
            for o in options
        ]
        blocks.append(
            _table(["FSDP2 option", "what changes", "step ms", "vs defaults", "CUDA max allocated MiB"], rows)
        )
    batch_norm = summary.get("batch_norm", {})
    if batch_norm:
        rows = [[name, _difference(row)] for name, row in batch_norm.items()]
        blocks.append(_table(["under DDP", "against one process on the whole batch"], rows))
    return blocks


def _what_did_not_run(report: dict) -> list[str]:
    """The parts that failed, with why, and those not run, with why."""
    blocks = []
    failed = failed_parts(report)
    if failed:
        why = (report.get("provenance") or {}).get("failed", {})
        blocks.append("Failed: " + "; ".join(f"{p['name']} ({why.get(p['name']) or p.get('reason')})" for p in failed))
    # a report from before the course cited its GPU said the predictions could not run; the page makes them now
    cited = system_for(report["environment"].get("gpus") or []) is not None
    not_run = [n for n in report.get("not_run", []) if not (cited and n["what"] == CITED_PREDICTIONS)]
    skipped = [part for part in report["parts"] if part["status"] == "skipped"] + not_run
    if skipped:
        blocks.append("Not run: " + "; ".join(f"{p.get('name') or p.get('what')} ({p['reason']})" for p in skipped))
    return blocks


def _difference(row: dict) -> str:
    if "ddp_error" in row:
        return f"refused: {row['ddp_error']}"
    same = "equal within tolerance" if row["equal_within_tolerance"] else "differs"
    return (
        f"{same}: weights {row['weights_max_abs_diff']:.1e}, running statistics {row['running_stats_max_abs_diff']:.1e}"
    )


def _model_errors(sweep: list[dict]) -> list[str]:
    """One line under the sweep's table: the cost model's errors with each point left out of its own fit (the test),
    and with every point in it (a fit), so that nobody reads the second as the first."""
    tested = [r["left_out_error"] for r in sweep if r.get("left_out_error") is not None]
    fitted = [r["error"] for r in sweep if r.get("error") is not None]
    if not fitted:
        return []
    fit = (
        f"fitted to every point of the run, each in its own fit: from {100 * min(fitted):+.0f} % to "
        f"{100 * max(fitted):+.0f} % (a fit: it says how well the rates bend through these points, not whether "
        "the model predicts)"
    )
    if not tested:
        return [f"The cost model {fit}. The run has too few calibrated points to leave one out."]
    median = statistics.median(abs(e) for e in tested)
    return [
        f"The cost model with each point left out of its own fit: from {100 * min(tested):+.0f} % to "
        f"{100 * max(tested):+.0f} %, median |error| {100 * median:.0f} %, over {len(tested)} points; {fit}."
    ]


def _error(seconds: float, error: float | None) -> str:
    percent = None if error is None else round(100 * error)
    return f"{1e3 * seconds:.1f}" + ("" if percent is None else f" ({percent:+d} %)" if percent else " (0 %)")


def _left_out_ms(row: dict) -> str:
    """The cost model's step with this point left out of every fit it uses: the model's test. A run with too few
    calibrated points to leave one out says so (a summary written before the course left points out, none)."""
    if row.get("left_out_s") is not None:
        return _error(row["left_out_s"], row.get("left_out_error"))
    if row["model_s"] is None:
        return "no calibration at this point"
    if "calibrated_points" not in row:
        return "not computed when this summary was written"
    return f"{row['calibrated_points']} calibrated points: too few to leave one out"


def _model_ms(row: dict) -> str:
    """The cost model fitted to every point of the run, this one included: a fit, not a test. On several ranks
    without each strategy's own cost, which only a one-rank run measures apart from what it sends (the chapter's
    model adds it from such a run), and the cell says so."""
    if row["model_s"] is None:
        return "no calibration at this point"
    without = "" if row.get("model_has_strategy_cost", True) else " (without the strategy's own cost)"
    return f"{_error(row['model_s'], row.get('error'))}{without}"


def _ranks(row: dict) -> str:
    return "1 (nothing sent)" if row["ranks"] == 1 else str(row["ranks"])


REGIME_NOTES = {
    "launch-bound": " (launch-bound: measures the host)",
    "host may show": f" (predicted compute under {COMPUTE_DOMINATED:.0f}x: the host may show)",
}


def _point(row: dict) -> str:
    tokens = f", {row['tokens_per_rank']:,}" if row.get("tokens_per_rank") else ""
    note = " (FSDP2 alone)" if row.get("point") == "fsdp2-sized" else ""
    return f"{row['model']}{tokens}{note}{REGIME_NOTES.get(regime(row), '')}"


def _cuda(row: dict, key: str) -> str:
    """CUDA's counter: each strategy's own, or, in a sweep that built every strategy at once, the whole process's."""
    cell = _mib(row.get(key))
    return cell + " (whole process)" if row.get("cuda_alone") is False and row.get(key) is not None else cell


def _rate(row: dict) -> str:
    if row.get("tflops") is None:
        return "not recorded"
    share = "" if row.get("peak_share") is None else f" ({100 * row['peak_share']:.1f} %)"
    return f"{row['tflops']:.1f}{share}"


def _range(values: list[float] | None) -> str:
    return "none for this GPU" if not values else f"{1e3 * values[0]:.1f}-{1e3 * values[1]:.1f}"


def _mib(value: float | None) -> str:
    return "not measured" if value is None else f"{value / 2**20:.1f}"


def _size(value: int) -> str:
    return f"{value / 2**20:.0f} MiB" if value >= 2**20 else f"{value / 2**10:.0f} KiB"
