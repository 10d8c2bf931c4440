"""The GPUs a lab got, and what decides how NCCL moves data between them.

NCCL picks a transport for each pair of GPUs in one machine: peer-to-peer (P2P, one GPU reads and writes
the other's memory over NVLink or PCIe) where the pair has peer access, and otherwise shared host memory
(SHM, each hop staged through pinned host buffers). What decides it is gathered by :func:`survey`: peer
access between every pair (``torch.cuda.can_device_access_peer``), the topology the driver reports
(``nvidia-smi topo -m``), and the size of ``/dev/shm``, where NCCL's SHM buffers live when its cuMem host
allocations are off. The labs print :func:`describe` and :func:`set_nccl_transport` in one line each and
:func:`save` the facts next to their results. On a CPU the GPU facts are empty and ``/dev/shm`` is still
measured.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Mapping, MutableMapping

import torch

# What the labs are written for, and where Kaggle's notebook editor sets it.
EXPECTED_GPUS, EXPECTED_MODEL = 2, "T4"
KAGGLE_SETTING = 'on Kaggle: Settings > Accelerator > "GPU T4 x2"'


def _topology() -> str | None:
    """``nvidia-smi topo -m``: how each pair of GPUs is connected (PIX, PHB, NODE, SYS, NV#), or None."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def _dev_shm(path: str = "/dev/shm") -> dict[str, int] | None:
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return {"total_bytes": stat.f_blocks * stat.f_frsize, "free_bytes": stat.f_bavail * stat.f_frsize}


def survey(topology: bool = True) -> dict[str, Any]:
    """The one survey of this machine's GPUs: their names, memory, whether they do bf16 in hardware, and the facts
    that decide NCCL's transport. ``peer_access[i][j]``: can GPU i access GPU j's memory (None on the diagonal); an
    empty list without GPUs. ``topology=False`` skips ``nvidia-smi``."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    peer = lambda i, j: None if i == j else torch.cuda.can_device_access_peer(i, j)
    return {
        "gpus": [torch.cuda.get_device_name(i) for i in range(count)],
        "memory_bytes": [torch.cuda.get_device_properties(i).total_memory for i in range(count)],
        "bf16": bool(count) and torch.cuda.is_bf16_supported(including_emulation=False),
        "peer_access": [[peer(i, j) for j in range(count)] for i in range(count)],
        "topology": _topology() if count and topology else None,
        "dev_shm": _dev_shm(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if count else None,
    }


def describe(facts: dict[str, Any]) -> str:
    """One line: the GPUs this machine has, and whether they are what the labs are written for."""
    names, expected = facts["gpus"], f"{EXPECTED_GPUS} x {EXPECTED_MODEL}"
    if not names:
        return (
            f"No CUDA GPU here, not the {expected} this lab is written for ({KAGGLE_SETTING}): it runs its CPU version."
        )
    got = ", ".join(f"{names.count(name)} x {name}" for name in dict.fromkeys(names))
    if len(names) == EXPECTED_GPUS and all(EXPECTED_MODEL in name for name in names):
        return f"{got}: the hardware this lab is written for."
    return f"{got}, not the {expected} this lab is written for ({KAGGLE_SETTING}): the numbers are this machine's."


def _pairs_without_peer_access(facts: dict[str, Any]) -> list[tuple[int, int]]:
    matrix = facts["peer_access"]
    return [(i, j) for i, row in enumerate(matrix) for j, ok in enumerate(row) if i < j and not (ok and matrix[j][i])]


def set_nccl_transport(facts: dict[str, Any], environ: MutableMapping[str, str] = os.environ) -> str:
    """Set ``NCCL_P2P_DISABLE=1`` only where some pair of GPUs has no peer access, and say why in one line.

    NCCL would find the missing peer access itself and use SHM; setting it says so up front. With it goes
    ``NCCL_CUMEM_HOST_ENABLE=0``: NCCL's cuMem host buffers (its default since 2.24) ask for peer access
    between the GPUs and fail with CUDA error 217 where there is none (NVIDIA/nccl#1838, seen on T4s), so
    SHM falls back to files in ``/dev/shm``, whose size is then what limits it (Docker's default is 64 MiB,
    too small for NCCL: NVIDIA/nccl#342). A value already in ``environ`` is kept and reported.
    """
    count = len(facts["gpus"])
    if count == 0:
        line = "NCCL: not used here (no CUDA GPU); the ranks talk through gloo. Nothing set."
    elif count == 1:
        line = "NCCL: one GPU, so no pair of GPUs to connect. Nothing set."
    elif not (missing := _pairs_without_peer_access(facts)):
        line = "NCCL: every pair of GPUs has peer access (torch.cuda.can_device_access_peer), P2P allowed. Nothing set."
    else:
        wanted = {"NCCL_P2P_DISABLE": "1", "NCCL_CUMEM_HOST_ENABLE": "0"}
        kept = {name: environ[name] for name in wanted if name in environ and environ[name] != wanted[name]}
        for name, value in wanted.items():
            environ.setdefault(name, value)
        pairs = ", ".join(f"{i} and {j}" for i, j in missing)
        shm = facts["dev_shm"]
        size = f"{shm['total_bytes'] / 2**30:.1f} GiB here" if shm else "size unknown"
        line = (
            f"NCCL: GPUs {pairs} have no peer access (torch.cuda.can_device_access_peer), so "
            + ", ".join(f"{name}={environ[name]}" for name in wanted)
            + (f" (kept from the environment: {', '.join(kept)})" if kept else "")
            + f": data moves through host shared memory, /dev/shm ({size})."
        )
    facts["nccl_transport"] = line
    return line


NOT_NCCL_SETTINGS = ("NCCL_VERSION",)
"""``NCCL_*`` variables that NCCL does not read: NVIDIA's CUDA images set ``NCCL_VERSION`` to the NCCL they ship
(2.28.3-1 on the H200's), which is neither a setting nor the NCCL torch runs (its own, :func:`survey`'s ``nccl``)."""


def nccl_settings(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The ``NCCL_*`` settings in effect: what the ranks launched from here will run with."""
    return {
        name: value
        for name, value in sorted(environ.items())
        if name.startswith("NCCL_") and name not in NOT_NCCL_SETTINGS
    }


def save(facts: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write the facts as JSON with the NCCL_* variables set now, what the ranks launched next will inherit."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**facts, "nccl_env": nccl_settings()}, indent=2) + "\n")
    return path
