"""The Kaggle path as a learner walks it (kaggle-review-1.md K1-K3, K6-K10): what scripts/kaggle.py builds and
says, and what a lab says on Kaggle when something is missing. Each test fails on the code the review read."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from distlab.errors import DistlabError

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("distlab_kaggle_bundler_path", ROOT / "scripts" / "kaggle.py")
kaggle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kaggle)


def test_k1_the_readme_installs_a_kaggle_command_that_starts():
    """K1: kaggle 2.2.5 imports six without declaring it: ``pip install kaggle`` alone gives a command that dies at
    its first line. The README's line installs both (checked in a fresh virtualenv: "Kaggle CLI 2.2.5")."""
    readme = (ROOT / "README.md").read_text()
    assert "installed as `pip install kaggle six`" in readme


def test_k2_the_wheel_is_built_in_isolation_unless_setuptools_can_build_it_offline(monkeypatch, tmp_path):
    """K2: any setuptools made the build skip isolation, and Python 3.11's venv has 65.5, which cannot build a
    wheel (``invalid command 'bdist_wheel'``). Isolation is skipped only where setuptools has bdist_wheel (70.1+);
    a failed build is one line that says what to install."""
    calls = []

    def run(command, **kwargs):
        calls.append(command)
        return type("Done", (), {"returncode": 1})()

    monkeypatch.setattr(kaggle.subprocess, "run", run)
    found = {"setuptools": object(), "setuptools.command.bdist_wheel": None}  # setuptools 65.5
    monkeypatch.setattr(kaggle.importlib.util, "find_spec", lambda name: found.get(name))
    with pytest.raises(SystemExit, match="setuptools 70.1 or newer"):
        kaggle.build_wheel(tmp_path)
    assert "--no-build-isolation" not in calls[-1]
    found["setuptools.command.bdist_wheel"] = object()
    with pytest.raises(SystemExit):
        kaggle.build_wheel(tmp_path)
    assert "--no-build-isolation" in calls[-1]


def test_k3_k8_what_kaggle_py_prints_is_kaggles_first_push_in_order():
    """K3: five pushes in a row hit Kaggle's two GPU sessions; a kernel pushed before its dataset is ready runs
    without it; the account must be phone-verified; the learner must learn how to follow a run. K8: with
    ``--public`` the dataset must be public too, or nobody else can run the notebooks."""
    kernels = ["out/distlab-lab0-first-run", "out/distlab-lab-fsdp"]
    said = kaggle.next_steps("learner", "out/distlab-wheel", kernels, public=False)
    for needed in ("pip install kaggle six", "phone-verified", "kaggle datasets status learner/distlab-wheel",
                   "one lab at a time", "kaggle kernels status learner/distlab-lab0-first-run",
                   "kaggle kernels output learner/distlab-lab0-first-run"):  # fmt: skip
        assert needed in said, needed
    assert said.index("datasets create") < said.index("datasets status") < said.index("kernels push")
    assert "--public" not in said
    assert "kaggle datasets create -p out/distlab-wheel --public" in kaggle.next_steps(
        "learner", "out/distlab-wheel", kernels, public=True
    )


@pytest.mark.parametrize("user, ok", [("learner", True), ("some_user-2", True), ("Some_User", False),
                                      ("x-", False), ("a__b", False)])  # fmt: skip
def test_k9_a_user_name_is_kaggles_lower_case_owner_slug(user, ok, capsys):
    """K9: a name with capitals was accepted, though Kaggle's owner slugs are lower case."""
    assert bool(re.fullmatch(kaggle.USER, user)) == ok
    if not ok:
        with pytest.raises(SystemExit):
            kaggle.main([user, "--out", "/nonexistent"])
        assert "profile" in capsys.readouterr().err


def test_k10_the_wheel_dataset_says_which_commit_it_was_built_from(tmp_path, monkeypatch):
    """K10: the wheel's version never changes, so a learner comparing two runs could not tell which wheel ran."""
    monkeypatch.setattr(kaggle, "build_wheel", lambda out: (out.mkdir(parents=True), out / "distlab-0.1.0.whl")[1])
    kaggle.bundle("learner", tmp_path)
    description = json.loads((tmp_path / "distlab-wheel" / "dataset-metadata.json").read_text())["description"]
    assert re.search(r"from (commit [0-9a-f]{12}(-dirty)?|a copy of the course)", description), description


def test_k10_on_kaggle_the_labs_keep_mnist_outside_the_notebooks_output():
    """K10: the labs downloaded MNIST into /kaggle/working, which Kaggle keeps as the notebook's output (65 MB)."""
    setup = (ROOT / "scripts" / "lab_setup.py").read_text()
    assert 'DATA_DIR = os.path.expanduser("~/.cache/distlab/data") if os.path.isdir("/kaggle/working")' in setup
    for lab in ("lab0_first_run", "lab_ddp_mnist", "lab_fsdp"):
        cells = json.loads((ROOT / "notebooks" / f"{lab}.ipynb").read_text())["cells"]
        code = "\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "code")
        assert '"--dataset", "mnist", "--data-dir", DATA_DIR' in code, lab


def test_k6_with_no_gpu_the_first_cell_says_where_kaggles_setting_is():
    """K6: with no accelerator the first cell named the missing GPU but not Kaggle's setting."""
    from distlab.measure import hardware

    said = hardware.describe({"gpus": []})
    assert said.startswith("No CUDA GPU here") and hardware.KAGGLE_SETTING in said


def test_k7_on_kaggle_a_failed_mnist_download_names_kaggles_internet_setting(monkeypatch, tmp_path):
    """K7: with Internet off, the MNIST error told a notebook's reader to pass --data-dir or --dataset, flags the
    notebook sets. On Kaggle it now names Settings > Internet."""
    from distlab import data
    from distlab.runtime import Runtime

    def no_network(*args, **kwargs):
        raise RuntimeError("Error downloading train-images-idx3-ubyte.gz")

    monkeypatch.setattr(data, "_torchvision_dataset", no_network)
    real_isdir = data.os.path.isdir
    monkeypatch.setattr(data.os.path, "isdir", lambda path: path == "/kaggle" or real_isdir(path))
    runtime = Runtime(0, 0, 1, __import__("torch").device("cpu"), "gloo")
    with pytest.raises(DistlabError, match="Settings > Internet on") as raised:
        data._fetch_or_explain("mnist", str(tmp_path), runtime, download=True)
    assert "--data-dir" not in str(raised.value)


def test_k4_cis_kaggle_stack_runs_the_notebook_stack_kaggles_image_carries():
    """K4: CI pinned ipykernel alone, so its Kaggle stack played the labs on the newest IPython (9) and
    jupyter_client (8); Kaggle's image carries IPython 7.34, whose handling of %%writefile, `!` lines and
    _exit_code the labs rely on. Every package Kaggle's image fixes for a lab is pinned to its version."""
    pins = dict(
        line.split("==") for line in (ROOT / ".ci" / "kaggle-requirements.txt").read_text().splitlines() if "==" in line
    )
    kaggles = {"ipython": "7.34.0", "ipykernel": "6.17.1", "jupyter_client": "7.4.9", "nbclient": "0.5.13",
               "numpy": "2.4.6", "matplotlib": "3.10.0", "torch": "2.10.0", "torchvision": "0.25.0"}  # fmt: skip
    assert {name: pins.get(name) for name in kaggles} == kaggles
