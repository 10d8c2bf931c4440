"""Every bad input a user can give ``distlab.train``, as data: the command, what is wrong, the line the
user sees, the fix. :func:`try_rows` runs them; the tests and the troubleshooting chapter both read
:data:`BAD_INPUTS`, so the table a reader sees is the table that is tested.

Each row must end with a non-zero exit and one line (``distlab: error: ...``, written by rank 0 only), and
leave nothing behind: no result file, no checkpoint, nothing changed in the folders it was given. Only a
port already in use is answered by torchrun itself (its agent fails to listen before any rank starts), in
the last line of its own traceback. A mistake that does not depend on the number of ranks is tried in one
process (``python -m distlab.train``): every rank would make it the same way, and each process started
costs seconds of imports.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from ..labs.launch import launcher_environment, run_job
from ..results import write_result

QUICK = ("--model", "cnn", "--device", "cpu", "--max-steps", "2", "--batch-size", "16", "--synthetic-size", "256")
QUICK += ("--num-workers", "0", "--log-every", "-1", "--eval-batch-size", "256")
"""A run of a few seconds; a row's own flags come after these and override them."""


@contextmanager
def busy_port(folder: Path, saved: Path | None) -> Iterator[dict[str, str]]:
    """A port something else listens on, for as long as the row runs."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield {"port": str(sock.getsockname()[1])}


def copied_checkpoint(damage: Callable[[Path], None] | None = None):
    """The shared checkpoint (see :func:`save_checkpoint`), copied into the row's folder, then ``damage``d."""

    @contextmanager
    def prepare(folder: Path, saved: Path | None) -> Iterator[dict[str, str]]:
        checkpoints = folder / "checkpoints"
        shutil.copytree(saved, checkpoints)
        if damage is not None:
            damage(checkpoints / (checkpoints / "latest").read_text().strip())
        yield {}

    return prepare


def truncate_shards(step: Path) -> None:
    """Every shard file cut to half its bytes, as a full disk or a copy interrupted leaves it."""
    for shard in step.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def garble_index(step: Path) -> None:
    """DCP's index (which tensor is where) overwritten with bytes that are not one."""
    (step / ".metadata").write_bytes(b"not a checkpoint index " * 8)


@dataclass(frozen=True)
class BadInput:
    """One row of the table."""

    name: str
    mistake: str
    flags: tuple[str, ...]
    """``distlab.train``'s flags; ``{folder}`` is the row's own folder (DIR in the table), ``{port}`` a port in use."""
    says: str
    """What the line the user sees must contain."""
    fix: str
    ranks: int = 2
    """torchrun's ``--nproc_per_node``; 0 runs ``python -m distlab.train``, no launcher."""
    launcher: tuple[str, ...] = ("--standalone",)
    prepare: Callable | None = None
    """A context manager ``(folder, saved_checkpoint) -> placeholders`` the row runs inside."""
    answered_by: str = "distlab"
    needs_checkpoint: bool = False
    needs_no_gpu: bool = False

    def command(self, placeholders: dict[str, str] | None = None, quick: tuple[str, ...] = ()) -> list[str]:
        """The command as a user types it (``torchrun ...``), ``quick`` flags before the row's own."""
        fill = lambda arg: arg.format(**placeholders) if placeholders else arg
        start = ["python"] if self.ranks == 0 else ["torchrun", *self.launcher, f"--nproc_per_node={self.ranks}"]
        return [fill(arg) for arg in (*start, "-m", "distlab.train", *quick, *self.flags)]


