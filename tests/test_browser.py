"""The built site in a real browser, as a reader offline sees it.

Headless Chromium (Debian's `chromium`, driven by Playwright through `executable_path`: never a
browser download) opens every page of `_build/html`, served on 127.0.0.1 by a thread of this test,
with every request to any other host blocked. Per page: nothing requested from another host, no
console error, no local resource that fails to load, every image and figure loaded, every local
link's file and `#anchor` present; one full-page screenshot per page goes into $DISTLAB_SCREENSHOTS
(default `_build/screenshots`), which CI keeps. Then what a reader uses: the animations step when
their buttons are clicked, each calculator answers a changed input, Kaggle links have the one form
that opens a lab, the download menu offers the page's source (a notebook included), code cells have
working copy buttons, long outputs sit in scroll boxes, and the search finds every chapter.

CI builds the book and then runs this file; without a built site, Chromium or Playwright it skips
with one line. $DISTLAB_SITE points it at another built site, $DISTLAB_CHROMIUM at another binary.
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import json
import os
import re
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote_plus, unquote, urlsplit

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(os.environ.get("DISTLAB_SITE") or ROOT / "_build" / "html").resolve()
SCREENSHOTS = Path(os.environ.get("DISTLAB_SCREENSHOTS") or ROOT / "_build" / "screenshots")
CHROMIUM = shutil.which(os.environ.get("DISTLAB_CHROMIUM") or "chromium")


def _why_not() -> str | None:
    if not (SITE / "intro.html").is_file():
        return f"no built site in {SITE}: run `jupyter-book build book` first"
    if not CHROMIUM:
        return "no Chromium: apt-get install chromium (Debian's; scripts/check_site.sh runs this test)"
    if importlib.util.find_spec("playwright") is None:
        return "no playwright: pip install -r requirements.txt"
    return None


if _why_not():
    if os.environ.get("DISTLAB_REQUIRE_SITE"):  # CI, right after building the site: a skip would hide it
        raise pytest.UsageError(f"DISTLAB_REQUIRE_SITE is set, but {_why_not()}")
    pytest.skip(_why_not(), allow_module_level=True)

_playwright = pytest.importorskip("playwright.sync_api")
sync_playwright, PlaywrightTimeout = _playwright.sync_playwright, _playwright.TimeoutError

# The flags DESIGN.md gives for Debian's Chromium; Playwright adds --headless, a fresh
# --user-data-dir and (with chromium_sandbox off, its default) --no-sandbox.
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# What marks a calculator: an element of this class holding <input>/<select> elements and at
# least one <output> element that shows the answer.
CALCULATOR = ".distlab-calculator"
# An "Open in Kaggle" link: Kaggle imports the notebook at a GitHub blob URL, nothing beside it.
KAGGLE_FORM = "https://kaggle.com/kernels/welcome?src=https://github.com/OWNER/REPO/blob/REF/notebooks/NAME.ipynb"
KAGGLE_LINK = re.compile(
    r"https://kaggle\.com/kernels/welcome\?src="
    r"https://github\.com/[\w.-]+/[\w.-]+/blob/[\w./-]+?/(?P<notebook>notebooks/[\w.-]+\.ipynb)"
)


def _pages() -> list[str]:
    """Every page of the site: its .html files, less the theme's template fragments in _static/."""
    pages = (path.relative_to(SITE) for path in SITE.rglob("*.html"))
    return sorted(str(page) for page in pages if not page.parts[0].startswith("_"))


def _redirect(page: str) -> str | None:
    """Where a redirect stub (`index.html`: a meta refresh and nothing else) sends the reader."""
    match = re.search(r'http-equiv="Refresh" content="0; url=([^"]+)"', (SITE / page).read_text(errors="replace"))
    return match.group(1) if match else None


def _screenshot_name(page: str) -> str:
    return page.replace("/", "__").removesuffix(".html") + ".png"


def _has_source(page: str) -> bool:
    """A page built from a chapter or lab (the site keeps its source in _sources/)."""
    stem = str(Path(page).with_suffix(""))
    return any((SITE / "_sources" / f"{stem}{suffix}").is_file() for suffix in (".md", ".ipynb"))


