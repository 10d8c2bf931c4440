"""A learner's function as a module the ranks can import.

A function typed into a notebook cell lives in the kernel's ``__main__``, which no other process can import,
and a fork of a kernel that has run backward cannot run autograd again. So the grader ships source code: the
function's own, every helper function or class of the same notebook it names, an import line for every
module or library function it names, and the value of every plain constant. Anything else it names (a tensor,
a model) cannot travel, and :func:`module_source` says so in one line.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import textwrap
import types

import torch

from ..errors import DistlabError

PLAIN = (bool, int, float, complex, str, bytes, type(None))


def _is_plain(value) -> bool:
    if isinstance(value, PLAIN) or isinstance(value, torch.dtype):
        return True
    if isinstance(value, (tuple, list, frozenset, set)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_is_plain(k) and _is_plain(v) for k, v in value.items())
    return False


def _names_used(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_used(const)
    return names


def _source_of(obj, what: str) -> str:
    try:
        return textwrap.dedent(inspect.getsource(obj))
    except (OSError, TypeError):
        raise DistlabError(
            f"check() cannot read the source of {what}: define it with `def` in a notebook cell or a .py file"
        ) from None


def _own_code(obj, home: dict) -> bool:
    """Defined in the learner's namespace (a notebook cell or the same file), not imported from a package."""
    return getattr(obj, "__module__", None) == home.get("__name__")


def module_source(fn) -> tuple[str, str]:
    """``(source of a module defining fn and all it needs, fn's name in it)``; DistlabError if it cannot travel."""
    if not isinstance(fn, types.FunctionType):
        raise DistlabError(f"check() takes the function you wrote, not {type(fn).__name__}: pass it without calling it")
    if fn.__name__ == "<lambda>":
        raise DistlabError("check() cannot send a lambda to the ranks: write it as a `def` function")
    home = fn.__globals__
    imports: list[str] = []
    constants: list[str] = []
    bodies: list[str] = []
    seen: set[str] = set()

    def visit(obj, name: str) -> None:
        code = obj.__code__ if isinstance(obj, types.FunctionType) else None
        if code is None:  # a class: every method's names
            names = set()
            for member in vars(obj).values():
                inner = getattr(member, "__func__", member)
                if isinstance(inner, types.FunctionType):
                    names |= _names_used(inner.__code__)
        else:
            names = _names_used(code)
        for used in sorted(names):
            if used in seen or used not in home:
                continue
            seen.add(used)
            value = home[used]
            if isinstance(value, types.ModuleType):
                alias = "" if value.__name__ == used else f" as {used}"
                imports.append(f"import {value.__name__}{alias}")
            elif (isinstance(value, (types.FunctionType, type))) and _own_code(value, home):
                visit(value, used)
                bodies.append(_source_of(value, f"`{used}`"))
            elif callable(value) and getattr(value, "__module__", None) and hasattr(value, "__qualname__"):
                if "." in value.__qualname__ or value.__module__ in ("__main__", home.get("__name__")):
                    raise DistlabError(f"check() cannot send `{used}` to the ranks: define it at the top of a cell")
                alias = "" if value.__qualname__ == used else f" as {used}"
                imports.append(f"from {value.__module__} import {value.__qualname__}{alias}")
            elif _is_plain(value):
                constants.append(f"{used} = {value!r}")
            elif used not in vars(builtins):
                raise DistlabError(
                    f"check() cannot send `{used}` (a {type(value).__name__}) to the ranks: "
                    f"create it inside your function, or pass what it holds as plain numbers"
                )

    visit(fn, fn.__name__)
    own = _source_of(fn, f"`{fn.__name__}`")
    _refuse_decorators(own, fn.__name__)
    # annotations stay unevaluated: a hint like `nn.Module` names what the body may never use
    head = ["from __future__ import annotations", "import torch", "import torch.distributed as dist"]
    parts = [*head, *dict.fromkeys(imports), *constants, *bodies, own]
    return "\n\n".join(parts) + "\n", fn.__name__


def _refuse_decorators(source: str, name: str) -> None:
    tree = ast.parse(source)
    node = tree.body[0] if tree.body else None
    if isinstance(node, ast.FunctionDef) and node.decorator_list:
        raise DistlabError(f"check() grades `{name}` itself: remove its decorator and pass the plain function")


def is_stub(fn) -> bool:
    """The body is still the page's placeholder: a docstring, ``...``, ``pass``, ``raise NotImplementedError``."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return False
    node = tree.body[0] if tree.body else None
    if not isinstance(node, ast.FunctionDef):
        return False
    body = list(node.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    for statement in body:
        if isinstance(statement, ast.Pass):
            continue
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
            continue  # ``...``
        if isinstance(statement, ast.Raise) and "NotImplementedError" in ast.unparse(statement):
            continue
        return False
    return True