CHECKPOINT = ("--checkpoint-dir", "{folder}/checkpoints")
BAD_INPUTS = [
    BadInput("single-on-2-ranks", "--strategy single started on 2 ranks", ("--strategy", "single"),
             "--nproc_per_node=1", "torchrun --nproc_per_node=1 (single is one process), or a parallel strategy"),
    BadInput("zero-batch", "a batch smaller than one sample per rank (--batch-size is per rank)",
             ("--batch-size", "0"), "--batch-size must be at least 1", "--batch-size 1 or more: it counts per rank",
             ranks=0),
    BadInput("fewer-samples-than-ranks", "1 training sample for 2 ranks", ("--synthetic-size", "1"),
             "each rank has only 0 batch(es)", "a dataset with at least ranks x --batch-size samples"),
    BadInput("dataset-missing-offline", "--dataset mnist, not downloaded, with --no-download",
             ("--dataset", "mnist", "--no-download", "--data-dir", "{folder}/empty"), "--dataset synthetic",
             "download it once online (drop --no-download), point --data-dir at it, or --dataset synthetic", ranks=0),
    BadInput("cuda-without-gpu", "--device cuda on a machine with no GPU", ("--device", "cuda"),
             "has no usable CUDA GPU", "--device cpu (gloo), or run where a GPU is", ranks=0, needs_no_gpu=True),
    BadInput("nccl-on-cpu", "--backend nccl with --device cpu", ("--device", "cpu", "--backend", "nccl"),
             "use --backend gloo", "--backend gloo (or auto) on a CPU; nccl needs CUDA tensors", ranks=0),
    BadInput("port-in-use", "torchrun --master-port on a port another process listens on", (),
             "EADDRINUSE", "--standalone (torchrun picks a free port) or another --master-port",
             launcher=("--master-port={port}",), prepare=busy_port, answered_by="torchrun"),
    BadInput("reshard-group-not-dividing", "--fsdp-reshard-to 3 on 2 ranks: groups of 3 ranks cannot tile 2",
             ("--strategy", "fsdp", "--fsdp-reshard-to", "3"), "must divide the 2 ranks",
             "a divisor of the world size (the GPUs of one node), or 0"),
    BadInput("replicas-not-dividing", "--fsdp-replicate 3 on 2 ranks: 3 replicas cannot tile 2 ranks",
             ("--strategy", "fsdp", "--fsdp-replicate", "3"), "must divide the 2 ranks",
             "a divisor of the world size (the number of nodes, say), or 1"),
    BadInput("resume-missing", "--resume names a folder that holds no checkpoint",
             ("--resume", "{folder}/nowhere"), "no checkpoint there", "a step-N folder, a --checkpoint-dir, or auto",
             ranks=0),
    BadInput("checkpoint-truncated", "the latest checkpoint's shard files cut in half", CHECKPOINT,
             "could not be loaded", "resume from an earlier step-N folder, or --resume none",
             prepare=copied_checkpoint(truncate_shards), needs_checkpoint=True),
    BadInput("checkpoint-corrupt", "the latest checkpoint's index overwritten with other bytes", CHECKPOINT,
             "could not be loaded", "resume from an earlier step-N folder, or --resume none",
             prepare=copied_checkpoint(garble_index), needs_checkpoint=True, ranks=0),
    BadInput("checkpoint-other-model", "resuming the CNN's checkpoint with --model gpt-tiny",
             (*CHECKPOINT, "--model", "gpt-tiny"), "holds a cnn model", "the checkpoint's --model, or --resume none",
             prepare=copied_checkpoint(), needs_checkpoint=True, ranks=0),
    BadInput("checkpoint-other-layout", "a ddp checkpoint resumed by --strategy zero3 (flat shards)",
             (*CHECKPOINT, "--strategy", "zero3"), "cannot load", "a strategy of the same layout, or --resume none",
             prepare=copied_checkpoint(), needs_checkpoint=True, ranks=0),
]  # fmt: skip


def python_command(command: list[str]) -> list[str]:
    """``torchrun``/``python`` as this interpreter runs them."""
    launcher = [sys.executable, "-m", "torch.distributed.run"] if command[0] == "torchrun" else [sys.executable]
    return launcher + command[1:]


