"""The FSDP2 chapter's exercises: wrap a model with ``fully_shard`` unit by unit, and predict what it gathers.

``fsdp2_shard_model`` gives every rank the same small model (weights drawn from a generator), runs the learner's
wrapping with ``fully_shard`` recorded, then checks which modules became ``FSDPModule``s, that every parameter is
a ``DTensor`` holding this rank's ``torch.chunk`` rows, that the optimizer holds those parameters, and that one
SGD step leaves each rank's rows where one process, stepping on every rank's batch, puts them. The reference is
computed on each rank from the same weights and batches: no collective beside the model's own.
``fsdp2_gathered_bytes`` is arithmetic, graded against :func:`distlab.predict.memory.expected_gathered_bytes`.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..models import build_model
from ..predict.memory import expected_gathered_bytes, shard_unit_shapes
from .catalog import Exercise
from .trial import LearnerRaised, Trial

LR = 0.1


class Stack(nn.Module):
    """An input layer, three residual blocks and a head; dim 0 is 7 or 5, so no shard is even on 2, 3 or 4."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 7)
        self.blocks = nn.ModuleList(nn.Linear(7, 7) for _ in range(3))
        self.head = nn.Linear(7, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.embed(x))
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x)

    def shard_units(self) -> list[nn.Module]:
        return list(self.blocks)


def stack_model() -> Stack:
    model = Stack()  # torch's initialisation, then the same weights on every rank from a generator of its own
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return model


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(4, 6, generator=generator), torch.randn(4, 5, generator=generator)


@contextmanager
def recorded_fully_shard(fn, names: dict[int, str], calls: list[str]):
    """``fully_shard`` as the learner's module and torch name it, recording the module of every call."""
    import torch.distributed.fsdp as fsdp

    original = fsdp.fully_shard

    def recording(module, *args, **kwargs):
        calls.append(names.get(id(module), type(module).__name__))
        return original(module, *args, **kwargs)

    places = [(vars(fsdp), "fully_shard")] + [(fn.__globals__, k) for k, v in fn.__globals__.items() if v is original]
    for namespace, key in places:
        namespace[key] = recording
    try:
        yield
    finally:
        for namespace, key in places:
            namespace[key] = original


def _fsdp_module_class():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch 2.4-2.5
        from torch.distributed._composable.fsdp import FSDPModule
    return FSDPModule


def _check_order(t: Trial, units: list[str], calls: list[str]) -> None:
    first_unit = min((calls.index(u) for u in units if u in calls), default=None)
    if "the model" in calls and first_unit is not None and calls.index("the model") < first_unit:
        t.fail(
            "order of fully_shard calls",
            f"it was called on {', '.join(calls)}: the root before the units",
            "root_first",
        )


def _check_wrapping(t: Trial, model: nn.Module, names: dict[int, str], calls: list[str], whole: int, peak: int):
    units = [names[id(unit)] for unit in model.shard_units()]
    _check_order(t, units, calls)
    fsdp_module = _fsdp_module_class()
    wrapped = {name for module, name in ((m, names[id(m)]) for m in model.modules()) if isinstance(module, fsdp_module)}
    if "the model" not in wrapped and wrapped:
        t.fail(
            "set of FSDP modules",
            f"{', '.join(sorted(wrapped))} are FSDPModules, the model itself is not: its own "
            "parameters (embed, head) stay whole on every rank",
            "no_root",
        )
    if wrapped == {"the model"}:
        t.fail(
            "set of FSDP modules",
            f"only the model is an FSDPModule: one unit, so all {whole} bytes of parameters are "
            f"gathered at once, where units {', '.join(units)} and the root would gather at most {peak}",
            "root_only",
        )
    missing, extra = sorted(set(units) - wrapped), sorted(wrapped - set(units) - {"the model"})
    if missing or extra:
        said = f"{', '.join(missing)} of model.shard_units() not wrapped" if missing else ""
        said += "; " if missing and extra else ""
        t.fail(
            "set of FSDP modules",
            said + (f"{', '.join(extra)} wrapped, not one of model.shard_units()" if extra else ""),
            "missed_unit" if missing else None,
        )


def _check_shards(t: Trial, model: nn.Module, reference: nn.Module, what: str) -> None:
    n, r = t.world_size, t.rank
    mine = dict(model.named_parameters())
    for name, whole in reference.named_parameters():
        param = mine.get(name)
        if param is None or not hasattr(param, "to_local"):
            t.fail(what, f"parameter {name} is a plain {type(param).__name__}, not a sharded DTensor", None)
        rows = torch.chunk(whole.detach(), n, dim=0)
        expected = rows[r] if r < len(rows) else whole.detach()[:0]
        local = param.to_local().detach().cpu()
        if tuple(local.shape) != tuple(expected.shape):
            t.fail(
                what,
                f"{name} holds {tuple(local.shape)} on rank {r}; torch.chunk's rows are "
                f"{tuple(expected.shape)} of {tuple(whole.shape)}",
                None,
            )
        t.expect_close(local, expected, f"{what}: rows of {name}", locate=lambda i: f"{name}, value {i} of this rank")


