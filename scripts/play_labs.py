"""Play every lab top to bottom on this machine's GPU(s) and keep the executed notebooks; and the Sphinx
extension that shows a lab's committed played copy in the book.

    python scripts/play_labs.py --out book/results/labs          # every lab, MNIST downloaded as a lab does
    python scripts/play_labs.py --out played --lab lab_fsdp      # one lab (repeat --lab for more)
    python scripts/play_labs.py --out played --data ~/mnist      # MNIST already on disk (MNIST/raw/ inside)
    python scripts/play_labs.py --out played --offline-data      # no network: a tiny stand-in for MNIST

Each lab runs in a scratch folder of its own, in a Jupyter kernel of this Python that imports this distlab; the
lab itself decides where its ranks run (``distlab.runtime.place``: one per GPU). The command writes
``<out>/<machine>-<date>/<lab>.ipynb`` (:func:`play_labs`): outputs kept, this machine's paths and host name
taken out (:func:`scrub`), and in the notebook's metadata (``distlab_played``) the GPUs, the date, the course's
commit and the versions; the GPUs are named in the first output, the lab's own set-up line. A lab that fails is
kept as ``<lab>.failed.ipynb`` (never shown) and the command exits 1. What it needs beyond torch is in
tests/gpu-requirements.txt. A CPU play goes into book/results/labs/ only with ``--cpu-stand-in``: the book shows
it, labelled as a CPU run, until a GPU play of that lab is committed.

The book shows a lab unrun unless a played copy of it is committed under ``book/results/labs/<folder>/``: then
the lab's page renders the chosen copy (:func:`choose`: a GPU play before a CPU one, then the newest valid one;
:func:`problems`) with its label (:func:`label`) in place of the "shown unrun" note. :func:`setup` is that
Sphinx side, which ``_config.yml`` loads from this folder (``local_extensions``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import html
import importlib.util
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LABS = sorted((ROOT / "notebooks").glob("lab*.ipynb"))
BOOK_LABS = ROOT / "book" / "results" / "labs"
DATA_NOTES = {
    "download": "MNIST, downloaded by each lab that uses it",
    "given": "MNIST from a folder given with --data",
    "offline": "a stand-in for MNIST written offline (--offline-data, distlab.labs.offline), not MNIST",
}
"""What the label says the labs read, by where their ``./data`` came from."""

SCHEMA = "distlab.played_lab/1"
KEY = "distlab_played"
"""The notebook metadata key a played copy carries its provenance under."""
REQUIRED = ("schema", "lab", "gpus", "gpu_count", "date", "commit", "torch", "cuda", "data")
LARGEST_NOTEBOOK = 16 * 2**20
MACHINE_PATH = re.compile(r"(/home/|/root/|/Users/|/kaggle/|/tmp/|/var/folders/|/private/|[A-Za-z]:\\)[^\s\"'<>]*")
"""A path that names someone's machine (the same places the GPU reports refuse)."""
BINARY_MIME = ("image/png", "image/jpeg", "image/gif", "application/pdf")
"""Output data that is base64, not text: never scrubbed or searched for paths."""
PLAYED_FOLDER = "results/labs"
"""Where the played copies live, relative to the book's source folder (``book/``)."""
LABEL_CLASS = "distlab-played"


# --------------------------------------------------------------------------------------------- the copies


def _text_fields(notebook: dict):
    """``(container, key)`` of every text a code cell's outputs hold: streams, tracebacks, text data."""
    for cell in (c for c in notebook.get("cells", []) if c.get("cell_type") == "code"):
        for output in cell.get("outputs", []):
            for key in ("text", "evalue"):
                if key in output:
                    yield output, key
            if "traceback" in output:
                for index in range(len(output["traceback"])):
                    yield output["traceback"], index
            for mime in output.get("data", {}):
                if mime not in BINARY_MIME:
                    yield output["data"], mime


def _as_text(value: Any) -> str:
    return "".join(value) if isinstance(value, list) else value if isinstance(value, str) else json.dumps(value)


def output_text(notebook: dict) -> str:
    """Every text output of a notebook, joined: what a reader of its page reads."""
    return "\n".join(_as_text(container[key]) for container, key in _text_fields(notebook))


