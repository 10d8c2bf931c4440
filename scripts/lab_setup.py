# Set-up: make `import distlab` work in this kernel. Every install is --no-deps, so the kernel's own
# torch (Kaggle's, built for its CUDA) is never replaced.
import glob
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path


def distlab_source() -> list[str]:
    """What to pip-install distlab from: the first of these that exists. Every route works offline."""
    here = Path.cwd()
    for folder in [here, *here.parents, *sorted(here.glob("*/"))]:  # a checkout: here, above, or cloned beside
        if (folder / "src" / "distlab").is_dir():
            return [str(folder)]
    for wheel in glob.iglob("/kaggle/input/**/distlab-*.whl", recursive=True):  # Kaggle: the wheel dataset
        return ["--no-index", "--find-links", os.path.dirname(wheel), "distlab"]
    if sorted(here.glob("distlab-*-py3-none-any.whl")):  # Colab, elsewhere: the wheel uploaded beside the notebook
        return ["--no-index", "--find-links", str(here), "distlab"]
    if os.environ.get("DISTLAB_SOURCE"):  # a clone of the course, or git+https://... of its repository
        return [os.environ["DISTLAB_SOURCE"]]
    raise SystemExit(
        "distlab is not installed: on Kaggle, add the distlab wheel dataset to this notebook (right-hand panel, "
        "Input > Add Input) and run this cell again (a pushed notebook names it already: the dataset may still be "
        "processing, so wait until `kaggle datasets status <you>/distlab-wheel` says ready); on Colab, upload the "
        "distlab wheel (`pip wheel --no-deps -w dist .` in a clone of the course writes dist/distlab-*.whl) to "
        f"{here} with the Files panel and run this cell again; elsewhere, set DISTLAB_SOURCE to a clone of the course."
    )


# MNIST goes outside /kaggle/working on Kaggle, which keeps that folder as the notebook's output (65 MB of it).
DATA_DIR = os.path.expanduser("~/.cache/distlab/data") if os.path.isdir("/kaggle/working") else "data"


def print_placement(placement) -> None:
    """Where this lab's ranks run (``placement``, from ``distlab.runtime.place``), in one line, and on a machine
    that does not have two GPUs, one more line: what differs from Kaggle's "GPU T4 x2"."""
    print(placement.reason)
    n, gpus = placement.ranks, placement.gpus
    if gpus == 2:
        return
    if placement.device == "cpu":
        here = "the CPU runs shorter versions of the GPU runs, or skips them, and every time is this CPU's"
    elif n > gpus:
        here = (
            f"the ranks take turns on {'the GPU' if gpus == 1 else 'the GPUs'} and their collectives cross host "
            "memory, so a speed-up over one rank is not what a GPU per rank gives"
        )
    elif n == 1:
        here = "what Kaggle splits over two ranks runs whole on the one GPU"
    elif n == gpus:
        here = f"{n} ranks split the work, not 2"
    else:
        here = f"{gpus - n} of the {gpus} GPUs stay idle: the lab is written for two"
    print(f'Kaggle\'s "GPU T4 x2" runs 2 NCCL ranks, one T4 each; here {here}.')


if importlib.util.find_spec("distlab") is None:
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *distlab_source()], check=True)
    importlib.invalidate_caches()
