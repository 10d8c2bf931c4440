"""Bundle the course for Kaggle: the distlab wheel as a dataset, and every lab as a notebook on "GPU T4 x2".

    python scripts/kaggle.py <kaggle-user>              # writes _build/kaggle/ (git-ignored), then says what next
    kaggle datasets create -p _build/kaggle/distlab-wheel
    kaggle datasets status <kaggle-user>/distlab-wheel  # until it says ready
    kaggle kernels push -p _build/kaggle/distlab-lab0-first-run

The labs install distlab from the wheel they find under /kaggle/input (scripts/lab_setup.py, the start of
each lab's first code cell), with --no-deps, so Kaggle's torch is never replaced. ``--git URL`` adds a second
route, a cell that sets DISTLAB_SOURCE to that URL; without it no repository URL appears anywhere.

    python scripts/kaggle.py --apply-setup notebooks/<lab>.ipynb

gives a lab notebook that set-up (replacing its old install block) and Kaggle's "GPU T4 x2" metadata.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "scripts" / "lab_setup.py"
LABS = sorted((ROOT / "notebooks").glob("lab*.ipynb"))
OUT = ROOT / "_build" / "kaggle"
DATASET = "distlab-wheel"

# What Kaggle's editor saves in a notebook set to "GPU T4 x2" (the .ipynb quoted in Kaggle/kaggle-cli#821;
# nvidiaTeslaT4 is T4 x2, single T4s are no longer offered: Kaggle/kaggle-cli#1198). No dockerImageVersionId:
# a pinned image overrides the one the machine would get (Kaggle/kaggle-cli#1197).
KAGGLE_METADATA = {
    "accelerator": "nvidiaTeslaT4",
    "isGpuEnabled": True,
    "isInternetEnabled": True,
    "language": "python",
    "sourceType": "notebook",
}
# kernel-metadata.json's name for "GPU T4 x2" (Kaggle/kaggle-cli docs/kernels_metadata.md after #1198).
# Without it pushes have landed on a P100, which today's Kaggle torch cannot run (Kaggle/kaggle-cli#1156).
MACHINE_SHAPE = "NvidiaTeslaT4"


def slugify(title: str) -> str:
    """Kaggle's slug of a title: lower case, every run of other characters one dash."""
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def lab_title(lab: Path) -> str:
    """``distlab lab0 first run``: letters, digits and spaces only, so it slugifies one way, to the id."""
    return f"distlab {lab.stem.replace('_', ' ')}"


def read_notebook(path: Path) -> dict:
    return json.loads(path.read_text())


def write_notebook(notebook: dict, path: Path) -> None:
    path.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")  # as Jupyter writes it


def first_code_cell(notebook: dict) -> dict:
    return next(cell for cell in notebook["cells"] if cell["cell_type"] == "code")


def with_setup(source: str, setup: str) -> str:
    """A set-up cell's source with its install block (everything up to the end of the
    ``if importlib.util.find_spec("distlab") is None:`` block) replaced by ``setup``. The
    block's imports that ``setup`` lacks are kept after it; a cell with no such block gets
    ``setup`` in front."""
    if source.startswith(setup):
        return source
    lines = source.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.startswith("if importlib.util.find_spec(")), None)
    if start is None:
        return setup + "\n" + source
    end = next((i for i in range(start + 1, len(lines)) if lines[i].strip() and not lines[i][0].isspace()), len(lines))
    kept = [line for line in lines[:start] if line.startswith(("import ", "from ")) and line not in setup]
    return setup + "\n" + "".join(kept) + "".join(lines[end:]).lstrip("\n")


def apply_setup(path: Path) -> None:
    """Give a lab notebook the canonical set-up (scripts/lab_setup.py) and Kaggle's T4 x2 metadata."""
    notebook = read_notebook(path)
    cell = first_code_cell(notebook)
    cell["source"] = with_setup("".join(cell["source"]), SETUP.read_text()).splitlines(keepends=True)
    notebook["metadata"]["kaggle"] = dict(KAGGLE_METADATA)
    write_notebook(notebook, path)


def build_wheel(out: Path) -> Path:
    """``pip wheel --no-deps`` of the package, from a copy of the sources: setuptools writes build/ and
    *.egg-info next to what it builds, and the checkout stays clean."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(ROOT / "pyproject.toml", tmp)
        shutil.copytree(ROOT / "src", Path(tmp) / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        # A setuptools that builds wheels itself (70.1 and newer) needs no network; an older one (Python 3.11's venv
        # has 65.5, without the wheel package) cannot, so pip fetches a new one for an isolated build.
        find = importlib.util.find_spec
        builds_wheels = find("setuptools") and find("setuptools.command.bdist_wheel")
        offline = ["--no-build-isolation"] if builds_wheels else []
        pip = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", *offline, "--wheel-dir", str(out), tmp]
        if subprocess.run(pip).returncode != 0:
            raise SystemExit(
                "kaggle.py: pip could not build the distlab wheel (its lines above say why): it needs "
                "setuptools 70.1 or newer, or the network to fetch one; `python -m pip install -U setuptools` "
                "and run this again"
            )
    (wheel,) = out.glob("distlab-*.whl")
    return wheel


def kernel_notebook(lab: Path, git: str | None) -> dict:
    """The lab as Kaggle will run it: outputs cleared, T4 x2 metadata, and with ``git`` a first code cell
    that makes that URL the DISTLAB_SOURCE route."""
    notebook = read_notebook(lab)
    notebook["metadata"]["kaggle"] = dict(KAGGLE_METADATA)
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    if git:
        cell = copy.deepcopy(first_code_cell(notebook))
        cell["id"] = "distlab-source"
        cell["source"] = ["import os\n", "\n", f'os.environ.setdefault("DISTLAB_SOURCE", {json.dumps(git)})']
        notebook["cells"].insert(notebook["cells"].index(first_code_cell(notebook)), cell)
    return notebook


def source_commit() -> str:
    """The checkout's commit the wheel is built from (``-dirty`` with changes not committed), or why not."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10)  # fmt: skip
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "src", "pyproject.toml"],
                               capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return "a copy of the course (no git)"
    if head.returncode != 0:
        return "a copy of the course (not a git checkout)"
    return f"commit {head.stdout.strip()}" + ("-dirty" if dirty.stdout.strip() else "")


