"""The built site, where one exists (`jupyter-book build book` writes it; CI builds it after
the tests and runs this file again): no machine paths on any page, and no cell whose output
breaks into a column of boxes (one per printed line, as unmerged streams render)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

SITE = Path(__file__).resolve().parents[1] / "_build" / "html"


MOST_OUTPUT_BOXES_PER_CELL = 4


def _pages() -> list[Path]:
    pages = sorted(SITE.rglob("*.html")) if SITE.is_dir() else []
    if not pages:
        pytest.skip("no built site: run `jupyter-book build book` first")
    return pages


def test_no_page_shows_a_machine_path():
    pages = _pages()
    leaking = [str(page.relative_to(SITE)) for page in pages if "/tmp/" in page.read_text(errors="replace")]
    assert not leaking, f"pages that show a /tmp/ path: {leaking}"


def test_each_cell_shows_at_most_a_few_output_boxes():
    crowded = []
    for page in _pages():
        cells = re.split(r'<div class="cell[ "]', page.read_text(errors="replace"))[1:]
        for index, cell in enumerate(cells):
            boxes = len(re.findall(r'<div class="output[ "]', cell))
            if boxes > MOST_OUTPUT_BOXES_PER_CELL:
                crowded.append(f"{page.relative_to(SITE)} cell {index}: {boxes} boxes")
    assert not crowded, f"cells with more than {MOST_OUTPUT_BOXES_PER_CELL} output boxes: {crowded}"