@dataclass
class Visit:
    """What one page showed and asked for."""

    page: str
    title: str = ""
    console_errors: list[str] = field(default_factory=list)
    off_site: list[str] = field(default_factory=list)
    local_failures: list[str] = field(default_factory=list)
    broken_images: list[str] = field(default_factory=list)
    empty_figures: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)  # absolute URLs of every <a href>
    ids: set[str] = field(default_factory=set)
    downloads: list[str] = field(default_factory=list)  # absolute URLs in the download menu
    code_blocks: int = 0
    copy_buttons: int = 0
    cells: int = 0
    long_outputs: list[int] = field(default_factory=list)  # heights (px) of outputs taller than the window
    untypeset_math: list[str] = field(default_factory=list)  # TeX that MathJax left as text
    animations: int = 0
    calculators: int = 0


# Read from the page once it has loaded; every lazy image is asked for now.
INSPECT = """async () => {
  const images = Array.from(document.images);
  images.forEach(img => { img.loading = "eager"; });
  await Promise.all(images.map(img => img.complete ? null : new Promise(done => {
    img.addEventListener("load", done); img.addEventListener("error", done); setTimeout(done, 5000);
  })));
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    await Promise.race([MathJax.startup.promise, new Promise(done => setTimeout(done, 10000))]);
  }
  const loaded = img => img.complete && img.naturalWidth > 0;
  const name = img => img.getAttribute("src") ? img.getAttribute("src").slice(0, 120) : `<img id=${img.id}>`;
  const figures = Array.from(document.querySelectorAll("figure"));
  const outputs = Array.from(document.querySelectorAll("div.cell_output"));
  const scrolls = el => el.scrollHeight > el.clientHeight && /auto|scroll/.test(getComputedStyle(el).overflowY);
  return {
    title: document.querySelector("h1") ? document.querySelector("h1").textContent.replace(/#$/, "").trim() : "",
    broken_images: images.filter(img => !loaded(img)).map(name),
    empty_figures: figures.filter(f => !Array.from(f.querySelectorAll("img")).some(loaded) && !f.querySelector("svg"))
                          .map(f => f.id || f.textContent.trim().slice(0, 80)),
    links: Array.from(document.querySelectorAll("a[href]")).map(a => a.href),
    ids: Array.from(document.querySelectorAll("[id]")).map(el => el.id)
           .concat(Array.from(document.querySelectorAll("a[name]")).map(a => a.name)),
    downloads: Array.from(document.querySelectorAll(".dropdown-download-buttons a[href]")).map(a => a.href),
    code_blocks: document.querySelectorAll("div.highlight").length,
    copy_buttons: document.querySelectorAll("div.highlight button.copybtn").length,
    cells: document.querySelectorAll("div.cell").length,
    long_outputs: outputs.filter(o => o.getBoundingClientRect().height > window.innerHeight && !scrolls(o))
                         .map(o => Math.round(o.getBoundingClientRect().height)),
    untypeset_math: Array.from(document.querySelectorAll("span.math, div.math"))
                         .filter(m => !m.querySelector("mjx-container")).map(m => m.textContent.trim().slice(0, 60)),
    animations: document.querySelectorAll("div.animation").length,
    calculators: document.querySelectorAll(CALCULATOR).length,
  };
}""".replace("CALCULATOR", json.dumps(CALCULATOR))