def scrub(notebook: dict, replacements: dict[str, str], hostnames: Iterable[str] = ()) -> dict:
    """Take machine paths and host names out of every text output, in place (``notebook`` as JSON): each key of
    ``replacements`` (a folder) becomes its value, longest first, then each host name ``<host>``, and any other
    path that names a machine (:data:`MACHINE_PATH`) ``<path>``. Pictures are left alone."""
    pairs = sorted(((k, v) for k, v in replacements.items() if k and len(k) > 1), key=lambda kv: -len(kv[0]))
    hosts = [re.compile(rf"(?<![\w.-]){re.escape(h)}(?![\w-])") for h in hostnames if h and len(h) > 2]

    def clean(text: str) -> str:
        for old, new in pairs:
            text = text.replace(old, new)
        for host in hosts:
            text = host.sub("<host>", text)
        return MACHINE_PATH.sub("<path>", text)

    for container, key in list(_text_fields(notebook)):
        value = container[key]
        if isinstance(value, list):
            container[key] = [clean(line) for line in value]
        elif isinstance(value, str):
            container[key] = clean(value)
    return notebook


def _first_output(notebook: dict) -> str:
    code = [cell for cell in notebook.get("cells", []) if cell.get("cell_type") == "code"]
    outputs = code[0].get("outputs", []) if code else []
    return "".join(_as_text(o.get("text", "")) for o in outputs if o.get("output_type") == "stream")


def read(path: str | Path) -> dict:
    """A notebook as JSON (ValueError if it is not one)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{Path(path).name}: not a notebook ({err})") from err


def provenance(notebook: dict) -> dict:
    return (notebook.get("metadata") or {}).get(KEY) or {}


def problems(path: str | Path, lab: str | None = None) -> list[str]:
    """Everything that keeps a played copy from the book, one line each (empty: the book may show it): its
    provenance (:data:`REQUIRED`), every code cell run, none failed, the first output naming the GPUs (or the
    lack of one), no machine path in any output, a sane size."""
    path = Path(path)
    if path.stat().st_size > LARGEST_NOTEBOOK:
        return [f"{path.name}: {path.stat().st_size:,} bytes, more than {LARGEST_NOTEBOOK:,}"]
    try:
        notebook = read(path)
    except ValueError as err:
        return [str(err)]
    found = []
    meta = provenance(notebook)
    missing = [key for key in REQUIRED if key not in meta]
    if missing:
        return [f"{path.name}: no {KEY} metadata {missing} (not written by scripts/play_labs.py)"]
    if meta["schema"] != SCHEMA:
        found.append(f"{path.name}: {KEY}.schema is {meta['schema']!r}, not {SCHEMA!r}")
    if lab is not None and meta["lab"] != lab:
        found.append(f"{path.name}: a played copy of {meta['lab']!r}, not of {lab!r}")
    if not isinstance(meta["gpus"], list) or meta["gpu_count"] != len(meta["gpus"]):
        found.append(f"{path.name}: gpu_count {meta['gpu_count']!r} does not count the GPUs {meta['gpus']!r}")
    code = [cell for cell in notebook.get("cells", []) if cell.get("cell_type") == "code"]
    unrun = sum(1 for cell in code if cell.get("execution_count") is None)
    if unrun or not code:
        found.append(f"{path.name}: {unrun} of {len(code)} code cells never ran")
    if any(o.get("output_type") == "error" for cell in code for o in cell.get("outputs", [])):
        found.append(f"{path.name}: a cell failed")
    first = _first_output(notebook)
    names = list(dict.fromkeys(meta["gpus"] or [])) or ["No CUDA GPU"]
    unnamed = [name for name in names if name not in first]
    if unnamed:
        found.append(f"{path.name}: the first output does not name {unnamed}: {first[:80]!r}")
    leak = MACHINE_PATH.search(output_text(notebook))
    if leak:
        found.append(f"{path.name}: a machine path in an output, {leak.group(0)[:60]!r}")
    return found


def choose(root: str | Path, lab: str) -> Path | None:
    """The played copy of ``lab`` (a name like ``lab_fsdp``) the book shows: of ``<root>/*/<lab>.ipynb``, the
    valid ones (:func:`problems`), a GPU play before a CPU stand-in, then the newest by the date it was played
    (then by folder name); None if none."""
    candidates = []
    for path in sorted(Path(root).glob(f"*/{lab}.ipynb")):
        if not problems(path, lab):
            meta = provenance(read(path))
            candidates.append((meta["gpu_count"] > 0, str(meta["date"]), path.parent.name, path))
    return max(candidates)[-1] if candidates else None


def invalid(root: str | Path) -> dict[Path, list[str]]:
    """Every notebook under ``<root>/*/`` the book refuses, with why (a ``.failed.ipynb`` is refused by name)."""
    found = {}
    for path in sorted(Path(root).glob("*/*.ipynb")):
        stem = path.name[: -len(".ipynb")]
        why = [f"{path.name}: a lab that failed, written for whoever played it"] if stem.endswith(".failed") else []
        found[path] = why or problems(path, stem)
    return {path: why for path, why in found.items() if why}


