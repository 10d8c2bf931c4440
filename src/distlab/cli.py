"""One command-line style for every entry point.

A configuration is a dataclass whose fields carry their ``--help`` text; a
field that is itself a dataclass is a section, whose fields become flags of
the same command line (``--fsdp-reshard-after-forward`` stays one flag even
though it lives in the ``parallel`` section). :func:`parse` builds the
parser from the dataclass, so the documentation and the flags cannot drift
apart; :func:`entry_point` makes a module's ``main(argv)`` from its
configuration and the function that runs it; and :func:`finish_run` is the
rank-0 tail every entry point shares: write the result file, say where it
went.
"""

from __future__ import annotations

import argparse
import functools
import sys
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Callable, Literal, TypeVar

from .errors import DistlabError
from .results import write_result
from .runtime import Runtime

Config = TypeVar("Config")


def option(default: Any, help: str, *, flag: str = "", choices: list | None = None) -> Any:
    """A configuration field: its default, its ``--help`` text, and, when the
    attribute name is not the flag's, the flag (without dashes)."""
    return field(default=default, metadata={"help": help, "flag": flag, "choices": choices})


def section(cls: type) -> Any:
    """A field holding a nested configuration section."""
    return field(default_factory=cls)


def prog(module: str) -> str:
    return f"torchrun --standalone --nproc_per_node=N -m {module}"


def _flags(cls: type, prefix: str = "") -> typing.Iterator[tuple[str, str, Any, dict]]:
    """(flag, dest, type, metadata) of every leaf field, sections flattened."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        kind = hints[f.name]
        if is_dataclass(kind):
            yield from _flags(kind, f"{prefix}{f.name}.")
        else:
            yield (f.metadata.get("flag") or f.name).replace("_", "-"), f"{prefix}{f.name}", kind, f


def flag_names(cls: type) -> set[str]:
    """Every flag a configuration's command line takes, without its dashes (``device``, ``batch-size``)."""
    return {flag for flag, *_ in _flags(cls)}


def build_parser(cls: type, module: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog(module), description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flag, dest, kind, f in _flags(cls):
        title = dest.rpartition(".")[0] or "options"
        group = groups.get(title) or groups.setdefault(title, parser.add_argument_group(title))
        default = f.default if f.default is not MISSING else None
        choices = f.metadata.get("choices") or (
            list(typing.get_args(kind)) if typing.get_origin(kind) is Literal else None
        )
        if kind is bool:
            group.add_argument(
                f"--{flag}", dest=dest, action=argparse.BooleanOptionalAction, default=default, help=f.metadata["help"]
            )
        else:
            metavar = None if choices else flag.replace("-", "_").upper()
            group.add_argument(
                f"--{flag}",
                dest=dest,
                type=type(default),
                default=default,
                choices=choices,
                metavar=metavar,
                help=f.metadata["help"],
            )
    return parser


def _build(cls: type[Config], values: dict[str, Any], prefix: str = "") -> Config:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in fields(cls):
        kind = hints[f.name]
        kwargs[f.name] = (
            _build(kind, values, f"{prefix}{f.name}.") if is_dataclass(kind) else values[f"{prefix}{f.name}"]
        )
    return cls(**kwargs)


def _parser_for(cls: type, entry_point: str) -> argparse.ArgumentParser:
    if not entry_point:
        module = sys.modules[cls.__module__]
        entry_point = module.__spec__.name if module.__spec__ else cls.__module__  # "__main__" under python -m
    return build_parser(cls, entry_point, (cls.__doc__ or "").strip().splitlines()[0])


def _parse_with(cls: type[Config], parser: argparse.ArgumentParser, argv: list[str] | None) -> Config:
    config = _build(cls, vars(parser.parse_args(argv)))
    if hasattr(config, "validate"):
        config.validate()
    return config


def parse(cls: type[Config], argv: list[str] | None, entry_point: str = "") -> Config:
    """The configuration a command line asks for; validated if it can validate itself.
    The entry point is the class's module unless named; the class's docstring is the description."""
    return _parse_with(cls, _parser_for(cls, entry_point), argv)


def entry_point(config: type[Config], name: str = "") -> Callable[[Callable[[Config], None]], Callable[..., None]]:
    """Decorates ``main(cfg)``, the function that runs a parsed configuration, into the module's
    ``main(argv=None)``: the command line parsed with ``config`` (for ``name``, else the class's module), then the
    run. ``main.config`` is the class, which a launcher parses a command line with before any rank starts
    (:func:`distlab.labs.launch.entry_config`): one declaration, so what is checked is what runs."""

    def make_main(run: Callable[[Config], None]) -> Callable[..., None]:
        @functools.wraps(run)
        def main(argv: list[str] | None = None) -> None:
            run(parse(config, argv, name))

        main.config = config
        return main

    return make_main


def parse_or_refuse(cls: type[Config], argv: list[str], entry_point: str) -> Config:
    """:func:`parse`, for a launcher that checks a command line before it starts any rank: argparse's refusal
    (its usage, then exit status 2) is one :class:`~distlab.errors.DistlabError` line instead, naming the entry
    point. ``--help`` still prints the help and exits."""
    parser = _parser_for(cls, entry_point)

    def refuse(message: str):
        raise DistlabError(f"{entry_point}: {message}")

    parser.error = refuse  # argparse reports every refusal through it
    return _parse_with(cls, parser, argv)


def from_flags(cls: type[Config], **flags: Any) -> Config:
    """A configuration from flag names (``strategy="fsdp", batch_size=8``), as
    a command line would give them: the way to build one from Python."""
    values = {}
    for flag, dest, _, f in _flags(cls):
        name = flag.replace("-", "_")
        if f.default is MISSING and name not in flags:
            raise TypeError(f"{cls.__name__} needs {name}")
        values[dest] = flags.pop(name, f.default)
    if flags:
        raise TypeError(f"{cls.__name__} has no option {', '.join(sorted(flags))}")
    return _build(cls, values)


@dataclass
class DeviceOptions:
    """Where a benchmark runs."""

    device: Literal["auto", "cpu", "cuda"] = option("auto", "auto (cuda if present), cpu or cuda; the backend follows")
    backend: Literal["auto", "gloo", "nccl"] = option("auto", "override the backend (gloo also lets ranks share a GPU)")


@dataclass
class OutputOptions:
    """Where a benchmark writes its result."""

    out: str = option("results", "directory for the result JSON (written by rank 0)")
    name: str = option("", "result file name without .json (default: named after what was measured)")


@dataclass
class ResultConfig:
    """The section every entry point that writes one result file starts with."""

    output: OutputOptions = section(OutputOptions)


@dataclass
class BenchConfig(ResultConfig):
    """Where a benchmark runs, and where it writes."""

    where: DeviceOptions = section(DeviceOptions)


def finish_run(
    runtime: Runtime | None, out: str | Path, name: str, kind: str, config: dict[str, Any], metrics: Any
) -> Path | None:
    """On rank 0 (or in a process that runs no job: ``runtime=None``), write the result
    file and say where; other ranks do nothing."""
    if runtime is not None and not runtime.is_main:
        return None
    path = write_result(Path(out) / f"{name}.json", kind, config, metrics, runtime)
    print(f"wrote {path}", flush=True)
    return path
