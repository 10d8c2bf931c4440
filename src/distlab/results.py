"""Result files with provenance.

Every number distlab reports is written by :func:`write_result` as JSON with
what was measured, the configuration, and the environment it was measured in.
Plots read the hardware label from that environment, never from the caller.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from .runtime import Runtime

SCHEMA = "distlab.result/1"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    """The course's own commit (``-dirty`` with uncommitted code changes), read from the checkout this package
    sits in at ``<checkout>/src/distlab``; None where that is not a checkout of its own (a wheel, or a copy of
    the course inside another repository, whose commit says nothing about this code)."""
    here = Path(__file__).resolve().parent
    try:
        top = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], cwd=here, capture_output=True, text=True, timeout=5
        )
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() != here.parents[1]:
            return None
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
        )
        # Result files being written do not make the code that writes them dirty.
        code_changes = [
            "git",
            "status",
            "--porcelain",
            "--untracked-files=no",
            "--",
            ":(top)",
            ":(top,exclude)book/results",
        ]
        dirty = subprocess.run(
            code_changes,
            cwd=here,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _command_line() -> str:
    """How this process was started (``python -u -m distlab.train ...`` under torchrun)."""
    argv = list(getattr(sys, "orig_argv", sys.argv))
    if argv:
        argv[0] = Path(argv[0]).name
    return " ".join(argv)


def environment(runtime: Runtime | None = None) -> dict[str, Any]:
    """What a reader needs to know to trust, or redo, a measurement: versions,
    machine, commit, command, and where the job ran (backend, ranks, device). The GPUs are the machine's one
    survey's (:func:`distlab.measure.hardware.survey`)."""
    from .measure.hardware import survey

    facts = survey(topology=False)
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpus": facts["gpus"],
        "nccl": facts["nccl"],
        "git_commit": _git_commit(),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": _command_line(),
        "backend": None,
        "world_size": 1,
    }
    env["nccl_transport"] = nccl_transport(facts)
    if runtime is not None:
        device = runtime.device
        env.update(backend=runtime.backend, world_size=runtime.world_size, device=str(device))
        env["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else env["cpu"]
    return env


def nccl_transport(facts: dict[str, Any]) -> dict[str, Any]:
    """What decides how NCCL moves data between this machine's GPUs, from its survey: the ``NCCL_*``
    settings in effect, peer access between every pair of GPUs, and ``/dev/shm``."""
    from .measure.hardware import nccl_settings

    return {"settings": nccl_settings(), "peer_access": facts["peer_access"], "dev_shm": facts["dev_shm"]}


def hardware_label(env: dict[str, Any]) -> str:
    """The machine a result was measured on, for plot titles: GPU name and
    backend on CUDA, CPU model and core count otherwise. A one-rank GPU run
    names no backend: it sends nothing between ranks (T8 of gpu-audit-2)."""
    if str(env.get("device", "cpu")).startswith("cuda"):
        gpus = env.get("gpus") or [env.get("device_name")]
        between = f" ({env.get('backend')})" if (env.get("world_size") or 1) > 1 else ""
        return f"{len(gpus)} x {env.get('device_name')}{between}"
    return f"CPU: {env.get('cpu')}, {env.get('cpu_count')} cores ({env.get('backend') or 'no backend'})"


def write_result(
    path: str | os.PathLike, kind: str, config: dict[str, Any], metrics: Any, runtime: Runtime | None = None
) -> Path:
    """Write one result file atomically; the caller decides which rank writes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"schema": SCHEMA, "kind": kind, "config": config, "metrics": metrics, "environment": environment(runtime)}
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(record, indent=2, default=str) + "\n")
    tmp.replace(path)
    return path


def committed_results(*parts: str) -> Path:
    """``book/results/<parts>`` of this checkout, found from the package itself
    (chapters execute in a scratch directory, so relative paths would break)."""
    here, cwd = Path(__file__).resolve(), Path.cwd().resolve()
    for folder in (*here.parents, cwd, *cwd.parents):  # the working directory itself: a checkout's root
        candidate = folder / "book" / "results"
        if candidate.is_dir():
            return candidate.joinpath(*parts)
    raise FileNotFoundError("no book/results folder above the distlab package or the working directory")


def read_result(path: str | os.PathLike) -> dict[str, Any]:
    record = json.loads(Path(path).read_text())
    if record.get("schema") != SCHEMA or "environment" not in record:
        raise ValueError(f"{path} is not a distlab result file (no schema {SCHEMA!r} or no environment)")
    return record
