"""The package's layout keeps the lines its docstrings draw: each package's ``__init__`` says what belongs there
and, in a line ``May import: ...``, which parts of distlab its modules may import; the top level's modules are
two tiers, core and run, each with such a line in the package's own docstring. This test holds every import
(lazy and type-checking ones too) to those lines, finds any cycle among modules and any circle among the tiers
and packages, and keeps the top level and every file small. Reads files only."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "distlab"
MOST_AT_THE_TOP = 12
MOST_LINES = 500


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
PACKAGES = sorted({p.parent for p in PACKAGE.rglob("*.py")})


def _names(line: str) -> set[str]:
    names = {name.strip() for name in line.split(",")}
    return set() if names == {"nothing"} else names


def _tiers() -> dict[str, tuple[set[str], set[str]]]:
    """``core`` and ``run``: their modules and what they may import, from two lines of the package's docstring
    (``Core: errors, runtime, ... May import: comm, measure.``)."""
    doc = ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text())) or ""
    found = re.findall(r"^(Core|Run): (.+?)\. May import: (.+)\.$", doc, re.M)
    assert sorted(name for name, _, _ in found) == ["Core", "Run"], "distlab/__init__.py: one Core and one Run line"
    return {name.lower(): (_names(modules), _names(allowed)) for name, modules, allowed in found}


TIERS = _tiers()


def _unit(module: str) -> str:
    """The tier of distlab itself and its top-level modules (``core`` or ``run``), else the package's dotted name
    below distlab (``exercises.solutions`` for a module of that sub-package)."""
    parts = module.split(".")
    package = [part for i, part in enumerate(parts[1:], 1) if (PACKAGE.joinpath(*parts[1 : i + 1])).is_dir()]
    if package:
        return ".".join(package)
    if len(parts) == 1:
        return "core"  # the package's own __init__: its version and the versions it refuses
    tier = [name for name, (modules, _) in TIERS.items() if parts[1] in modules]
    assert len(tier) == 1, f"{module}: name it in one tier line of distlab/__init__.py (Core: or Run:)"
    return tier[0]


def _allowed(unit: str) -> set[str]:
    """The names on a unit's ``May import:`` line: a tier's in the package docstring, a package's in its own
    ('nothing': none)."""
    if unit in TIERS:
        return TIERS[unit][1]
    doc = ast.get_docstring(ast.parse(PACKAGE.joinpath(*unit.split("."), "__init__.py").read_text())) or ""
    lines = re.findall(r"^May import: (.+)\.$", doc, re.M)
    assert len(lines) == 1, f"{unit}/__init__.py: its docstring needs one line 'May import: ...'"
    return _names(lines[0])


def _may_import(mine: str, imported: str) -> bool:
    """Whether unit ``mine`` may import module ``imported``: its own unit, its package from a sub-package, a
    unit on its line, or a top-level module its line names."""
    theirs, allowed = _unit(imported), _allowed(mine)
    top_module = imported.split(".")[1] if imported.count(".") >= 1 else ""
    return (
        theirs == mine
        or theirs in allowed
        or mine.startswith(theirs + ".")
        and theirs in allowed
        or (theirs in TIERS and top_module in allowed)
    )


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(module: str) -> list[tuple[str, bool, bool]]:
    """``(imported module, at module level, only for type checking)`` for every import of a distlab module in
    ``module``'s file, those inside functions included; ``from package import submodule`` names the submodule."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, top: bool, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    source = ".".join(base + ([child.module] if child.module else []))
                else:
                    source = child.module or ""
                if source == "distlab" or source.startswith("distlab."):
                    for alias in child.names:
                        sub = f"{source}.{alias.name}"
                        found.append((sub if sub in MODULES else source, top, typing_only))
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name == "distlab" or alias.name.startswith("distlab."):
                        found.append((alias.name, top, typing_only))
            elif isinstance(child, ast.Assign) and any(getattr(t, "id", "") == "PRELOAD" for t in child.targets):
                # a rank server's preload list (distlab.jobs.rank_context): the modules it names are imported
                # for this module, in the ranks it starts, so they are held to its lines as a lazy import
                for name in ast.literal_eval(child.value):
                    if name == "distlab" or name.startswith("distlab."):
                        found.append((name, False, typing_only))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False, typing_only)
            elif isinstance(child, ast.If) and _is_type_checking(child):
                visit(child, top, True)
            else:
                visit(child, top, typing_only)

    visit(ast.parse(path.read_text()), True, False)
    return found


def test_every_package_says_what_belongs_there_and_what_it_may_import():
    packages = [".".join(p.relative_to(PACKAGE).parts) for p in PACKAGES if p != PACKAGE]
    top_modules = {m.split(".")[1] for m in MODULES if m.count(".") == 1 and _unit(m) in TIERS}
    assert top_modules == set().union(*(modules for modules, _ in TIERS.values())), "a tier names no such module"
    for package in PACKAGES:
        init = package / "__init__.py"
        assert init.is_file(), f"{package.relative_to(PACKAGE)} has modules but no __init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.splitlines()[0]) > 20, f"{init.relative_to(PACKAGE)}: say in one line what belongs here"
        assert not re.search(r"^\s*[*-] :mod:`", doc, re.M), (
            f"{init.relative_to(PACKAGE)}: no list of the package's modules (the README's tree draws them, and a "
            "list in a docstring drifts)"
        )
    for unit in [*TIERS, *packages]:
        unknown = _allowed(unit) - set(TIERS) - set(packages) - top_modules
        assert not unknown, f"{unit}: may import unknown {sorted(unknown)}"