def shard_model_trial(t: Trial, fn) -> None:
    n, r = t.world_size, t.rank
    model = stack_model().to(t.device)
    reference = copy.deepcopy(model).cpu()
    names = {id(module): name or "the model" for name, module in model.named_modules()}
    units = shard_unit_shapes(reference)
    whole = expected_gathered_bytes("fsdp", n, [[s for unit in units for s in unit]])
    peak = expected_gathered_bytes("fsdp", n, units)
    with t.case(f"Stack (3 blocks) on {n} rank{'s' if n > 1 else ''}"):
        calls: list[str] = []
        with recorded_fully_shard(fn, names, calls):
            try:
                optimizer = t.call(fn, model, LR)
            except LearnerRaised:
                _check_order(t, [names[id(u)] for u in model.shard_units()], calls)  # may say why fully_shard raised
                raise
        _check_wrapping(t, model, names, calls, whole, peak)
        _check_shards(t, model, reference, "sharded parameters")
        if not isinstance(optimizer, torch.optim.Optimizer):
            t.fail("returned optimizer", f"it returned {type(optimizer).__name__}, not a torch.optim.Optimizer", None)
        rates = sorted({group["lr"] for group in optimizer.param_groups})
        if type(optimizer) is not torch.optim.SGD or rates != [LR]:
            t.fail(
                "optimizer", f"it is {type(optimizer).__name__} with lr {rates}: the task asks for SGD, lr={LR}", None
            )
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        stale = sum(id(p) not in stepped for p in model.parameters())
        if stale:
            t.fail(
                "optimizer",
                f"{stale} of the model's {len(list(model.parameters()))} parameters are not in it; it "
                f"holds {len(stepped)} other tensors",
                "optimizer_first",
            )
    with t.case("one SGD step against one process"):
        inputs, targets = batch(r)
        t.call(lambda: F.mse_loss(model(inputs.to(t.device)), targets.to(t.device)).backward())
        t.call(optimizer.step)
        everyone = [batch(rank) for rank in range(n)]
        F.mse_loss(reference(torch.cat([x for x, _ in everyone])), torch.cat([y for _, y in everyone])).backward()
        with torch.no_grad():
            for param in reference.parameters():
                param -= LR * param.grad
        _check_shards(t, model, reference, "parameters after one step")
    t.note(f"each block its own unit: at most {peak} bytes gathered at once, against {whole} as one unit")


CASES = [("gpt-tiny", 2), ("cnn", 3), ("stack", 4), ("cnn", 4), ("gpt-tiny", 3), ("stack", 2)]


def _units(model: str) -> list[list[tuple[int, ...]]]:
    made = stack_model() if model == "stack" else build_model(model, device="meta")
    return [[tuple(s) for s in unit] for unit in shard_unit_shapes(made)]