@pytest.fixture(scope="module")
def base_url():
    """The site on 127.0.0.1, from a thread of this process."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(SITE)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


def _offline_context(browser, base_url: str, off_site: list[str] | None = None, **options):
    """A fresh profile (a first visit) in which every request to another host is refused."""
    context = browser.new_context(**options)
    context.set_default_timeout(15_000)

    def refuse(route) -> None:
        if off_site is not None:
            off_site.append(route.request.url)
        route.abort()

    context.route(lambda url: not url.startswith(base_url), refuse)
    return context


def _visit(browser, base_url: str, page_name: str) -> Visit:
    visit = Visit(page_name)
    context = _offline_context(browser, base_url, visit.off_site)
    page = context.new_page()
    page.on("pageerror", lambda error: visit.console_errors.append(f"uncaught: {error.message}"))

    def on_console(message) -> None:
        if message.type == "error":
            where = message.location.get("url", "")
            if message.text.startswith("Failed to load resource") and not where.startswith(base_url):
                return  # a request to another host, refused here: test_nothing_is_requested_from_another_host
            visit.console_errors.append(f"{message.text} ({where})" if where else message.text)

    page.on("console", on_console)
    page.on(
        "requestfailed",
        lambda request: (
            request.url.startswith(base_url)
            and visit.local_failures.append(f"{request.url[len(base_url) :]}: {request.failure}")
        ),
    )
    page.on(
        "response",
        lambda response: (
            response.url.startswith(base_url)
            and response.status >= 400
            and visit.local_failures.append(f"{response.url[len(base_url) :]}: HTTP {response.status}")
        ),
    )
    page.goto(base_url + page_name, wait_until="load")
    page.wait_for_load_state("networkidle")
    for key, value in page.evaluate(INSPECT).items():
        setattr(visit, key, set(value) if key == "ids" else value)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / _screenshot_name(page_name)), full_page=True)
    context.close()
    return visit


@pytest.fixture(scope="module")
def visits(browser, base_url) -> dict[str, Visit]:
    """Every page but the redirect stubs, opened once, each in a fresh profile."""
    return {page: _visit(browser, base_url, page) for page in _pages() if not _redirect(page)}


def _failures(visits: dict[str, Visit], attribute: str) -> dict[str, list]:
    return {page: getattr(visit, attribute) for page, visit in visits.items() if getattr(visit, attribute)}


def _assert_none(found: dict, what: str) -> None:
    """Fail with one readable message: what was found, page by page."""
    if found:
        pytest.fail(f"{what}: " + "; ".join(f"{page}: {items}" for page, items in found.items()), pytrace=False)


def _site_path(url: str, base_url: str) -> tuple[str, str] | None:
    """(path of the file in the site, fragment) for a URL on the local server; None for any other."""
    if not url.startswith(base_url):
        return None
    parts = urlsplit(url)
    path = unquote(parts.path).lstrip("/") or "index.html"
    if (SITE / path).is_dir():
        path = f"{path.rstrip('/')}/index.html".lstrip("/")
    return path, unquote(parts.fragment)


def test_the_site_has_its_pages(visits):
    assert "intro.html" in visits and "ring_allreduce.html" in visits, sorted(visits)
    assert all(_redirect(page) is None or (SITE / _redirect(page)).is_file() for page in _pages())
    missing = {_screenshot_name(page) for page in visits} - {path.name for path in SCREENSHOTS.glob("*.png")}
    assert not missing, f"no screenshot in {SCREENSHOTS}: {sorted(missing)}"


def test_nothing_is_requested_from_another_host(visits):
    _assert_none(_failures(visits, "off_site"), "requests to other hosts (refused here)")


def test_no_console_error(visits):
    _assert_none(_failures(visits, "console_errors"), "console errors")


def test_math_is_typeset(visits):
    untypeset = {
        page: f"{len(tex)} formulas, e.g. {tex[0]!r}" for page, tex in _failures(visits, "untypeset_math").items()
    }
    _assert_none(untypeset, "math left as TeX")


def test_every_local_resource_loads(visits):
    _assert_none(_failures(visits, "local_failures"), "local requests that failed")


def test_every_image_and_figure_loaded(visits):
    _assert_none(_failures(visits, "broken_images"), "images not loaded")
    _assert_none(_failures(visits, "empty_figures"), "figures with nothing loaded")


def test_every_local_link_and_anchor_exists(visits, base_url):
    broken = {}
    for page, visit in visits.items():
        for url in visit.links:
            target = _site_path(url, base_url)
            if target is None:
                continue  # another host (not fetched offline) or not http: mailto:, javascript:
            path, fragment = target
            if not (SITE / path).is_file():
                broken.setdefault(page, []).append(f"{url[len(base_url) :]}: no such file")
            elif fragment and path in visits and fragment not in visits[path].ids:
                broken.setdefault(page, []).append(f"{url[len(base_url) :]}: no element with id {fragment!r}")
    _assert_none(broken, "broken links")


def test_kaggle_links_open_a_lab_notebook(visits):
    """Every link into Kaggle's kernels is an "Open in Kaggle" link to a notebook under notebooks/."""
    wrong = {}
    for page, visit in visits.items():
        for url in visit.links:
            host = urlsplit(url).hostname or ""
            if not (host == "kaggle.com" or host.endswith(".kaggle.com")) or "/kernels" not in url:
                continue
            match = KAGGLE_LINK.fullmatch(url)
            if not match:
                wrong.setdefault(page, []).append(f"{url}: not {KAGGLE_FORM}")
            elif not (ROOT / match["notebook"]).is_file():
                wrong.setdefault(page, []).append(f"{url}: no {match['notebook']} in the repository")
    _assert_none(wrong, "Kaggle links of the wrong form")


