"""A lab on Colab (one GPU): the first cell (scripts/lab_setup.py) finds distlab without the learner setting
anything, from the wheel uploaded beside the notebook (Colab's /content) or a clone made there, offline; and the
README's one-GPU row says how, in the words the cell's refusal uses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETUP = (ROOT / "scripts" / "lab_setup.py").read_text()


def distlab_source(inputs: Path):
    """The set-up's ``distlab_source``, with Kaggle's input folder moved to ``inputs`` (empty here: not Kaggle)."""
    namespace: dict = {}
    exec(compile(SETUP.replace('"/kaggle/input/', f'"{inputs}/'), "lab_setup.py", "exec"), namespace)
    return namespace["distlab_source"]


def test_on_colab_the_first_cell_installs_the_wheel_uploaded_beside_the_notebook(tmp_path, monkeypatch):
    """Colab's working folder is /content, where its Files panel uploads. Before, only a checkout above the notebook,
    Kaggle's input or DISTLAB_SOURCE (set by hand) were looked for: the cell stopped."""
    find = distlab_source(tmp_path / "input")
    content = tmp_path / "content"
    (content / "sample_data").mkdir(parents=True)  # what Colab puts there
    monkeypatch.chdir(content)
    monkeypatch.delenv("DISTLAB_SOURCE", raising=False)
    with pytest.raises(SystemExit, match=rf"on Colab, upload the distlab wheel .* to {content} with the Files panel"):
        find()
    (content / "distlab-0.1.0-py3-none-any (1).whl").touch()  # a second download's name: not a wheel pip reads
    with pytest.raises(SystemExit):
        find()
    (content / "distlab-0.1.0-py3-none-any.whl").touch()
    assert find() == ["--no-index", "--find-links", str(content), "distlab"]


def test_a_clone_beside_the_notebook_is_a_checkout_too(tmp_path, monkeypatch):
    """``!git clone <the course>`` in Colab's /content puts the checkout below the notebook's folder, not above."""
    find = distlab_source(tmp_path / "input")
    (tmp_path / "content" / "distlab-course" / "src" / "distlab").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "content")
    assert find() == [str(tmp_path / "content" / "distlab-course")]


def test_the_readme_says_how_colab_gets_distlab_as_the_cell_does():
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| one GPU"))
    assert "P100" not in readme  # T10: Kaggle's client retires it ("Sessions run on the default GPU ... T4")
    assert "pip wheel --no-deps -w dist ." in row and "pip wheel --no-deps -w dist ." in SETUP
    assert "Files panel" in row and "/content" in row


@pytest.mark.slow
def test_the_readmes_colab_wheel_installs_offline_from_where_the_cell_finds_it(tmp_path, monkeypatch):
    """The README's command writes the wheel; put in the notebook's folder, the cell's own pip line installs it
    with no index (Colab's pip is run the same way), and the installed package is this checkout's distlab."""
    content = tmp_path / "content"
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(content), str(ROOT)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = content.glob("distlab-*.whl")
    monkeypatch.chdir(content)
    monkeypatch.delenv("DISTLAB_SOURCE", raising=False)
    args = distlab_source(tmp_path / "input")()
    site = tmp_path / "site"
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (site / "distlab" / "runtime.py").read_text() == (ROOT / "src" / "distlab" / "runtime.py").read_text()