def save_checkpoint(folder: Path, timeout_s: float = 300) -> Path:
    """A real checkpoint the checkpoint rows start from: the quick run, ddp on 2 gloo ranks, saved at its end."""
    checkpoints = Path(folder) / "saved"
    command = ["torchrun", "--standalone", "--nproc_per_node=2", "-m", "distlab.train", *QUICK]
    command += ["--checkpoint-dir", str(checkpoints), "--out", str(Path(folder) / "saved-result")]
    done = run_job(python_command(command), timeout=timeout_s, env=launcher_environment(1))
    if done.returncode != 0:
        raise RuntimeError(f"the run that saves the shared checkpoint failed: {done.stderr[-2000:]}")
    return checkpoints


@dataclass
class Outcome:
    """What trying one row gave."""

    row: BadInput
    returncode: int
    line: str
    """The line the user sees: rank 0's ``distlab: error``, or torchrun's own last line (the row's folder as DIR)."""
    distlab_lines: list[str]
    traceback_before_line: bool
    left_behind: list[str] = field(default_factory=list)
    seconds: float = 0.0
    output: str = ""


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder``, with what would show it was written: its size and modification time."""
    files = [path for path in folder.rglob("*") if path.is_file()]
    return {str(path.relative_to(folder)): (path.stat().st_size, path.stat().st_mtime_ns) for path in files}


def try_row(row: BadInput, folder: Path, saved: Path | None = None, timeout_s: float = 120) -> Outcome:
    """Run ``row`` in ``folder`` and see what the user would: the line, the exit code, what was left behind."""
    folder.mkdir(parents=True, exist_ok=True)
    with row.prepare(folder, saved) if row.prepare else nullcontext({}) as placeholders:
        before = _files(folder)
        command = python_command(row.command({"folder": str(folder), **placeholders}, QUICK))
        command += ["--out", str(folder / "out")]
        started = time.perf_counter()
        done = run_job(command, timeout=timeout_s, env=launcher_environment(1))
        seconds = time.perf_counter() - started
    after = _files(folder)
    stderr = done.stderr.replace(str(folder), "DIR")  # where the row ran says nothing to a reader
    ours = [line for line in stderr.splitlines() if line.startswith("distlab:")]
    errors = [line for line in ours if line.startswith("distlab: error")]
    last = [line for line in stderr.splitlines() if line.strip()][-1:] or [""]
    line = errors[0] if errors else last[0]
    return Outcome(
        row, done.returncode, line, ours, "Traceback" in stderr.split(line)[0] if line else True,
        sorted(name for name, stat in after.items() if before.get(name) != stat), seconds,
        done.stdout[-2000:] + stderr[-3000:],
    )  # fmt: skip


def try_rows(rows: list[BadInput], folder: Path, parallel: int = 2) -> list[Outcome]:
    """Every row, ``parallel`` at a time, each in its own folder; the checkpoint rows from one saved run."""
    folder = Path(folder)
    saved = save_checkpoint(folder) if any(row.needs_checkpoint for row in rows) else None
    with ThreadPoolExecutor(parallel) as pool:
        return list(pool.map(lambda row: try_row(row, folder / row.name, saved), rows))


def table_rows(outcomes: list[Outcome]) -> list[dict[str, object]]:
    """What the troubleshooting chapter's table shows of each outcome: the command as typed (DIR for its folder)."""
    return [
        {"name": o.row.name, "mistake": o.row.mistake, "fix": o.row.fix, "returncode": o.returncode, "line": o.line,
         "command": " ".join(o.row.command({"folder": "DIR", "port": "PORT"})), "left_behind": o.left_behind}
        for o in outcomes
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Try every row and write what the user saw to a result file (the troubleshooting chapter's table)."""
    parser = argparse.ArgumentParser(prog="python -m distlab.demos.bad_inputs", description=main.__doc__)
    parser.add_argument("--out", default="results", help="folder of the result file bad-inputs.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="distlab-bad-inputs-") as work:
        outcomes = try_rows(BAD_INPUTS, Path(work))
    path = write_result(Path(args.out) / "bad-inputs.json", "bad_inputs", {"quick": list(QUICK)}, table_rows(outcomes))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
