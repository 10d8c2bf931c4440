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
    """What to pip-install distlab from: the first of these that exists."""
    for folder in [Path.cwd(), *Path.cwd().parents]:  # a checkout of the course, this folder or above
        if (folder / "src" / "distlab").is_dir():
            return [str(folder)]
    for wheel in glob.iglob("/kaggle/input/**/distlab-*.whl", recursive=True):  # Kaggle: the wheel dataset
        return ["--no-index", "--find-links", os.path.dirname(wheel), "distlab"]
    if os.environ.get("DISTLAB_SOURCE"):  # a clone of the course, or git+https://... of its repository
        return [os.environ["DISTLAB_SOURCE"]]
    raise SystemExit(
        "distlab is not installed: on Kaggle, add the distlab wheel dataset to this notebook (right-hand panel, "
        "Input > Add Input) and run this cell again; elsewhere, set DISTLAB_SOURCE to a clone of the course."
    )


if importlib.util.find_spec("distlab") is None:
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *distlab_source()], check=True)
    importlib.invalidate_caches()