def _machine(gpus: list[str], cpu_count: int | None = None) -> str:
    if not gpus:  # the lab's ranks are then gloo processes on the CPU, sharing its cores
        cores = f"a {cpu_count}-core CPU" if cpu_count else "the CPU"
        return f"{cores} (no GPU; the lab's ranks are gloo processes sharing it)"
    return ", ".join(f"{gpus.count(name)} x {name}" for name in dict.fromkeys(gpus))


def label(meta: dict) -> str:
    """One line: where, when and from which commit a played copy ran."""
    commit = f"commit {meta['commit']}" if meta.get("commit") else "an unknown commit"
    return f"Played on {_machine(list(meta['gpus']), meta.get('cpu_count'))} on {str(meta['date'])[:10]} at {commit}"


def label_details(meta: dict, changed: bool = False) -> str:
    """What the label says after its line (HTML): versions, data, and whether the lab changed since."""
    versions = f"torch {meta['torch']}" + (f", CUDA {meta['cuda']}" if meta.get("cuda") else "")
    said = (
        f"The outputs below are one run of this lab top to bottom by <code>python scripts/play_labs.py</code>, "
        f"with {html.escape(versions)}. Data: {html.escape(str(meta['data']))}. Yours are what your hardware measures."
    )
    if changed:
        said += " The lab has changed since this run: the cells below are the ones that ran."
    return said


def same_cells(a: dict, b: dict) -> bool:
    """Whether two notebooks have the same cells (kind and source), outputs aside."""

    def cells(notebook: dict) -> list[tuple[str, str]]:
        return [(c.get("cell_type", ""), _as_text(c.get("source", ""))) for c in notebook.get("cells", [])]

    return cells(a) == cells(b)


# --------------------------------------------------------------------------------------------- playing


def machine_folder(gpus: list[str], when: _dt.datetime) -> str:
    """``2x-tesla-t4-20260501-120000``, or ``cpu-...``: a played folder's name, after its GPUs and time."""
    if gpus:
        kind = f"{len(gpus)}x-" + re.sub(r"[^a-z0-9]+", "-", gpus[0].lower()).strip("-")
    else:
        kind = "cpu"
    return f"{kind}-{when:%Y%m%d-%H%M%S}"


def _kernel(scratch: Path) -> tuple[str, str]:
    """A kernel spec for this very Python (``JUPYTER_PATH`` and its name): the labs run with its torch."""
    spec = scratch / "jupyter" / "kernels" / "distlab-play"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "distlab", "language": "python"}))
    return str(scratch / "jupyter"), "distlab-play"


