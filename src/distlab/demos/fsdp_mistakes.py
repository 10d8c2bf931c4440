"""FSDP2's silent mistake, run and caught: gathered parameters kept across an optimizer step.

    torchrun --standalone --nproc_per_node=2 -m distlab.demos.fsdp_mistakes

``set_reshard_after_backward(False)`` keeps each unit's gathered parameters
after backward, which saves the next micro-step's all-gathers. Left on across
an optimizer step, the step updates the shards while the next forward reuses
the gathered copy of the old weights: training goes on, raises nothing, and
ends elsewhere. Three runs of the same SGD steps on the CNN: the correct
one, the mistake with torch's plain optimizer, and the mistake with the
optimizer distlab's FSDP2 strategy builds (which refuses the step).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ..cli import ResultConfig, entry_point, finish_run, option
from ..errors import DistlabError, run_main
from ..models import build_model
from ..parallel import full_state_dict
from ..parallel.fsdp2 import FSDP2, gathered_parameters
from ..runtime import distributed


def _batches(rank: int, steps: int):
    gen = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(8, 1, 28, 28, generator=gen), torch.randint(0, 10, (8,), generator=gen)) for _ in range(steps)]


def train_fsdp2(runtime, keep_gathered: bool, guarded: bool, steps: int = 3) -> dict:
    """``steps`` SGD steps of FSDP2 on the CNN. ``keep_gathered`` leaves
    ``set_reshard_after_backward(False)`` on; ``guarded`` uses the strategy's optimizer."""
    strategy = FSDP2()
    model = strategy.build(build_model("cnn", device="meta"), runtime, seed=0)
    factory = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    optimizer = strategy.make_optimizer(model, factory) if guarded else factory(model.parameters())
    if keep_gathered:
        model.set_reshard_after_backward(False)
    losses = []
    try:
        for inputs, targets in _batches(runtime.rank, steps):
            loss = F.cross_entropy(model(inputs.to(runtime.device)), targets.to(runtime.device))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    except DistlabError as error:
        return {"error": str(error), "losses": losses}
    for module in model.modules():  # reshard() is per unit, not recursive: free every one before reading shards
        if hasattr(module, "reshard"):
            module.reshard()
    return {"state": full_state_dict(model), "losses": losses, "gathered_left": len(gathered_parameters(model))}


def run_all(runtime, steps: int = 3) -> dict:
    return {
        "correct": train_fsdp2(runtime, keep_gathered=False, guarded=False, steps=steps),
        "stale": train_fsdp2(runtime, keep_gathered=True, guarded=False, steps=steps),
        "guarded": train_fsdp2(runtime, keep_gathered=True, guarded=True, steps=steps),
    }


@dataclass
class FsdpMistakesConfig(ResultConfig):
    """Train with gathered parameters kept across optimizer steps, and see what happens."""

    steps: int = option(3, "SGD steps per run")


@entry_point(FsdpMistakesConfig)
def main(cfg: FsdpMistakesConfig) -> None:
    with distributed("cpu") as runtime:
        runs = run_all(runtime, cfg.steps)
        correct, stale = runs["correct"]["state"], runs["stale"]["state"]
        drift = max((stale[k] - correct[k]).abs().max().item() for k in correct)
        report = {
            "losses_correct": runs["correct"]["losses"],
            "losses_stale": runs["stale"]["losses"],
            "max_weight_difference": drift,
            "guard": runs["guarded"]["error"],
        }
        runtime.log(f"losses, correct:          {', '.join(f'{x:.4f}' for x in report['losses_correct'])}")
        runtime.log(f"losses, kept gathered:    {', '.join(f'{x:.4f}' for x in report['losses_stale'])}  (no error)")
        runtime.log(f"largest weight difference after {cfg.steps} steps: {drift:.2e}")
        runtime.log(f"with distlab's optimizer: {report['guard']}")
        finish_run(runtime, cfg.output.out, cfg.output.name or "fsdp-mistakes", "fsdp_mistakes", asdict(cfg), report)


if __name__ == "__main__":
    run_main(main)
