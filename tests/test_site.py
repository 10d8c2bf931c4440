"""The built site, where one exists (`jupyter-book build book` writes it; CI builds it after
the tests and runs this file again): no machine paths on any page, no cell whose output
breaks into a column of boxes (one per printed line, as unmerged streams render), and every
link of the claims ledger (book/claims.md) reaching an existing anchor of an existing page.

Without a built site the ledger's data (book/claims.yml) is checked on its own: every claim has
a finding, every checked claim evidence, and every evidence label a `(label)=` line before a
heading in some book/*.md, which is what lets the page's {ref} roles resolve.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

import pytest
import yaml

BOOK = Path(__file__).resolve().parents[1] / "book"
SITE = BOOK.parent / "_build" / "html"
CLAIMS = BOOK / "claims.yml"


MOST_OUTPUT_BOXES_PER_CELL = 4


def _pages() -> list[Path]:
    pages = sorted(SITE.rglob("*.html")) if SITE.is_dir() else []
    if not pages:
        if os.environ.get("DISTLAB_REQUIRE_SITE"):  # CI, right after building the site: a skip would hide it
            pytest.fail("DISTLAB_REQUIRE_SITE is set, but there is no built site in _build/html")
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


def test_open_in_kaggle_opens_a_notebook_of_this_repository():
    """A lab page links "Open in Kaggle" only when _config.yml names this course's repository, and the link
    opens that lab's notebook there, never Jupyter Book's default repository."""
    labs = [page for page in _pages() if page.parent.name == "labs"]
    assert labs, "the site has lab pages"
    repository = (yaml.safe_load((BOOK.parent / "_config.yml").read_text()).get("repository") or {}).get("url")
    for page in labs:
        links = re.findall(r'href="https://kaggle\.com/kernels/welcome\?src=([^"]+)"', page.read_text(errors="replace"))
        assert "executablebooks" not in page.read_text(errors="replace"), page.name
        if not repository:
            assert links == [], f"{page.name} links Kaggle to a repository _config.yml does not name"
            continue
        assert len(links) == 1, page.name
        prefix = f"{repository.rstrip('/')}/blob/"
        assert links[0].startswith(prefix), links[0]
        path = links[0][len(prefix) :].split("/", 1)[1]
        assert path == f"notebooks/{page.stem}.ipynb" and (BOOK.parent / path).is_file(), links[0]


def test_labs_are_shown_unrun_or_as_played_and_say_which_while_chapters_show_their_outputs():
    """The build does not execute the labs (_config.yml's exclude_patterns): a lab page with a played copy
    committed under book/results/labs/ shows that copy's outputs under its label (GPUs, date, commit); every
    other lab page says it is shown unrun and has no output; every chapter with code cells still shows what
    they printed or drew."""
    import importlib.util
    from html import escape

    spec = importlib.util.spec_from_file_location("distlab_play_labs", BOOK.parent / "scripts" / "play_labs.py")
    play = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(play)
    for page in _pages():
        html = page.read_text(errors="replace")
        cells, outputs = html.count('<div class="cell '), html.count('<div class="cell_output')
        if page.parent.name == "labs":
            played = play.choose(BOOK / "results" / "labs", page.stem)
            if played is None:
                assert "This lab is shown unrun" in html and outputs == 0 and "distlab-played" not in html, page.name
            else:
                assert escape(play.label(play.provenance(play.read(played)))) in html and outputs > 0, page.name
                assert "This lab is shown unrun" not in html, page.name
        elif cells:
            assert "This lab is shown unrun" not in html and outputs > 0, page.name


NOTES = {"000", "001", "002", "003", "004"}
TOPICS = {"pin_memory", "DDP", "ring", "FSDP", "speed-ups", "scaling", "memory", "platforms"}
FINDINGS = {"holds", "wrong", "holds only when", "not checked"}
KINDS = {"measured", "tested", "derived", "predicted", "cited", "none"}
MUST_BE_LISTED = {
    "cnn-120k-parameters": "the CNN's 120K parameters",
    "fsdp-all-reduces-gradients": "FSDP all-reducing gradients",
    "two-to-three-times-communication": "2-3x more communication",
    "7b-fsdp-14gb-fits": "7B with FSDP on 2 GPUs at 14 GB",
    "min-num-params-1m": "min_num_params=1M on the CNN",
    "vit-l-18-to-10-gb": "ViT-L 18 GB -> 10 GB",
    "1b-10b-cannot-fit": "1B-10B cannot fit on one GPU",
    "fsdp-scales-better-8-plus": "FSDP scales better at 8+ GPUs",
    "scaling-numbers": "1.9/3.5/6x against 1.8/3.7/7.5x",
    "ddp-overhead-5-10-percent": "DDP overhead 5-10 %",
    "pinned-10-15-percent-transfer": "pin_memory 10-15 %",
    "non-blocking-5-10-percent": "non_blocking 5-10 %",
    "pinned-combined-15-20-percent": "combined 15-20 %",
    "colab-no-nccl": "Colab has no NCCL",
    "macos-full-nccl": "macOS has full NCCL",
    "shard-grad-op-only-grads-optimizer": "SHARD_GRAD_OP shards only gradients and optimizer state",
}
LABEL = re.compile(r"^\(([\w-]+)\)=$")


def _claims() -> list[dict]:
    return yaml.safe_load(CLAIMS.read_text())


def _labels_before_headings() -> dict[str, str]:
    """``(label)=`` lines of book/*.md followed (after blank lines) by a heading: label -> page."""
    found = {}
    for page in sorted(BOOK.glob("*.md")):
        lines = page.read_text().splitlines()
        for index, line in enumerate(lines):
            match = LABEL.match(line)
            following = next((later for later in lines[index + 1 :] if later.strip()), "")
            if match and following.startswith("#"):
                found[match.group(1)] = page.name
    return found


def _problems(claim: dict) -> list[str]:
    """What is missing or unknown in one entry of claims.yml."""
    problems = [f"no {key}" for key in ("claim", "notes", "topic", "finding", "why") if not claim.get(key)]
    if not set(claim.get("notes") or []) <= NOTES:
        problems.append(f"notes {claim['notes']} not among {sorted(NOTES)}")
    if claim.get("topic") not in TOPICS:
        problems.append(f"topic {claim.get('topic')!r} not one of {sorted(TOPICS)}")
    if claim.get("finding") not in FINDINGS:
        problems.append(f"finding {claim.get('finding')!r} not one of {sorted(FINDINGS)}")
    if claim.get("kind") not in KINDS:
        problems.append(f"kind {claim.get('kind')!r} not one of {sorted(KINDS)}")
    if claim.get("kind") == "none" and claim.get("finding") != "not checked":
        problems.append("a checked finding rests on evidence of some kind, not none")
    if (claim.get("finding") == "holds only when") != bool(claim.get("when")):
        problems.append("a 'when' goes with 'holds only when', and only with it")
    if claim.get("finding") != "not checked" and not claim.get("evidence"):
        problems.append("checked, but no evidence")
    return problems


def test_every_claim_has_a_finding_and_checked_ones_their_evidence():
    claims = _claims()
    ids = Counter(claim["id"] for claim in claims)
    assert not [name for name, count in ids.items() if count > 1], "claim ids must be unique"
    wrong = {claim.get("id", "?"): _problems(claim) for claim in claims if _problems(claim)}
    assert not wrong, f"claims.yml: {wrong}"
    missing = {name: what for name, what in MUST_BE_LISTED.items() if name not in ids}
    assert not missing, f"claims the ledger must list: {missing}"
    assert {claim["topic"] for claim in claims} == TOPICS


def test_every_evidence_label_is_a_section_of_the_book():
    labels = _labels_before_headings()
    unknown = sorted({label for claim in _claims() for label in claim["evidence"] if label not in labels})
    assert not unknown, f"evidence labels with no `(label)=` line before a heading in book/*.md: {unknown}"


def test_the_ledger_page_shows_every_topic():
    page = (BOOK / "claims.md").read_text()
    absent = sorted(topic for topic in TOPICS if f"{{glue:md}} claims-{topic}\n" not in page)
    assert not absent, f"book/claims.md shows no table for the topics {absent}"


def test_the_ledger_says_what_kind_of_evidence_each_finding_rests_on():
    _pages()
    html = (SITE / "claims.html").read_text()
    tables = re.findall(r"<table.*?</table>", html, re.S)
    assert tables and all("<p>Kind</p></th>" in table for table in tables), "a claims table without its Kind column"
    shown = [kind for table in tables for kind in re.findall(r"<td><p>([a-z]+)</p></td>\s*</tr>", table)]
    order = ["pin_memory", "DDP", "ring", "FSDP", "speed-ups", "scaling", "memory", "platforms"]  # the page's
    expected = [claim["kind"] for topic in order for claim in _claims() if claim["topic"] == topic]
    assert shown == expected, "the Kind column does not list each claim's kind"
    assert "predictions alone" in html


def test_every_ledger_link_reaches_an_anchor():
    _pages()
    ledger = SITE / "claims.html"
    assert ledger.is_file(), "the built site has no claims.html: is `claims` in _toc.yml?"
    html = ledger.read_text()
    tables = re.findall(r"<table.*?</table>", html, re.S)
    unresolved = [m for table in tables for m in re.findall(r'<span class="xref std std-ref">([^<]*)</span>', table)]
    assert not unresolved, f"evidence labels Sphinx could not resolve: {unresolved}"
    links = [href for table in tables for href in re.findall(r'<a class="reference internal" href="([^"]*)"', table)]
    assert len(links) == sum(len(claim["evidence"]) for claim in _claims())
    broken = []
    for href in links:
        path, _, anchor = href.partition("#")
        target = (ledger.parent / path) if path else ledger
        if not target.is_file():
            broken.append(f"{href}: no such page")
        elif anchor and f'id="{anchor}"' not in target.read_text(errors="replace"):
            broken.append(f"{href}: no element with id {anchor!r}")
    assert not broken, f"ledger links that lead nowhere: {broken}"
