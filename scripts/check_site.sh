#!/usr/bin/env bash
# The book as readers get it: the README's build command, then the built site's tests (no machine paths,
# a few output boxes per cell, every ledger link resolving; every page in headless Chromium, offline, one
# screenshot each): parts 2 and 3 of .ci/run, for a developer who wants them alone. The browser test needs
# Debian's chromium (apt-get install chromium).
set -euo pipefail
cd "$(dirname "$0")/.."

pip install -r requirements.txt && jupyter-book build book
test -f _build/html/running.html && test -f _build/html/labs/lab0_first_run.html
export DISTLAB_SCREENSHOTS="$PWD/_build/screenshots"
DISTLAB_REQUIRE_SITE=1 python -m pytest -q -m "not gpu" tests/test_site.py tests/test_browser.py
echo "== screenshots of every page: $DISTLAB_SCREENSHOTS"
