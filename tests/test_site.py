"""The built site, where one exists (`jupyter-book build book` writes it; CI builds it after
the tests and checks the same things there): no machine paths on any page."""

from __future__ import annotations

from pathlib import Path

import pytest

SITE = Path(__file__).resolve().parents[1] / "_build" / "html"


def test_no_page_shows_a_machine_path():
    pages = sorted(SITE.rglob("*.html")) if SITE.is_dir() else []
    if not pages:
        pytest.skip("no built site: run `jupyter-book build book` first")
    leaking = [str(page.relative_to(SITE)) for page in pages if "/tmp/" in page.read_text(errors="replace")]
    assert not leaking, f"pages that show a /tmp/ path: {leaking}"