def test_imports_cross_only_the_lines_the_package_docstrings_draw():
    crossings = sorted(
        {
            f"{module} imports {imported} ({_unit(module)} may import: {', '.join(sorted(_allowed(_unit(module))))})"
            for module in MODULES
            for imported, _, _ in _imports(module)
            if not _may_import(_unit(module), imported)
        }
    )
    assert not crossings, "imports across the lines the package docstrings draw:\n" + "\n".join(crossings)


def _outer(unit: str) -> str:
    return unit.split(".")[0]  # a sub-package belongs to its package


def test_no_circle_among_the_tiers_and_packages():
    """One direction between the tiers and the packages: no import, lazy or for type checking either, goes back
    up. (``config`` imports the strategies; a strategy that named the configuration's class, even only for
    type checking, would close the circle config -> parallel -> config.)"""
    graph: dict[str, set[str]] = {}
    why: dict[tuple[str, str], str] = {}
    for module in MODULES:
        for imported, _, _ in _imports(module):
            mine, theirs = _outer(_unit(module)), _outer(_unit(imported))
            if mine != theirs:
                graph.setdefault(mine, set()).add(theirs)
                why.setdefault((mine, theirs), f"{module} imports {imported}")

    def reaches(start: str, goal: str) -> bool:
        seen, stack = set(), [start]
        while stack:
            unit = stack.pop()
            if unit == goal:
                return True
            if unit not in seen:
                seen.add(unit)
                stack.extend(graph.get(unit, ()))
        return False

    back = [why[a, b] + f" ({a} -> {b}, and {b} reaches {a})" for a in graph for b in graph[a] if reaches(b, a)]
    assert not back, "a circle among tiers and packages:\n" + "\n".join(sorted(back))


def test_no_module_level_import_cycle():
    graph = {m: {i for i, top, typing_only in _imports(m) if top and not typing_only and i != m} for m in MODULES}
    done, path = set(), []

    def visit(module: str) -> None:
        if module in path:
            cycle = path[path.index(module) :] + [module]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            visit(imported)
        path.pop()
        done.add(module)

    for module in MODULES:
        visit(module)


def test_only_the_tests_import_their_harness():
    """distlab.testing is the tests' harness (the rank pool, fresh ranks, toy models only tests train): no module
    of the library, no page, lab or script imports it, a rank server's preload list included. What they share
    with the tests lives in the library (tolerances and ToyWithFrozen in models, the tiny MNIST in data)."""
    importers = sorted(
        module
        for module in MODULES
        if module != "distlab.testing" and any(i == "distlab.testing" for i, _, _ in _imports(module))
    )
    root = PACKAGE.parents[1]
    pages = [*root.glob("book/*.md"), *root.glob("notebooks/*.ipynb"), *root.glob("scripts/*.py")]
    importers += sorted(
        str(page.relative_to(root))
        for page in pages
        if re.search(r"\bdistlab\.testing\b|from distlab import testing\b", page.read_text())
    )
    assert not importers, f"the tests' harness imported outside the tests: {importers}"


def test_a_small_top_level_and_small_files():
    """At most MOST_AT_THE_TOP modules at the top, and no Python file over MOST_LINES lines in the library, the
    scripts or the tests: a file that outgrows it is split by role, not packed to fit."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MOST_AT_THE_TOP, f"{len(top)} modules directly under src/distlab: {top}"
    root = PACKAGE.parents[1]
    files = [*PACKAGE.rglob("*.py"), *(root / "scripts").rglob("*.py"), *(root / "tests").rglob("*.py")]
    long = {str(p.relative_to(root)): n for p in files if (n := len(p.read_text().splitlines())) > MOST_LINES}
    assert not long, f"files over {MOST_LINES} lines (split each by role): {long}"


def test_the_checks_see_the_layout():
    # the guard reads what it means to guard: every package, a crossing it allows and one it refuses
    assert {"parallel", "bench", "demos", "plots", "predict"} <= {p.name for p in PACKAGES}
    assert ("distlab.runtime", True, False) in _imports("distlab.train")
    assert ("distlab.train", False, False) in _imports("distlab.testing")  # its rank server's preload list
    assert "bench" not in _allowed("plots") and "parallel" not in _allowed("core") and "parallel" in _allowed("run")
    assert _unit("distlab.config") == "run" and _unit("distlab.runtime") == "core"
    assert _unit("distlab.exercises.solutions.zero") == "exercises.solutions"
    assert not _may_import("parallel", "distlab.config") and _may_import("run", "distlab.parallel.base")
