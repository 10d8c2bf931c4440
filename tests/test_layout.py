"""The package's layout keeps the lines its docstrings draw: each package's ``__init__`` says what belongs there
and, in a line ``May import: ...``, which parts of distlab its modules may import; this test holds every import
to those lines, finds any import cycle, and keeps the top level and every file small. Reads files only."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "distlab"
SPINE = "spine"  # the modules directly under src/distlab, the library ``python -m distlab.train`` runs
MOST_AT_THE_TOP = 12
MOST_LINES = 500


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
PACKAGES = sorted({p.parent for p in PACKAGE.rglob("*.py")})


def _unit(module: str) -> str:
    """``spine`` for distlab itself and its top-level modules, else the subpackage's name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else SPINE


def _allowed(package: Path) -> set[str]:
    """The names on the ``May import:`` line of a package's docstring ('nothing': none)."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    lines = re.findall(r"^May import: (.+)\.$", doc, re.M)
    assert len(lines) == 1, f"{package.name}/__init__.py: its docstring needs one line 'May import: ...'"
    names = {name.strip() for name in lines[0].split(",")}
    return set() if names == {"nothing"} else names


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
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False, typing_only)
            elif isinstance(child, ast.If) and _is_type_checking(child):
                visit(child, top, True)
            else:
                visit(child, top, typing_only)

    visit(ast.parse(path.read_text()), True, False)
    return found


def test_every_package_says_what_belongs_there_and_what_it_may_import():
    units = {SPINE} | {p.name for p in PACKAGES if p != PACKAGE}
    top_modules = {m.split(".")[1] for m in MODULES if m.count(".") == 1 and _unit(m) == SPINE}
    for package in PACKAGES:
        init = package / "__init__.py"
        assert init.is_file(), f"{package.relative_to(PACKAGE)} has modules but no __init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.splitlines()[0]) > 20, f"{init.relative_to(PACKAGE)}: say in one line what belongs here"
        unknown = _allowed(package) - units - top_modules
        assert not unknown, f"{init.relative_to(PACKAGE)}: may import unknown {sorted(unknown)}"


def test_imports_cross_only_the_lines_the_package_docstrings_draw():
    crossings = []
    for module in MODULES:
        mine = _unit(module)
        allowed = _allowed(PACKAGE if mine == SPINE else PACKAGE / mine)
        for imported, _, _ in _imports(module):
            theirs = _unit(imported)
            top_module = imported.split(".")[1] if imported.count(".") >= 1 else ""
            if theirs == mine or theirs in allowed or (theirs == SPINE and top_module in allowed):
                continue
            crossings.append(
                f"{module} imports {imported} ({mine} may import: {', '.join(sorted(allowed)) or 'nothing'})"
            )
    assert not crossings, "imports across the lines the package docstrings draw:\n" + "\n".join(crossings)


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


def test_a_small_top_level_and_small_files():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MOST_AT_THE_TOP, f"{len(top)} modules directly under src/distlab: {top}"
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MOST_LINES
    }
    assert not long, f"files over {MOST_LINES} lines: {long}"


def test_the_checks_see_the_layout():
    # the guard reads what it means to guard: every package, a crossing it allows and one it refuses
    assert {"parallel", "bench", "demos", "plots", "predict"} <= {p.name for p in PACKAGES}
    assert ("distlab.runtime", True, False) in _imports("distlab.train")
    assert "bench" not in _allowed(PACKAGE / "plots") and "demos" not in _allowed(PACKAGE)