def play_lab(lab: Path, folder: Path, scratch: Path, *, data: Path, about: dict, timeout_s: float) -> list[str]:
    """Play ``lab`` top to bottom in ``scratch/<lab>/`` (its ``data`` a link to ``data``) and write it into
    ``folder``: ``<lab>.ipynb`` when it ran and passes :func:`problems`, else ``<lab>.failed.ipynb``. What went
    wrong, one line each (empty: played)."""
    import nbclient
    import nbformat

    import distlab

    working = scratch / lab.stem
    working.mkdir()
    (working / "data").symlink_to(data.resolve(), target_is_directory=True)
    jupyter_path, kernel = _kernel(scratch / f".kernel-{lab.stem}")
    package_parent = str(Path(distlab.__file__).resolve().parents[1])
    env = {**os.environ, "JUPYTER_PATH": jupyter_path}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, os.environ.get("PYTHONPATH", "")) if p)
    notebook = nbformat.read(lab, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=timeout_s, kernel_name=kernel, resources={"metadata": {"path": str(working)}}
    )
    failure, started = None, time.perf_counter()
    saved = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = jupyter_path  # where nbclient's kernel manager finds the spec
    try:
        client.execute(env=env)
    except Exception as err:  # a cell failed, the kernel died or never started: the next lab still plays
        lines = [line for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
        failure = f"{lab.stem}: stopped: {lines[-1].strip()[:300]}"
    finally:
        if saved is None:
            os.environ.pop("JUPYTER_PATH", None)
        else:
            os.environ["JUPYTER_PATH"] = saved
    played = json.loads(nbformat.writes(notebook))
    played["metadata"][KEY] = {**about, "lab": lab.stem, "seconds": round(time.perf_counter() - started, 1)}
    home = str(Path.home())
    replacements = {str(working.resolve()): ".", str(working): ".", str(scratch.resolve()): "<scratch>"}
    replacements[str(data.resolve())] = "./data"
    if sys.prefix != sys.base_prefix:  # a virtual environment's folder names its owner's machine; /usr does not
        replacements[sys.prefix] = "<venv>"
    replacements[str(ROOT)] = "<checkout>"
    if not package_parent.startswith(str(ROOT)):  # distlab installed, not this checkout's src/
        replacements[package_parent] = "<site-packages>"
    if home not in ("/", ""):
        replacements[home] = "~"
    scrub(played, replacements, {socket.gethostname(), socket.getfqdn()})
    name = f"{lab.stem}.ipynb"
    (folder / name).write_text(json.dumps(played, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    found = [failure] if failure else problems(folder / name, lab.stem)
    if found:
        (folder / name).rename(folder / f"{lab.stem}.failed.ipynb")
    return found


def play_labs(
    labs: list[Path],
    out: str | Path,
    *,
    data: Path | None = None,
    data_note: str = "",
    timeout_s: float = 1800,
    keep_scratch: bool = False,
) -> tuple[Path, dict[str, list[str]]]:
    """Play each of ``labs`` on this machine into a new folder under ``out`` (named by :func:`machine_folder`);
    the folder, and for each lab what went wrong (empty: played). ``data``: a folder the labs see as their
    ``./data`` (MNIST already there); None, a fresh folder they download into, as a lab does."""
    from distlab.results import environment

    env = environment()
    when = _dt.datetime.now(_dt.UTC)
    folder = Path(out) / machine_folder(env["gpus"], when)
    folder.mkdir(parents=True)
    about = {
        "schema": SCHEMA,
        "gpus": env["gpus"],
        "gpu_count": len(env["gpus"]),
        "cpu_count": os.cpu_count(),
        "date": when.isoformat(timespec="seconds"),
        "commit": env["git_commit"],
        "torch": env["torch"],
        "cuda": env["cuda"] if env["gpus"] else None,
        "nccl": env["nccl"],
        "python": env["python"],
        "data": data_note or DATA_NOTES["download" if data is None else "given"],
    }
    scratch = Path(tempfile.mkdtemp(prefix="distlab-play-"))
    shared = data if data is not None else scratch / "data"
    shared.mkdir(parents=True, exist_ok=True)
    outcome = {}
    try:
        for lab in labs:
            print(f"== {lab.stem}: playing ({_machine(env['gpus'])})", flush=True)
            started = time.perf_counter()
            outcome[lab.stem] = play_lab(lab, folder, scratch, data=shared, about=about, timeout_s=timeout_s)
            said = "; ".join(outcome[lab.stem]) or "played"
            print(f"   {said} ({time.perf_counter() - started:.0f} s)", flush=True)
    finally:
        if not keep_scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    return folder, outcome


# --------------------------------------------------------------------------------------------- the command


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="the played labs go to a new folder under this one")
    parser.add_argument("--lab", action="append", choices=[lab.stem for lab in LABS], help="only this lab")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--data", type=Path, help="a folder the labs see as ./data (MNIST/raw/ inside)")
    source.add_argument("--offline-data", action="store_true", help="write a tiny MNIST: no download")
    parser.add_argument("--timeout-s", type=float, default=1800, help="seconds a cell may run (default 1800)")
    parser.add_argument("--keep-scratch", action="store_true", help="keep the folders the labs ran in")
    shown = "on a CPU, play into book/results/labs: shown as a CPU run until a GPU play of the lab is committed"
    parser.add_argument("--cpu-stand-in", action="store_true", help=shown)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    if importlib.util.find_spec("distlab") is None:  # a checkout without `pip install -e .`: its own src/
        sys.path.insert(0, str(ROOT / "src"))

    inside_book = args.out.resolve() == BOOK_LABS.resolve() or BOOK_LABS.resolve() in args.out.resolve().parents
    from distlab.runtime import gpu_count

    if inside_book and gpu_count() == 0 and not args.cpu_stand_in:
        print(f"play_labs: no CUDA GPU here, and {BOOK_LABS.relative_to(ROOT)} holds GPU runs (the book shows "
              "them as such): play into another folder, or pass --cpu-stand-in", file=sys.stderr)  # fmt: skip
        return 2
    if args.data is not None and not args.data.is_dir():
        print(f"play_labs: --data {args.data} is not a folder", file=sys.stderr)
        return 2
    labs = [lab for lab in LABS if not args.lab or lab.stem in args.lab]
    data, note = args.data, ""
    with tempfile.TemporaryDirectory(prefix="distlab-play-data-") as tiny:
        if args.offline_data:
            from distlab.labs.offline import write_offline_mnist

            data, note = write_offline_mnist(Path(tiny) / "data"), DATA_NOTES["offline"]
        elif data is not None:
            note = DATA_NOTES["given"]
        folder, outcome = play_labs(
            labs, args.out, data=data, data_note=note, timeout_s=args.timeout_s, keep_scratch=args.keep_scratch
        )
    failed = {lab: why for lab, why in outcome.items() if why}
    print(f"play_labs: {len(outcome) - len(failed)} of {len(outcome)} labs played into {folder}")
    for lab, why in failed.items():
        print(f"  {lab}.failed.ipynb: {'; '.join(why)}")
    return 1 if failed else 0


# --------------------------------------------------------------------------------------------- the book

UNRUN_NOTE = re.compile(r'<div class="admonition note distlab-unrun">.*?</div>\n?', re.S)
"""The note ``book/_ext/distlab_site.py`` puts on every lab page; a played page gets its label instead."""


def _root(app) -> Path:
    return Path(app.srcdir) / app.config.distlab_played_labs


def _lab_name(env, docname: str) -> str | None:
    if not docname.startswith("labs/") or not str(env.doc2path(docname)).endswith(".ipynb"):
        return None
    return docname.split("/", 1)[1]


def _swap_in_played_copy(app, docname: str, source: list[str]) -> None:
    """``source-read``: a lab page reads its played copy, when there is one, instead of the unrun lab."""
    env = app.env
    if not hasattr(env, "distlab_played"):
        env.distlab_played = {}
    lab = _lab_name(env, docname)
    if lab is None:
        return
    copy = choose(_root(app), lab)
    env.distlab_played[docname] = None
    if copy is None:
        return
    played = read(copy)
    try:
        changed = not same_cells(played, json.loads(source[0]))
    except json.JSONDecodeError:
        changed = True
    env.note_dependency(str(copy))
    env.distlab_played[docname] = {"path": str(copy), "meta": provenance(played), "changed": changed}
    source[0] = copy.read_text(encoding="utf-8")


def _label_played_page(app, pagename: str, templatename, context: dict, doctree) -> None:
    """``html-page-context``, after the site's own: the label replaces the "shown unrun" note."""
    played = getattr(app.env, "distlab_played", {}).get(pagename)
    if not played or "body" not in context:
        return
    meta = played["meta"]
    note = (
        f'<div class="admonition note {LABEL_CLASS}"><p class="admonition-title">{html.escape(label(meta))}</p>'
        f"<p>{label_details(meta, played['changed'])}</p></div>\n"
    )
    body, swapped = UNRUN_NOTE.subn(lambda _: note, context["body"], count=1)
    context["body"] = body if swapped else note + body


def _outdated(app, env, added, changed, removed) -> list[str]:
    """``env-get-outdated``: a lab whose chosen copy is no longer the one it was read with is read again."""
    known = getattr(env, "distlab_played", {})
    stale = []
    for docname in env.found_docs:
        lab = _lab_name(env, docname)
        if lab is None or docname in added or docname not in known:
            continue
        copy = choose(_root(app), lab)
        if (str(copy) if copy else None) != (known[docname] or {}).get("path"):
            stale.append(docname)
    return stale


def _purge(app, env, docname: str) -> None:
    getattr(env, "distlab_played", {}).pop(docname, None)


def _merge(app, env, docnames, other) -> None:
    if not hasattr(env, "distlab_played"):
        env.distlab_played = {}
    env.distlab_played.update({d: v for d, v in getattr(other, "distlab_played", {}).items() if d in docnames})


def _warn_about_refused(app) -> None:
    from sphinx.util import logging

    for path, why in invalid(_root(app)).items():
        if not path.name.endswith(".failed.ipynb"):
            logging.getLogger(__name__).warning(f"played lab {path} not shown: {'; '.join(why)}")


def setup(app):
    """The Sphinx extension: lab pages show their committed played copy (``_config.yml``: local_extensions)."""
    app.add_config_value("distlab_played_labs", PLAYED_FOLDER, "env")
    app.connect("builder-inited", _warn_about_refused)
    app.connect("source-read", _swap_in_played_copy)
    app.connect("html-page-context", _label_played_page, priority=600)
    app.connect("env-get-outdated", _outdated)
    app.connect("env-purge-doc", _purge)
    app.connect("env-merge-info", _merge)
    return {"parallel_read_safe": True, "parallel_write_safe": True}


if __name__ == "__main__":
    sys.exit(main())
