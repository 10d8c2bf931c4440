"""The book's own Sphinx extension: what the site needs that the theme does not do.

* Each chapter (a MyST notebook) offers its executed notebook as a download,
  as the labs do (myst-nb 1.x never gives the theme an ``ipynb_source``).
* Sphinx 7.4 writes a body-only script twice (sphinx-doc/sphinx#13402, fixed
  in 8.x), which makes the browser report a redeclared identifier.
* Each lab page says that it is shown unrun and where it runs (the build
  does not execute the labs), and links "Open in Kaggle" once ``_config.yml``
  names the repository's public URL (``repository.url``); no link is made up
  before (Jupyter Book fills in its own repository where none is named).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml
from sphinx.builders.html import StandaloneHTMLBuilder


def _add_js_file_once(add):
    # Sphinx 7.4 registers a body-only script (filename None) again as '' in prepare_writing.
    def add_js_file(self, filename, **kwargs):
        return add(self, filename or "", **kwargs)

    return add_js_file


def kaggle_url(repository_url: str, branch: str, pagename: str) -> str:
    """Kaggle's import of a notebook from GitHub, for a lab page ``labs/<name>`` (the file is in ``notebooks/``)."""
    name = pagename.split("/", 1)[1]
    return f"https://kaggle.com/kernels/welcome?src={repository_url.rstrip('/')}/blob/{branch}/notebooks/{name}.ipynb"


def configured_repository(source: Path) -> str | None:
    """``repository.url`` of the ``_config.yml`` the build uses (the first one from ``source`` upwards)."""
    for folder in [source, *source.parents]:
        if (folder / "_config.yml").is_file():
            config = yaml.safe_load((folder / "_config.yml").read_text()) or {}
            return (config.get("repository") or {}).get("url") or None
    return None


def _offer_notebook(app, pagename, templatename, context, doctree):
    if context.get("page_source_suffix") in (None, ".ipynb"):
        return
    executed = Path(app.outdir).parent / "jupyter_execute" / f"{pagename}.ipynb"
    if executed.is_file():
        target = Path(app.outdir) / "_sources" / f"{pagename}.ipynb"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(executed, target)
        context["ipynb_source"] = f"{pagename}.ipynb"


UNRUN_LAB = (
    '<div class="admonition note distlab-unrun"><p class="admonition-title">This lab is shown unrun</p>'
    "<p>It is for running: on Kaggle with the \u201cGPU T4 x2\u201d accelerator, or on your own machine "
    "(<em>Run all</em>; without a GPU it runs on the CPU in a few minutes). Its outputs are what your hardware "
    "measures. The course\u2019s tests run every lab top to bottom on the CPU at every change.</p></div>\n"
)
"""What a lab page says above its first cell: the book's build does not execute the labs."""


def _lab_header(app, pagename, templatename, context, doctree):
    if not pagename.startswith("labs/") or "body" not in context:
        return
    header = UNRUN_LAB
    repository = configured_repository(Path(app.srcdir).resolve())
    if repository:
        branch = (app.config.html_theme_options or {}).get("repository_branch") or "main"
        url = kaggle_url(repository, branch, pagename)
        header = f'<p class="distlab-kaggle"><a class="reference external" href="{url}">Open in Kaggle</a></p>\n' + header
    context["body"] = header + context["body"]


def setup(app):
    StandaloneHTMLBuilder.add_js_file = _add_js_file_once(StandaloneHTMLBuilder.add_js_file)
    app.connect("html-page-context", _offer_notebook, priority=500)
    app.connect("html-page-context", _lab_header, priority=500)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