def test_the_download_menu_offers_the_page_source(visits, base_url):
    missing = {}
    for page, visit in visits.items():
        if not _has_source(page):
            continue
        stem = str(Path(page).with_suffix(""))
        sources = [u for u in visit.downloads if (_site_path(u, base_url) or ("",))[0].startswith(f"_sources/{stem}.")]
        if not sources:
            missing[page] = f"no link to _sources/{stem}.* in the download menu {visit.downloads}"
        for url in visit.downloads:
            path = (_site_path(url, base_url) or (url,))[0]
            if not (SITE / path).is_file():
                missing.setdefault(page, []).append(f"{path}: no such file")
    _assert_none(missing, "download menus")


def test_every_executable_page_offers_its_notebook(visits, base_url):
    missing = {}
    for page, visit in visits.items():
        if not visit.cells:
            continue
        offered = [(_site_path(url, base_url) or (url,))[0] for url in visit.downloads]
        notebooks = [path for path in offered if path.endswith(".ipynb")]
        if not notebooks:
            missing[page] = "no .ipynb in the download menu"
        for path in notebooks:
            if not (SITE / path).is_file() or "cells" not in json.loads((SITE / path).read_text()):
                missing[page] = f"{path}: not a notebook"
    _assert_none(missing, "pages with code cells and no notebook to download")


def test_every_code_block_has_a_copy_button(visits):
    assert sum(visit.code_blocks for visit in visits.values()) > 0
    missing = {p: f"{v.copy_buttons} of {v.code_blocks}" for p, v in visits.items() if v.copy_buttons < v.code_blocks}
    _assert_none(missing, "code blocks without a copy button")


def test_the_copy_button_copies_the_code(browser, base_url):
    context = _offline_context(browser, base_url, permissions=["clipboard-read", "clipboard-write"])
    page = context.new_page()
    page.goto(base_url + "ring_allreduce.html")
    block = page.locator("div.cell_input div.highlight").first
    block.hover()
    block.locator("button.copybtn").click()
    copied = page.evaluate("navigator.clipboard.readText()")
    assert copied.strip() and copied.strip() == block.locator("pre").inner_text().strip()
    context.close()


def test_long_outputs_are_collapsed(visits):
    """A cell's output taller than the window (720 px) scrolls in its own box or starts hidden."""
    _assert_none(_failures(visits, "long_outputs"), "outputs taller than the window, not in a scroll box (px)")


# A frame's fingerprint: a hash of the image's data URI.
FRAME = "img => { let h = 0; for (const c of img.src) h = (h * 31 + c.charCodeAt(0)) | 0; return h; }"


