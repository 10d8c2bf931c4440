"""The labs run on Kaggle with zero edits. Every lab starts with the one set-up (scripts/lab_setup.py), which
finds distlab wherever a lab runs; scripts/kaggle.py writes what the two `kaggle` commands push; and Kaggle,
played on this machine, works: a bare lab notebook whose kernel cannot import distlab, with nothing beside it
but the wheel in an input folder, installs distlab from that wheel and runs to its last cell on the CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
import yaml

from distlab.measure import hardware
from support import bare_kaggle_kernel, python_without_distlab, site_extension

ROOT = Path(__file__).resolve().parents[1]
SETUP = (ROOT / "scripts" / "lab_setup.py").read_text()
_spec = importlib.util.spec_from_file_location("distlab_kaggle_bundler", ROOT / "scripts" / "kaggle.py")
kaggle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kaggle)

LABS = [pytest.param(lab, id=lab.stem) for lab in kaggle.LABS]


def _cells(notebook: dict, kind: str = "code") -> list[str]:
    return ["".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == kind]


def test_there_are_labs_and_the_setup_is_python():
    assert {lab.name for lab in kaggle.LABS} >= {"lab0_first_run.ipynb", "lab_ddp_mnist.ipynb", "lab_fsdp.ipynb"}
    compile(SETUP, "lab_setup.py", "exec")


@pytest.mark.parametrize("lab", LABS)
def test_every_lab_starts_with_the_setup_and_records_its_hardware(lab: Path):
    notebook = kaggle.read_notebook(lab)
    setup_cell = _cells(notebook)[0]
    assert setup_cell.startswith(SETUP), f"{lab.name}: run python scripts/kaggle.py --apply-setup {lab}"
    for call in ("hardware.survey()", "hardware.describe(", "hardware.set_nccl_transport(", "hardware.save("):
        assert call in setup_cell, f"{lab.name}'s set-up cell lacks {call}"
    assert 'environ.setdefault("NCCL_' not in "".join(_cells(notebook)), "set_nccl_transport decides, nothing else"
    assert notebook["metadata"]["kaggle"] == kaggle.KAGGLE_METADATA
    assert all(cell.get("outputs") == [] for cell in notebook["cells"] if cell["cell_type"] == "code")


def test_the_setup_looks_for_distlab_in_order(tmp_path: Path, monkeypatch):
    """A checkout above the working directory, then a wheel anywhere under the input folder, then
    DISTLAB_SOURCE; with none of them, one sentence says what to change on Kaggle. (Run here, where distlab
    is importable, the set-up installs nothing: the first route is "already installed".)"""
    inputs = tmp_path / "input"
    namespace: dict = {}
    exec(compile(SETUP.replace('"/kaggle/input/', f'"{inputs}/'), "lab_setup.py", "exec"), namespace)
    find = namespace["distlab_source"]
    monkeypatch.delenv("DISTLAB_SOURCE", raising=False)
    (tmp_path / "checkout" / "src" / "distlab").mkdir(parents=True)
    (tmp_path / "checkout" / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "checkout" / "notebooks")
    assert find() == [str(tmp_path / "checkout")]
    (tmp_path / "bare").mkdir()
    monkeypatch.chdir(tmp_path / "bare")
    with pytest.raises(SystemExit, match=r"on Kaggle, add the distlab wheel dataset to this notebook .*Add Input"):
        find()
    monkeypatch.setenv("DISTLAB_SOURCE", "git+https://example.org/someone/distlab")
    assert find() == ["git+https://example.org/someone/distlab"]
    wheels = inputs / "datasets" / "someone" / "distlab-wheel"
    wheels.mkdir(parents=True)
    (wheels / "distlab-0.1.0-py3-none-any.whl").touch()
    assert find() == ["--no-index", "--find-links", str(wheels), "distlab"]


def test_apply_setup_replaces_an_old_install_block_and_keeps_the_rest(tmp_path: Path):
    old = (
        "import importlib.util\nimport math\nimport os\nfrom pathlib import Path\n\n"
        'DISTLAB_SOURCE = os.environ.get("DISTLAB_SOURCE", "")\n\n'
        'if importlib.util.find_spec("distlab") is None:\n    raise SystemExit("no")\n\n'
        "import torch\n\nGPUS = torch.cuda.device_count()\n"
    )
    new = kaggle.with_setup(old, SETUP)
    assert new == SETUP + "\nimport math\nimport torch\n\nGPUS = torch.cuda.device_count()\n"
    assert kaggle.with_setup(new, SETUP) == new
    path = tmp_path / "lab.ipynb"
    path.write_text((ROOT / "notebooks" / "lab_ddp_mnist.ipynb").read_text())
    before = kaggle.read_notebook(path)
    kaggle.apply_setup(path)
    after = kaggle.read_notebook(path)
    assert _cells(after)[0].startswith(SETUP) and "DISTLAB_SOURCE = " not in _cells(after)[0]
    assert _cells(after)[1:] == _cells(before)[1:] and _cells(after, "markdown") == _cells(before, "markdown")
    assert after["metadata"]["kaggle"] == kaggle.KAGGLE_METADATA


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("kaggle")
    kaggle.bundle("learner", out)
    return out


def test_the_bundle_is_what_the_kaggle_commands_push(bundle: Path):
    dataset = json.loads((bundle / "distlab-wheel" / "dataset-metadata.json").read_text())
    assert dataset["id"] == "learner/distlab-wheel" and len(dataset["licenses"]) == 1
    assert 6 <= len(dataset["title"]) <= 50 and 20 <= len(dataset["subtitle"]) <= 80  # Kaggle's limits
    (wheel,) = (bundle / "distlab-wheel").glob("*.whl")
    assert wheel.name == "distlab-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read("distlab-0.1.0.dist-info/METADATA").decode()
    assert {
        "distlab/__init__.py",
        "distlab/measure/hardware.py",
        "distlab/train.py",
        "distlab/parallel/fsdp2.py",
    } <= names
    assert "Requires-Dist" not in metadata  # nothing for pip to pull in: Kaggle's torch stays
    folders = sorted(p.name for p in bundle.iterdir() if p.name != "distlab-wheel")
    assert len(folders) == len(kaggle.LABS)
    for lab in kaggle.LABS:
        folder = bundle / kaggle.slugify(kaggle.lab_title(lab))
        meta = json.loads((folder / "kernel-metadata.json").read_text())
        assert sorted(p.name for p in folder.iterdir()) == sorted(["kernel-metadata.json", lab.name])
        assert meta["id"] == f"learner/{folder.name}" and kaggle.slugify(meta["title"]) == folder.name
        assert 5 <= len(meta["title"]) <= 50 and meta["title"].replace(" ", "").isalnum()  # one slug only
        assert meta["code_file"] == lab.name and meta["language"] == "python" and meta["kernel_type"] == "notebook"
        assert meta["enable_gpu"] is True and meta["enable_internet"] is True and meta["is_private"] is True
        assert meta["machine_shape"] == "NvidiaTeslaT4" and meta["dataset_sources"] == ["learner/distlab-wheel"]
        inside = kaggle.read_notebook(folder / lab.name)
        assert _cells(inside) == _cells(kaggle.read_notebook(lab)), "the notebook inside is the lab"
        assert inside["metadata"]["kaggle"] == kaggle.KAGGLE_METADATA
        assert "git+" not in "".join(_cells(inside)).replace(SETUP, ""), "no repository URL unless --git gives one"


def test_a_git_url_is_a_route_only_when_the_bundler_is_given_one():
    lab = ROOT / "notebooks" / "lab0_first_run.ipynb"
    url = "git+https://example.org/someone/distlab"
    plain, routed = kaggle.kernel_notebook(lab, None), kaggle.kernel_notebook(lab, url)
    assert _cells(routed) == [f'import os\n\nos.environ.setdefault("DISTLAB_SOURCE", "{url}")', *_cells(plain)]
    assert url not in json.dumps(plain)


def test_hardware_on_this_machine_and_the_p2p_decision(tmp_path: Path):
    facts = hardware.survey()
    if not facts["gpus"]:
        assert facts["peer_access"] == [] and facts["topology"] is None
        assert hardware.describe(facts).startswith("No CUDA GPU here")
    if os.path.isdir("/dev/shm"):
        assert facts["dev_shm"]["total_bytes"] > 0
    t4s = {**facts, "gpus": ["Tesla T4"] * 2, "dev_shm": {"total_bytes": 2**33, "free_bytes": 2**33}}
    environ: dict[str, str] = {}
    line = hardware.set_nccl_transport({**t4s, "peer_access": [[None, True], [True, None]]}, environ)
    assert environ == {} and "Nothing set" in line
    line = hardware.set_nccl_transport({**t4s, "peer_access": [[None, False], [False, None]]}, environ)
    assert environ == {"NCCL_P2P_DISABLE": "1", "NCCL_CUMEM_HOST_ENABLE": "0"}
    assert "GPUs 0 and 1 have no peer access" in line and "8.0 GiB" in line and "\n" not in line
    environ = {"NCCL_P2P_DISABLE": "0"}
    line = hardware.set_nccl_transport({**t4s, "peer_access": [[None, False], [False, None]]}, environ)
    assert "kept from the environment" in line
    assert environ["NCCL_P2P_DISABLE"] == "0"
    assert hardware.describe(t4s) == "2 x Tesla T4: the hardware this lab is written for."
    assert "not the 2 x T4" in hardware.describe({**t4s, "gpus": ["Tesla P100-PCIE-16GB"]})
    saved = json.loads(hardware.save(facts, tmp_path / "results" / "hardware.json").read_text())
    assert {"gpus", "peer_access", "topology", "dev_shm", "nccl_env"} <= set(saved)


@pytest.mark.kaggle
@pytest.mark.parametrize("lab", LABS)  # the book shows the labs unrun: this is where each one runs
def test_kaggle_played_here_a_bare_lab_installs_distlab_from_the_wheel_and_runs(lab, bundle, tmp_path, monkeypatch):
    nbclient = pytest.importorskip("nbclient")
    python = python_without_distlab(tmp_path)
    found = subprocess.check_output([python, "-c", "import importlib.util as u; print(u.find_spec('distlab'))"])
    assert found.strip() == b"None", "the kernel's Python must not see distlab yet"
    # /kaggle/input, laid out as Kaggle mounts it since 2026 (datasets/<owner>/<slug>/), the slug a symlink.
    inputs = tmp_path / "input"
    (inputs / "datasets" / "learner").mkdir(parents=True)
    (inputs / "datasets" / "learner" / "distlab-wheel").symlink_to(bundle / "distlab-wheel")
    working = tmp_path / "working"  # nothing but the notebook, as "Open in Kaggle" or a push leaves it
    working.mkdir()
    assert not any((folder / "src" / "distlab").is_dir() for folder in [working, *working.parents])
    notebook = kaggle.read_notebook(lab)
    cell = next(cell for cell in notebook["cells"] if cell["cell_type"] == "code")
    source = "".join(cell["source"])
    assert source.count('"/kaggle/input/') == 1
    cell["source"] = source.replace('"/kaggle/input/', f'"{inputs}/')  # the only change: where the input is
    kernel = bare_kaggle_kernel(tmp_path, monkeypatch, python, "kaggle-play", "Kaggle played here")
    nb = pytest.importorskip("nbformat").reads(json.dumps(notebook), as_version=4)
    where = {"metadata": {"path": str(working)}}
    nbclient.NotebookClient(nb, timeout=300, kernel_name=kernel, resources=where).execute()
    site = next((tmp_path / "venv" / "lib").glob("python*/site-packages"))
    assert (site / "distlab" / "__init__.py").is_file(), "distlab was installed into the kernel's environment"
    assert not list(site.glob("torch*")), "torch was not reinstalled"
    setup_cell = next(cell for cell in nb.cells if cell.cell_type == "code")
    setup_output = "".join(output.get("text", "") for output in setup_cell.outputs)
    assert "No CUDA GPU here" in setup_output and "NCCL: not used here" in setup_output
    record = json.loads((working / "results" / "hardware.json").read_text())
    assert record["gpus"] == [] and record["peer_access"] == [] and record["dev_shm"]["total_bytes"] > 0
    checks = [cell for cell in nb.cells if cell.cell_type == "code" and cell.source.startswith("check(")]
    assert checks, f"{lab.name} ends with no exercise"
    for cell in checks:  # the stub, unfilled: the learner is told what to write, and the lab goes on
        said = " ".join("".join(output.get("text", "") for output in cell.outputs).split())  # folded at 100
        assert said.startswith("✎ ") and "Write its body" in said and "Traceback" not in said, said
    if lab.name == "lab0_first_run.ipynb":
        for name in ("single", "ddp", "fsdp"):
            assert (working / "results" / f"lab0-{name}.json").is_file()


def test_open_in_kaggle_points_kaggle_at_the_lab_notebook_on_github():
    site = site_extension()
    url = site.kaggle_url("https://github.com/someone/distlab/", "main", "labs/lab_fsdp")
    assert (
        url
        == "https://kaggle.com/kernels/welcome?src=https://github.com/someone/distlab/blob/main/notebooks/lab_fsdp.ipynb"
    )
    assert (ROOT / "notebooks" / "lab_fsdp.ipynb").is_file()


def test_only_the_repository_config_yml_names_is_linked(tmp_path: Path):
    """Jupyter Book puts its own repository in the theme's options when _config.yml names none: the
    extension reads _config.yml itself, so no link points anywhere but this course's repository."""
    site = site_extension()
    book = tmp_path / "book"
    book.mkdir()
    (tmp_path / "_config.yml").write_text("title: t\nrepository:\n  path_to_book: book\n")
    assert site.configured_repository(book) is None
    (tmp_path / "_config.yml").write_text("repository:\n  url: https://github.com/someone/distlab\n")
    assert site.configured_repository(book) == "https://github.com/someone/distlab"
    named = yaml.safe_load((ROOT / "_config.yml").read_text()).get("repository", {}).get("url")
    assert site.configured_repository(ROOT / "book") == named


def test_every_result_records_what_decides_nccl_transport(monkeypatch):
    from distlab.results import environment

    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    transport = environment()["nccl_transport"]
    assert transport["settings"]["NCCL_P2P_DISABLE"] == "1"
    assert transport["dev_shm"]["total_bytes"] > 0
    assert len(transport["peer_access"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