def bundle(user: str, out: Path = OUT, git: str | None = None, public: bool = False) -> list[Path]:
    """Write the wheel dataset and one kernel folder per lab under ``out``; returns the folders."""
    dataset = out / DATASET
    folders = [dataset, *(out / slugify(lab_title(lab)) for lab in LABS)]
    for folder in folders:  # only what this function writes: ``out`` may hold anything else
        shutil.rmtree(folder, ignore_errors=True)
    wheel = build_wheel(dataset)
    metadata = {
        "title": "distlab wheel",
        "id": f"{user}/{DATASET}",
        "subtitle": "The distlab course package, for its labs to pip-install",
        "description": f"`{wheel.name}`, built by scripts/kaggle.py from {source_commit()}. The labs install it "
        "with `pip install --no-index --no-deps --find-links <its folder> distlab`, which leaves torch alone.",
        "licenses": [{"name": "unknown"}],
    }
    (dataset / "dataset-metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    for lab, folder in zip(LABS, folders[1:]):
        folder.mkdir(parents=True)
        write_notebook(kernel_notebook(lab, git), folder / lab.name)
        kernel = {
            "id": f"{user}/{folder.name}",
            "title": lab_title(lab),
            "code_file": lab.name,
            "language": "python",
            "kernel_type": "notebook",
            "is_private": not public,
            "enable_gpu": True,
            "enable_tpu": False,
            "enable_internet": True,  # MNIST downloads; the wheel route works with it off
            "machine_shape": MACHINE_SHAPE,
            "dataset_sources": [metadata["id"]],
            "competition_sources": [],
            "kernel_sources": [],
            "model_sources": [],
        }
        (folder / "kernel-metadata.json").write_text(json.dumps(kernel, indent=2) + "\n")
    return folders


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("user", nargs="?", help="your Kaggle user name: the owner of the dataset and the kernels")
    parser.add_argument("--out", type=Path, default=OUT, help="where to write the bundle (default: %(default)s)")
    parser.add_argument("--git", help="also install distlab from this pip URL (git+https://...) when no wheel is found")
    parser.add_argument("--public", action="store_true", help="make the kernels public (default: private)")
    parser.add_argument("--apply-setup", nargs="+", type=Path, metavar="NOTEBOOK", help="give labs the set-up instead")
    args = parser.parse_args(argv)
    if args.apply_setup:
        for path in args.apply_setup:
            apply_setup(path)
            print(f"{path}: set-up from {SETUP.relative_to(ROOT)}, Kaggle metadata for GPU T4 x2")
        return
    if not args.user or not re.fullmatch(USER, args.user):
        parser.error(
            f"give your Kaggle user name as your profile's address spells it (kaggle.com/<name>): lower-case "
            f"letters and digits, joined by single '-' or '_', not {args.user!r}"
        )
    dataset, *kernels = (os.path.relpath(folder) for folder in bundle(args.user, args.out, args.git, args.public))
    print(next_steps(args.user, dataset, kernels, args.public))


USER = r"[a-z0-9]+(?:[_-][a-z0-9]+)*"
"""A Kaggle owner's slug, as Kaggle's own client checks one (kaggle 2.2.5): lower case."""


def next_steps(user: str, dataset: str, kernels: list[str], public: bool) -> str:
    """What to do with the bundle, in order: what Kaggle asks of a first push, and how to follow a run."""
    visibility = " --public" if public else ""  # a public notebook whose dataset is private runs for nobody else
    first = kernels[0]
    slug = Path(first).name
    lines = [
        "Next, with Kaggle's command line (`pip install kaggle six`: kaggle 2.2.5 imports six without declaring it)",
        "and your API token in ~/.kaggle/kaggle.json. GPUs and Internet need a phone-verified Kaggle account.",
        f"1. the wheel, once:  kaggle datasets create -p {dataset}{visibility}",
        f"   (after a change:  kaggle datasets version -p {dataset} -m update)",
        f"   wait until        kaggle datasets status {user}/{DATASET}   says ready",
        f"2. one lab at a time (Kaggle runs at most two GPU sessions at once):  kaggle kernels push -p {first}",
        f"3. follow it:        kaggle kernels status {user}/{slug}",
        f"   fetch its output: kaggle kernels output {user}/{slug} -p {slug}-output",
        "   then the others, one at a time:",
        *(f"   kaggle kernels push -p {folder}" for folder in kernels[1:]),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