def test_the_animations_step_when_their_buttons_are_clicked(browser, base_url, visits):
    pages = [page for page, visit in visits.items() if visit.animations]
    assert "ring_allreduce.html" in pages, "the ring all-reduce animation is missing from ring_allreduce.html"
    context = _offline_context(browser, base_url)
    page = context.new_page()
    for name in pages:
        page.goto(base_url + name)
        for index, animation in enumerate(page.locator("div.animation").all()):
            where = f"{name}, animation {index}"
            image, slider = animation.locator("img").first, animation.locator("input.anim-slider")
            first = image.evaluate(FRAME)
            assert int(slider.input_value()) == 0, where
            animation.get_by_role("button", name="Next frame").click()
            assert int(slider.input_value()) == 1 and image.evaluate(FRAME) != first, f"{where}: Next frame"
            animation.get_by_role("button", name="Play", exact=True).click()
            page.wait_for_function(f"() => Number(document.getElementById({slider.get_attribute('id')!r}).value) > 1")
            animation.get_by_role("button", name="Pause").click()
            assert image.evaluate(FRAME) != first, f"{where}: Play"
            for button in animation.locator("button").all():
                icon = button.locator("svg, i").first
                assert icon.count() and icon.bounding_box()["width"] > 0, f"{where}: a button shows no icon"
    context.close()


def test_each_calculator_answers_a_changed_input(browser, base_url, visits):
    """Each element marked `distlab-calculator` answers in its <output> when an input changes."""
    context = _offline_context(browser, base_url)
    page = context.new_page()
    silent = {}
    for name in [name for name, visit in visits.items() if visit.calculators]:
        page.goto(base_url + name)
        for index, calculator in enumerate(page.locator(CALCULATOR).all()):
            answer = calculator.locator("output")
            before = answer.all_inner_texts()
            if not before:
                silent.setdefault(name, []).append(f"calculator {index}: no <output>")
            elif not calculator.evaluate(CHANGE_ONE_INPUT):
                silent.setdefault(name, []).append(f"calculator {index}: no <input> or <select> to change")
            else:
                try:
                    page.wait_for_function(
                        "([el, was]) => JSON.stringify(Array.from(el.querySelectorAll('output'), o => o.innerText)) "
                        "!== was",
                        arg=[calculator.element_handle(), json.dumps(before)],
                        timeout=5_000,
                    )
                except PlaywrightTimeout:
                    silent.setdefault(name, []).append(f"calculator {index}: still {before} 5 s after an input changed")
    context.close()
    _assert_none(silent, "calculators that do not answer")


# Change a calculator's first input to another valid value, as a reader would, and fire its events.
CHANGE_ONE_INPUT = """calc => {
  const input = calc.querySelector("input:not([type=hidden]):not([disabled]), select:not([disabled])");
  if (!input) return false;
  if (input.tagName === "SELECT") {
    input.selectedIndex = (input.selectedIndex + 1) % input.options.length;
  } else if (input.type === "checkbox" || input.type === "radio") {
    input.checked = !input.checked;
  } else if (input.type === "number" || input.type === "range") {
    const value = Number(input.value), min = input.min === "" ? null : Number(input.min);
    const max = input.max === "" ? null : Number(input.max);
    input.value = String(max !== null && value !== max ? max : min !== null && value !== min ? min : value * 2 + 1);
  } else {
    input.value = input.value + "1";
  }
  input.dispatchEvent(new Event("input", {bubbles: true}));
  input.dispatchEvent(new Event("change", {bubbles: true}));
  return true;
}"""


def test_the_search_finds_the_chapters(browser, base_url, visits):
    """Sphinx's search runs in the page from searchindex.js, offline: `ring`, then each chapter's title."""
    queries = {"ring": "ring_allreduce.html"}
    queries.update({visit.title: page for page, visit in visits.items() if _has_source(page) and visit.title})
    context = _offline_context(browser, base_url)
    page = context.new_page()
    missed = {}
    for query, expected in queries.items():
        page.goto(f"{base_url}search.html?q={quote_plus(query)}")
        page.wait_for_function("() => document.querySelector('#search-results > p')?.textContent.trim()")
        hrefs = page.eval_on_selector_all("ul.search li a", "links => links.map(a => a.href)")
        found = [(_site_path(href, base_url) or (href,))[0] for href in hrefs]
        if expected not in found:
            missed[query] = f"{expected} not among {found}"
    context.close()
    _assert_none(missed, "searches that miss their page")
