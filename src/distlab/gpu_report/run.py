"""Run every GPU path the course has, within a time budget, into one report folder.

Each part is a benchmark or demo of the course run under torchrun with a time limit, writing its result file
into the report folder: the same entry points the chapters and ``scripts/reproduce_results.sh`` use, with
sizes that fit the GPUs found. :func:`plan` decides what runs with how many ranks, on which device and backend
(:func:`distlab.runtime.place`, the one decision every launcher makes), and says why anything does not; without
a GPU every part that can runs on 2 gloo ranks on the CPU, so CI executes the same code. A part's ranks are
told where they run (``--device``/``--backend``) when its entry point takes those flags, as its ``main.config`` says.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..bench.sweep import FSDP2_VARIANTS, VARIANTS, preset_parameters, resident_bytes_per_rank
from ..errors import DistlabError
from ..labs.launch import placement_args, torchrun
from ..measure.hardware import nccl_settings, set_nccl_transport, survey
from ..plots.gpu_report import save_pictures
from ..predict import gpu_predictions
from ..results import environment, read_result
from ..runtime import Placement, place
from . import schema, summary

SWEEP_PRESETS = ("gpt-mini", "gpt-small", "gpt-medium")
"""Presets the GPU sweep tries, smallest first; each runs where a batch that makes its step compute-dominated fits
beside all its strategies built at once (:func:`sweep_sizes`)."""
FSDP2_PRESETS = ("gpt-large", "gpt-xl", "gpt-2.7b")
"""Presets the FSDP2 point tries, smallest first, where no sized preset makes FSDP2's step compute-dominated: its
cost per call (about a millisecond, measured once: one H200 host, one rank, nothing sent, 8x256 tokens) is amortised
only by large units (:func:`sweep_sizes`)."""
SWEEP_SEQ_LEN = 256
"""Tokens per sequence of every sweep point (gpt-mini's longest); a point grows by its batch."""
LAUNCH_BOUND_BATCH = 8
"""The launch-bound point's sequences per rank: the first GPU run's size (8 x 256 tokens), kept as one point."""
SWEEP_STEPS, SWEEP_WARMUP = 8, 2
SWEEP_TIMEOUT_S = 420.0
SWEEP_PREDICTED_S = 300.0
"""The most a sized sweep may be predicted to take, its steps (:func:`distlab.predict.gpu_predictions.sweep_seconds`)
and its builds (:func:`build_seconds`): under the part's ``SWEEP_TIMEOUT_S``, for the launch-bound point, the
collectives, and a small model's MFU below the cited one. The report's other parts take about 100 s of its 600."""
BUILD_VALUES_PER_S = 30e6
"""How fast a rank draws a model's initial weights (on its CPU, seeded, module by module; every build draws the
whole model, whatever the world size): below the slowest rate measured, gpt-small on one H200's host, 33 M values
a second (tests/gpu-runs/2026-11-28-h200; gpt-medium drew 123 M/s there, and 50-58 M/s on a 2-core CPU)."""
FSDP_OPTIONS = ("fsdp", "explicit_prefetch", "prefetch_depth_2", "offload", "checkpointing")


@dataclass(frozen=True)
class Part:
    """One thing the report runs: ``target`` under torchrun on ``nproc`` ranks, writing ``<name>.json``; or,
    with ``skip``, why it does not run here."""

    name: str
    what: str
    target: str = ""
    args: tuple[str, ...] = ()
    nproc: int = 1
    timeout_s: float = 120.0
    skip: str = ""


@dataclass
class Machine:
    """What the plan depends on: how many GPUs, how much memory each, and whether they do bf16."""

    gpus: int
    memory_bytes: int = 0
    bf16: bool = False
    names: list[str] = field(default_factory=list)

    @classmethod
    def here(cls) -> Machine:
        """This machine, from its one GPU survey (:func:`distlab.measure.hardware.survey`)."""
        return cls.from_survey(survey(topology=False))

    @classmethod
    def from_survey(cls, facts: dict) -> Machine:
        """What the plan needs of a survey: the GPU count, the smallest GPU's memory, bf16, the names."""
        names = facts["gpus"]
        if not names:
            return cls(0)
        return cls(len(names), min(facts["memory_bytes"]), facts["bf16"], list(names))


def sweep_sizes(machine: Machine) -> list[gpu_predictions.SweepSize]:
    """Each GPU sweep preset at the batch where its step is compute-dominated on this machine's GPU
    (:func:`distlab.predict.gpu_predictions.sweep_size`: compute at the GPU's cited peak times its MFU at least three
    times the step's fixed costs, within its memory); the GPU found by name as the report's predictions find it, or
    the fallback figures for one the course cites nothing for. Presets that fit at no such batch are left out, and
    the largest ones while the sweep, its builds included, is predicted to take more than ``SWEEP_PREDICTED_S``.

    Where an FSDP2 variant is dominated at none of them, the last size is the FSDP2 point: the smallest of
    ``FSDP2_PRESETS`` at which every FSDP2 variant is, each run alone (:func:`fsdp2_size`)."""
    names = list(VARIANTS)
    system = gpu_predictions.system_for(machine.names)
    gpu = system.gpu if system is not None else gpu_predictions.FALLBACK_GPU
    precision = "bf16" if machine.bf16 else "fp16"
    sizes = []
    for preset in SWEEP_PRESETS:
        resident = resident_bytes_per_rank(preset, names, machine.gpus)
        size = gpu_predictions.sweep_size(
            gpu, preset, names, machine.gpus, SWEEP_SEQ_LEN, precision, machine.memory_bytes, resident, system
        )
        if size is not None:
            sizes.append(size)
    undominated = [v for v in FSDP2_VARIANTS if not any(v in size.dominated for size in sizes)]
    alone = fsdp2_size(machine, gpu, precision, system) if sizes and undominated else None
    budget = SWEEP_PREDICTED_S - (planned_seconds([alone]) if alone else 0)
    while sizes and planned_seconds(sizes) > budget:
        sizes.pop()
    return sizes + [alone] if sizes and alone else sizes


def build_seconds(sizes: list[gpu_predictions.SweepSize]) -> float:
    """The sweep's builds at ``BUILD_VALUES_PER_S``: a shared point builds the calibration copy and every variant,
    then every variant again, alone, for CUDA's peaks; the FSDP2 point builds each of its variants once."""
    values = 0
    for size in sizes:
        builds = len(size.step_s) if size.alone else 2 * len(size.step_s) + 1
        values += builds * preset_parameters(size.model)
    return values / BUILD_VALUES_PER_S


def planned_seconds(sizes: list[gpu_predictions.SweepSize]) -> float:
    """A sized sweep's predicted time: its steps and its builds."""
    return gpu_predictions.sweep_seconds(sizes, SWEEP_STEPS + SWEEP_WARMUP) + build_seconds(sizes)


def fsdp2_size(machine: Machine, gpu, precision: str, system) -> gpu_predictions.SweepSize | None:
    """The FSDP2 point: the smallest of ``FSDP2_PRESETS`` at which every FSDP2 variant's step is compute-dominated,
    each variant built alone with no calibration copy (so the largest one's state is what stays resident)."""
    for preset in FSDP2_PRESETS:
        resident = max(resident_bytes_per_rank(preset, [v], machine.gpus, calibrated=False) for v in FSDP2_VARIANTS)
        size = gpu_predictions.sweep_size(
            gpu, preset, FSDP2_VARIANTS, machine.gpus, SWEEP_SEQ_LEN, precision, machine.memory_bytes, resident,
            system, alone=True,
        )  # fmt: skip
        if size is not None and set(size.dominated) == set(FSDP2_VARIANTS):
            return size
    return None


def sized_presets(machine: Machine) -> list[str]:
    """The GPU sweep's presets: those with a compute-dominated batch that fits (:func:`sweep_sizes`)."""
    return [size.model for size in sweep_sizes(machine)]


def plan(machine: Machine, quick: bool = False) -> list[Part]:
    """Every part, with its ranks, device, backend and sizes for this machine (``quick``: the smallest that still
    runs each path; on a GPU, the sweep's launch-bound point and its smallest sized one, without FSDP2's own
    point, which the GPU tests run apart, copies and NCCL's collectives up to 64 MB, and FSDP2's options on
    gpt-mini). Where the parts run is :func:`~distlab.runtime.place`'s answer for ``machine.gpus``: one NCCL rank
    per GPU; without a GPU, 2 gloo ranks in bf16 autocast, the GPU's code path, at CPU sizes. A part that needs two
    ranks is skipped on one GPU (NCCL needs one GPU per rank; gloo ranks sharing it would measure gloo)."""
    every = place(gpus=machine.gpus)  # the parts that run on every rank the machine has
    alone = place(1, gpus=machine.gpus)  # the host's and the copies' measurements: one rank
    cuda = every.device == "cuda"
    one_gpu = "" if every.ranks >= 2 else "NCCL needs one GPU per rank, and this machine has one"
    precision = "fp16" if cuda and not machine.bf16 else "bf16"
    sized = sweep_sizes(machine) if cuda else []
    sized = sized[:1] if quick else sized
    variants = ",".join(FSDP_OPTIONS + (("bf16",) if machine.bf16 or not cuda else ()))
    host = "--sizes 4MB --repeats 3" if quick else "--sizes 4MB,64MB --repeats 3"
    # quick on GPUs: NCCL's collectives to 64 MB, five times, the code path within the quick selection's time (T3)
    sizes = "--sizes " + (
        "64KB:64MB" if cuda and quick else "64KB:256MB" if cuda else "64KB:1MB" if quick else "64KB:16MB"
    )
    sizes += " --repeats " + ("5" if cuda and quick else "10" if cuda else "3")
    if sized:  # each preset at its compute-dominated batch, after the smallest one at the launch-bound size
        shared = [s for s in sized if not s.alone]
        sweep = (
            f"--models {','.join(s.model for s in shared)} --batch-sizes {','.join(str(s.batch) for s in shared)} "
            f"--launch-bound {sized[0].model} --batch-size {LAUNCH_BOUND_BATCH} --seq-len {SWEEP_SEQ_LEN} "
            f"--steps {SWEEP_STEPS} --warmup {SWEEP_WARMUP} "
        )
        sweep += "".join(f"--fsdp2-point {s.model}:{s.batch} " for s in sized if s.alone)
    elif cuda:  # too small a GPU for any compute-dominated size: the launch-bound point alone
        sweep = f"--models gpt-mini --batch-size {LAUNCH_BOUND_BATCH} --seq-len {SWEEP_SEQ_LEN} --steps 10 --warmup 2 "
    else:
        sweep = "--models gpt-tiny --steps 3 --warmup 1 "
    sweep += f"--precision {precision} --collective-sizes " + (
        "1MB:64MB --collective-repeats 5" if cuda else "64KB:1MB --collective-repeats 2"
    )
    options = f"--variants {variants} " + (
        f"--model {'gpt-mini' if quick else 'gpt-small'} --seq-len 256 --steps 10 --warmup 2"
        if cuda
        else "--model gpt-tiny --seq-len 64 --steps 2 --warmup 1"
    )
    copies = f"--sizes 64KB:{'64MB' if quick else '256MB'} --repeats 5 --loader-epochs 0"

    def part(name, what, target, args, where: Placement = every, timeout_s=240.0, skip=""):
        # --device/--backend go to the entry points that take them (their main.config says), never by module name
        return Part(name, what, target, (*placement_args(target, where), *args.split()), where.ranks, timeout_s, skip)

    return [
        part("host", "the host side of a copy: page-locking, staging copies (distlab.bench.host)",
             "distlab.bench.host", host, where=alone, timeout_s=120),
        part("copies", "host-to-device copies: pageable, pinned, non_blocking, overlap with compute "
             "(distlab.bench.transfer)", "distlab.bench.transfer", copies, where=alone,
             skip="" if alone.device == "cuda" else "needs a CUDA device"),
        part("collectives", "all-reduce, reduce-scatter and all-gather over sizes (distlab.bench.shard_collectives)",
             "distlab.bench.shard_collectives", sizes, skip=one_gpu),
        part("sweep", "DDP, ZeRO-1/2/3 and FSDP2 on GPT presets in mixed precision (distlab.bench.sweep)",
             "distlab.bench.sweep", sweep, timeout_s=SWEEP_TIMEOUT_S),
        part("fsdp-options", "FSDP2's prefetch depth 1 and 2, CPU offload, activation checkpointing "
             "(distlab.bench.fsdp_options)", "distlab.bench.fsdp_options", options),
        part("batch-norm", "BatchNorm, its statistics all-reduced, and SyncBatchNorm under DDP "
             "(distlab.demos.ddp_knobs)", "distlab.demos.ddp_knobs", "--demos batch_norm", timeout_s=120,
             skip=one_gpu and "DDP's BatchNorm case needs two ranks; " + one_gpu),
    ]  # fmt: skip


def not_run(machine: Machine) -> list[dict]:
    """What no part can reach on this machine, and why: the rest of every GPU path runs on the CPU too."""
    if machine.gpus == 0:
        return [
            {
                "what": "torch.cuda.max_memory_allocated and max_memory_reserved per strategy "
                "(distlab.bench.step.cuda_peaks)",
                "reason": "they need a CUDA device",
            },
            {"what": "NCCL", "reason": "no GPU: the collectives, the sweep and FSDP2 ran on gloo"},
            {
                "what": "SyncBatchNorm training under DDP",
                "reason": "DDP refuses SyncBatchNorm on CPU modules; the batch-norm part records that refusal",
            },
            {"what": schema.CITED_PREDICTIONS, "reason": "no GPU to compare them with"},
        ]
    if summary.system_for(machine.names) is None:
        return [
            {
                "what": schema.CITED_PREDICTIONS,
                "reason": "the course cites T4, A100 40 GB, H100 SXM and H200 SXM specifications, "
                f"not {machine.names[0]}'s",
            }
        ]
    return []


def scrub(folder: Path) -> None:
    """Take this machine's paths and its name out of every text file: a report is shared."""
    here = str(folder.resolve())
    # the longest first: a short name inside a longer one (alice-laptop in alice-laptop.home) would leave its tail
    names = [
        re.compile(rf"(?<![\w.-]){re.escape(name)}(?![\w-])") for name in sorted(machine_names(), key=len, reverse=True)
    ]
    for path in folder.glob("*.json"):
        text = schema.MACHINE_PATH.sub("<path>", path.read_text().replace(here, ".").replace(str(folder), "."))
        for name in names:
            text = name.sub("<host>", text)
        path.write_text(text)


def machine_names() -> set[str]:
    """This machine's names, as a command line or a log may hold them (too short a name would match words)."""
    return {name for name in (socket.gethostname(), socket.getfqdn()) if len(name) > 2}


def run_part(part: Part, folder: Path, seconds_left: float) -> dict:
    """Run one part, at most ``seconds_left``; what happened, in the report's form."""
    row = {"name": part.name, "what": part.what, "ranks": part.nproc, "files": []}
    if part.skip:
        return row | {"status": "skipped", "reason": part.skip}
    if seconds_left < 15:
        return row | {"status": "skipped", "reason": "the report's time budget was spent"}
    started = time.perf_counter()
    try:
        torchrun(part.target, *part.args, "--out", str(folder), "--name", part.name, nproc=part.nproc, echo=False,
                 timeout_s=min(part.timeout_s, seconds_left))  # fmt: skip
    except DistlabError as err:  # it failed or ran out of time: the report says which, and goes on
        return row | {"status": "failed", "reason": str(err), "seconds": round(time.perf_counter() - started, 1)}
    row["seconds"] = round(time.perf_counter() - started, 1)
    result = folder / f"{part.name}.json"
    if not result.is_file():
        return row | {"status": "failed", "reason": f"{part.target} wrote no {result.name}"}
    return row | {"status": "ran", "files": [result.name]}


def summarize(folder: Path, parts: list[dict], machine: Machine) -> dict:
    """The report's at-a-glance rows, from the result files that were written."""
    system = summary.system_for(machine.names)
    out = {}
    for part in parts:
        key = part["name"].replace("-", "_")  # the summary a part has, if any, is named after it
        if part["status"] == "ran" and key in summary.SUMMARIES:
            out[key] = summary.SUMMARIES[key](read_result(folder / part["files"][0]), system)
    return out


def interconnect(facts: dict) -> str:
    """GPU 0 to GPU 1 as ``nvidia-smi topo -m`` names it, and peer access; or why there is no link to name."""
    if len(facts["gpus"]) < 2:
        return "one GPU" if facts["gpus"] else "no GPU"
    link = None
    for line in (facts.get("topology") or "").splitlines():
        cells = line.split()
        if cells[:1] == ["GPU0"] and len(cells) > 2:
            link = cells[2]
    peer = "peer access" if facts["peer_access"][0][1] else "no peer access"
    return f"{link or 'link unknown'} between GPU0 and GPU1, {peer}"


def new_folder(out: Path, machine: Machine, ranks: int) -> Path:
    """A fresh report folder under ``out``, named after the GPU, the ranks it ran on and the time."""
    kind = re.sub(r"[^a-z0-9]+", "-", (machine.names[0] if machine.names else "cpu").lower()).strip("-")
    folder = out / f"{kind}-{ranks}x-{_dt.datetime.now(_dt.UTC):%Y%m%d-%H%M%S}"
    folder.mkdir(parents=True)
    return folder


def finish(folder: Path, machine: Machine, report: dict) -> Path:
    """Write ``report.json`` with the machine's environment and the report's pictures, take out this machine's
    paths, and check the folder as the book will (ValueError, in one line, if it fails). A report with a failed
    part is written all the same, marked ``"status": "failed"``: the book refuses it (:func:`schema.problems`),
    and whoever ran it learns why from each part's reason."""
    facts = survey()
    env = environment() | {"device_kind": "cuda" if machine.gpus else "cpu", "gpu_count": machine.gpus}
    env |= {"interconnect": interconnect(facts), "dev_shm": facts["dev_shm"], "nccl_settings": nccl_settings()}
    status = "failed" if schema.failed_parts(report) else "complete"
    env |= {"topology": facts["topology"]}
    report = {"schema": schema.REPORT_SCHEMA, "status": status, "environment": env, **report}
    for pictures in (False, True):
        if pictures:
            report["pictures"] = save_pictures(schema.check(folder, failed_ok=True), folder)
        (folder / schema.REPORT_FILE).write_text(json.dumps(report, indent=1, default=str) + "\n")
        scrub(folder)
    schema.check(folder, failed_ok=True)
    return folder


def write_report(out: Path, contributor: str = "", budget_s: float = 600, quick: bool = False) -> Path:
    """Run every part into a new folder under ``out``; write ``report.json`` and its pictures; check it (all but
    its failed parts, which mark it ``"status": "failed"``: :func:`schema.failed_parts` lists them)."""
    facts = survey(topology=False)
    machine = Machine.from_survey(facts)
    every = place(gpus=machine.gpus)  # the ranks the report's parts run on, decided once
    folder = new_folder(out, machine, every.ranks)
    deadline = time.perf_counter() + budget_s
    print(f"gpu_report: {every.reason}", flush=True)
    # GPUs without peer access (a T4 pair): every part's NCCL runs with this transport, and the report says so
    print(f"gpu_report: {set_nccl_transport(facts)}", flush=True)
    parts = []
    for part in plan(machine, quick):
        print(f"gpu_report: {part.name}: {part.skip or part.what}", flush=True)
        parts.append(run_part(part, folder, deadline - time.perf_counter()))
        if parts[-1]["status"] == "failed":
            print(f"gpu_report: {part.name} failed: {parts[-1]['reason']}", flush=True)
    scrub(folder)
    report = {"contributor": contributor or None, "ranks": every.ranks, "budget_s": budget_s, "parts": parts}
    report |= {"not_run": not_run(machine), "summary": summarize(folder, parts, machine)}
    return finish(folder, machine, report)
