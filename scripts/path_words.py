"""Count each chapter's teaching path: the prose words from the top of the page to its Takeaways box.

    python scripts/path_words.py             # the six core chapters, a table
    python scripts/path_words.py --max 3000  # exit 1 if any core chapter's path is longer

Prose only: fenced code, directive options (`:class:`, `:tags:`, ...), display maths and label lines are left
out; the contents of a dropdown or admonition count as prose. "shown" counts the library's code shown open on the
path (`literalinclude`), "folded" the includes on the path inside a dropdown (the exercises' solutions among
them). "reference" counts the prose after the Takeaways box.
"""

import argparse
import pathlib
import re
import sys

CORE = ("ddp", "ring_allreduce", "fsdp_from_scratch", "fsdp2_in_practice", "ddp_vs_fsdp", "pinned_memory")
TAKEAWAYS = re.compile(r"admonition\}\s*Takeaways", re.I)
WORD = re.compile(r"[A-Za-z0-9][\w'\-.,/]*")
SKIPPED = ("$$", ":::", ":class:", ":tags:", ":pyobject:", ":language:", ":lines:", ":start-after:", ":end-before:")


def count(text: str) -> dict:
    """{'path': words before the Takeaways box, 'reference': words after it, 'shown'/'folded': literalincludes before
    it, open or inside a dropdown}."""
    lines = text.splitlines()
    if lines and lines[0] == "---":
        lines = lines[lines.index("---", 1) + 1 :]
    words, includes, code, part = {"path": 0, "reference": 0}, {"shown": 0, "folded": 0}, False, "path"
    dropdown = None  # the fence that closes the dropdown we are in
    for line in lines:
        s = line.strip()
        if TAKEAWAYS.search(s):
            part = "reference"
        if dropdown is None and "{dropdown}" in s:
            dropdown = s[: len(s) - len(s.lstrip(":`"))]
        elif dropdown is not None and s == dropdown:
            dropdown = None
        if s.startswith("```"):
            if "literalinclude" in s and part == "path":
                includes["folded" if dropdown else "shown"] += 1
            code = False if code else not s.startswith(("```{dropdown", "```{admonition"))
            continue
        if code or s.startswith(SKIPPED) or (s.startswith("(") and s.endswith(")=")):
            continue
        words[part] += len(WORD.findall(s))
    return {**words, **includes}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pages", nargs="*", help="pages under book/ (default: the six core chapters)")
    parser.add_argument("--book", default=str(pathlib.Path(__file__).resolve().parents[1] / "book"))
    parser.add_argument("--max", type=int, default=None, help="exit 1 if a path has more words than this")
    args = parser.parse_args(argv)
    pages = args.pages or CORE
    print(f"{'chapter':<20} {'path':>6} {'reference':>9} {'includes shown':>14} {'folded':>6}")
    over = []
    for name in pages:
        c = count((pathlib.Path(args.book) / f"{name}.md").read_text())
        print(f"{name:<20} {c['path']:>6} {c['reference']:>9} {c['shown']:>14} {c['folded']:>6}")
        if args.max is not None and c["path"] > args.max:
            over.append(f"{name} ({c['path']})")
    if over:
        print(f"path_words: over {args.max} words to the Takeaways: {', '.join(over)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