def _wrong_answers(units, n: int, keep: bool, value: int) -> dict[str, int]:
    exact = [sum(int(torch.Size(s).numel()) for s in unit) for unit in units]
    padded = [expected_gathered_bytes("fsdp-no-reshard", n, [unit], value) for unit in units]
    wrong = {
        "no_padding": (sum(exact) if keep else exact[-1] + max(exact[:-1], default=0)) * value,
        "forgot_root": sum(padded[:-1]) if keep else max(padded[:-1], default=0),
        "shards_not_whole": expected_gathered_bytes("fsdp-no-reshard" if keep else "fsdp", n, units, value) // n,
    }
    whole_units = [-(-total // n) * n for total in exact]  # ZeRO's flat padding, per unit: not FSDP2's
    wrong["unit_padding"] = (sum(whole_units) if keep else whole_units[-1] + max(whole_units[:-1], default=0)) * value
    if keep:
        wrong["freed_after_forward"] = expected_gathered_bytes("fsdp", n, units, value)
    else:
        wrong["kept_until_backward"] = sum(padded)
    return wrong


def gathered_bytes_trial(t: Trial, fn) -> None:
    for model, n in CASES:
        units = _units(model)
        with t.case(f"{model} on {n} ranks"):
            for keep, value in ((False, 4), (True, 4), (False, 2)):
                expected = expected_gathered_bytes("fsdp-no-reshard" if keep else "fsdp", n, units, value)
                got = t.call(fn, [list(unit) for unit in units], n, not keep, value)
                if got == expected:
                    continue
                mistake = next((k for k, v in _wrong_answers(units, n, keep, value).items() if v == got), None)
                root = f"the root holds {len(units[-1])} parameters" if units[-1] else "the root holds none"
                t.fail(
                    "peak of gathered bytes",
                    f"with reshard_after_forward={not keep} and {value} bytes per value, "
                    f"got {got}, expected {expected} ({len(units) - 1} units; {root})",
                    mistake,
                )


def _mesh_on_error(failure: dict) -> str | None:
    """A mesh asked for on CUDA where the ranks run on the CPU: torch's words for a machine without a GPU."""
    no_gpu = ("NVIDIA driver", "not compiled with CUDA", "No CUDA GPUs", "CUDA driver")
    return "mesh_device" if any(words in failure["message"] for words in no_gpu) else None


EXERCISES = (
    Exercise(
        name="fsdp2_shard_model",
        page="fsdp2_in_practice",
        task="Shard `model` with FSDP2: `fully_shard` each of `model.shard_units()`, then the model itself, on a "
        "1-D mesh over every rank of the device its parameters are on; return `torch.optim.SGD` with learning rate "
        "`lr` over its parameters.",
        signature="def shard_model(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:",
        solution="fsdp2.shard_model",
        library="distlab.parallel.fsdp2.FSDP2.wrap",
        trial=shard_model_trial,
        ranks=2,
        on_error=_mesh_on_error,
        mistakes={
            "mesh_device": "build the mesh on the device the model's parameters are on: "
            "init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),)). A GPU tutorial's "
            'init_device_mesh("cuda", ...) fails where the ranks run on the CPU, as the check\'s gloo ranks do.',
            "root_first": "the root was wrapped before its units. fully_shard(model) shards every parameter inside "
            "it, so a unit wrapped afterwards holds DTensors already: wrap each unit first, the model last.",
            "no_root": "the units are wrapped but the model is not. Its own parameters (the input layer and the "
            "head) stay whole on every rank and their gradients are never reduced: call fully_shard(model) last.",
            "root_only": "one unit: the whole model is gathered at once in forward and again in backward, which is "
            "what sharding the parameters was meant to avoid. Wrap each of model.shard_units() first.",
            "missed_unit": "a unit was left out of model.shard_units()'s loop. Its parameters then go with the "
            "root's group, gathered from the start of forward to the end of backward.",
            "optimizer_first": "the optimizer was built before fully_shard. fully_shard replaces every parameter "
            "with a new DTensor parameter, so that optimizer holds the old whole tensors, which get no gradient "
            "and never change the model: build it after wrapping.",
        },
    ),
    Exercise(
        name="fsdp2_gathered_bytes",
        page="fsdp2_in_practice",
        task="Return the most bytes of whole (gathered) parameters FSDP2 holds at once, for `units` the parameter "
        "shapes by shard unit with the root's last, on `n` ranks: each parameter's dim 0 padded to a multiple of "
        "`n`; with `reshard_after_forward` the root and one other unit at a time, without it every unit at once "
        "(a prefetching all-gather's buffer left out, as in the chapter's gloo timeline).",
        signature="def gathered_peak_bytes(units: list, n: int, reshard_after_forward: bool, "
        "bytes_per_value: int = 4) -> int:",
        solution="fsdp2.gathered_peak_bytes",
        library="distlab.predict.memory.expected_gathered_bytes",
        trial=gathered_bytes_trial,
        ranks=1,
        mistakes={
            "no_padding": "a dimension 0 that does not divide by n is padded before the all-gather. FSDP2 pads "
            "every rank's shard to ceil(d0 / n) rows, so a parameter of d0 rows is gathered as ceil(d0 / n) * n.",
            "unit_padding": "FSDP2 pads each parameter's first dimension to a multiple of n, not the unit's total: "
            "a parameter of d0 rows is gathered as ceil(d0 / n) * n rows (ZeRO's flat buffer pads the total).",
            "forgot_root": "the root unit's parameters are gathered too. They are used first in forward and last "
            "in backward (a GPT's tied embedding and head), so they stay gathered beside every other unit.",
            "shards_not_whole": "that is one rank's shard. The peak counts whole parameters: n shards gathered.",
            "freed_after_forward": "with reshard_after_forward=False each unit stays gathered from its forward to its "
            "backward, so at the end of forward every unit is whole at once: the sum, not the largest.",
            "kept_until_backward": "with reshard_after_forward=True a unit is freed after its forward, so the whole "
            "parameters counted here are the root's and one other unit's at a time, as the chapter's gloo timeline "
            "measures them: the root plus the largest other unit. (FSDP2's prefetch can add the next unit's "
            "all-gather buffer to that, on a GPU in forward too; this count leaves it out.)",
        },
    ),
)
