"""distlab: data-parallel training in PyTorch, from pinned memory to FSDP.

The library behind the course: one training loop for every strategy, the
from-scratch versions the chapters build, and the benchmarks that write
result files with provenance.

The package is laid out by role. The training library that ``python -m distlab.train`` runs is the flat spine
at this level, one concept a module, in two tiers: the core, which knows nothing of strategies, and the run,
which puts a training run together from the core and the strategies. Around it, one package per role, each of
whose docstrings says what belongs there and, in its last line, which parts of distlab it may import:
parallel (strategies), comm (collectives), measure (instruments), predict (analytic models), bench
(benchmarks), demos (chapter demos), plots (figures), labs (notebook helpers), exercises and gpu_report.
Demos, benchmarks and plots use the library, never the reverse; predictions use nothing that runs ranks.
tests/test_layout.py holds the code to these lines, and to one direction between tiers and packages: no
import, not even one for type checking, closes a circle among them.

Core: errors, runtime, jobs, models, results, cli, data. May import: comm, measure.
Run: config, train, checkpoint, testing. May import: core, parallel, comm, measure.

Supported: Python 3.11 or newer and torch 2.10 or newer (Kaggle's image
carries Python 3.12 and torch 2.10; the book pins what ``constraints.txt``
lists). Older versions are refused on import, in one line.
"""

import importlib.util
import sys
from importlib import metadata

__version__ = "0.1.0"
OLDEST_PYTHON = (3, 11)
OLDEST_TORCH = (2, 10)


def unsupported(python: tuple[int, ...], torch_version: str | None) -> str | None:
    """Why this Python and torch (``None``: not installed) cannot run distlab, or None when they can."""
    if tuple(python[:2]) < OLDEST_PYTHON:
        found = ".".join(map(str, python[:3]))
        return f"distlab needs Python {'.'.join(map(str, OLDEST_PYTHON))} or newer, this is Python {found}"
    oldest = ".".join(map(str, OLDEST_TORCH))
    if torch_version is None:
        return f"distlab needs torch {oldest} or newer, and torch is not installed: pip install -r requirements.txt"
    release = tuple(int(part) for part in torch_version.split("+")[0].split(".")[:2] if part.isdigit())
    if release < OLDEST_TORCH:
        return f"distlab needs torch {oldest} or newer, this is torch {torch_version}: pip install 'torch>={oldest}'"
    return None


def _refuse_unsupported() -> None:
    # Read from the installed package's metadata: importing torch here would make every module pay for it,
    # and the predictions (predict.gpu_specs, predict.streams) are made to run without torch.
    torch_version = None
    if sys.version_info[:2] >= OLDEST_PYTHON:  # an older Python is refused before torch is looked for
        try:
            torch_version = metadata.version("torch")
        except metadata.PackageNotFoundError:
            if importlib.util.find_spec("torch") is not None:
                return  # a torch built from source without metadata: nothing to check against
    reason = unsupported(sys.version_info, torch_version)
    if reason:
        raise SystemExit(f"distlab: error: {reason}")


_refuse_unsupported()
