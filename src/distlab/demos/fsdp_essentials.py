"""Three things every FSDP2 script gets right or silently wrong, run on gloo ranks and measured.

    torchrun --standalone --nproc_per_node=2 -m distlab.demos.fsdp_essentials

* **The optimizer after ``fully_shard``.** ``fully_shard`` replaces every parameter with a sharded
  ``DTensor``. An optimizer made before it holds the old, whole tensors, which no longer take part in
  forward: they get no gradient, and the step moves nothing. Nothing raises.
* **Meta-device initialisation.** A model built on ``meta`` has shapes and no storage; sharded first and
  given storage after (:func:`distlab.parallel.materialize.materialize`, what ``--meta-init`` and every sharding
  strategy of distlab do), each rank allocates only its shards, and starts from exactly the weights one
  process would have drawn.
* **Gradient clipping over DTensors.** ``torch.nn.utils.clip_grad_norm_`` on an FSDP2 model's parameters
  computes the norm of the whole gradient (the DTensor's norm all-reduces the shards' squared sums). The
  norm of a rank's local shards alone is smaller and differs from rank to rank: clipping with it would
  scale each shard by another factor.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ..cli import ResultConfig, entry_point, finish_run, option
from ..errors import run_main
from ..models import build_model
from ..parallel import full_state_dict
from ..parallel.fsdp2 import FSDP2
from ..parallel.materialize import materialize
from ..runtime import distributed

MAX_NORM = 0.1


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(20 + rank)
    return torch.randn(16, 1, 28, 28, generator=gen), torch.randint(0, 10, (16,), generator=gen)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def optimizer_order(runtime, optimizer_first: bool, steps: int = 3) -> dict:
    """``steps`` SGD steps on one fixed batch per rank, the optimizer made before or after ``fully_shard``:
    the losses, and how many of the model's parameters the steps changed."""
    strategy = FSDP2()
    model = materialize(build_model("cnn", device="meta"), runtime.device, seed=0)
    if optimizer_first:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model = strategy.wrap(model, runtime)
    else:
        model = strategy.wrap(model, runtime)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [_local(p).detach().clone() for p in model.parameters()]
    inputs, targets = (t.to(runtime.device) for t in _batch(runtime.rank))
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    moved = sum(not torch.equal(_local(p), old) for p, old in zip(model.parameters(), before))
    return {"losses": losses, "moved": moved, "parameters": len(before)}


def meta_initialisation(runtime) -> dict:
    """Bytes this rank allocates for a model built on meta and sharded before it has storage, against the
    whole model's, and the largest difference from the weights one process draws with the same seed."""
    sharded = FSDP2().build(build_model("cnn", device="meta"), runtime, seed=0)
    held = sum(_local(p).numel() * p.element_size() for p in sharded.parameters())
    whole = materialize(build_model("cnn", device="meta"), torch.device("cpu"), seed=0)
    whole_bytes = sum(p.numel() * p.element_size() for p in whole.parameters())
    gathered = full_state_dict(sharded)  # every rank takes part; rank 0 gets the tensors
    reference = whole.state_dict()
    difference = max((gathered[k].cpu() - reference[k]).abs().max().item() for k in reference) if gathered else 0.0
    return {"held_bytes": held, "whole_bytes": whole_bytes, "largest_difference": difference}


def clipping(runtime) -> dict:
    """One backward of FSDP2: the gradient norm torch's ``clip_grad_norm_`` uses, the norm of the whole
    gradients gathered, and the norm of this rank's local shards alone."""
    model = FSDP2().build(build_model("cnn", device="meta"), runtime, seed=0)
    inputs, targets = (t.to(runtime.device) for t in _batch(runtime.rank))
    F.cross_entropy(model(inputs), targets).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    whole = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.full_tensor()) for g in grads]))
    local = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(_local(g)) for g in grads]))
    clipped = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    norms = [torch.linalg.vector_norm(p.grad.full_tensor()) for p in model.parameters()]
    after = torch.linalg.vector_norm(torch.stack(norms))
    return {
        "torch_norm": _local(clipped.full_tensor() if hasattr(clipped, "full_tensor") else clipped).item(),
        "whole_norm": whole.item(),
        "local_norm": local.item(),
        "norm_after_clipping": after.item(),
    }


def run_all(runtime, steps: int = 3) -> dict:
    return {
        "optimizer_first": optimizer_order(runtime, optimizer_first=True, steps=steps),
        "optimizer_after": optimizer_order(runtime, optimizer_first=False, steps=steps),
        "meta": meta_initialisation(runtime),
        "clipping": clipping(runtime),
    }


@dataclass
class FsdpEssentialsConfig(ResultConfig):
    """The optimizer's place, meta-device initialisation and clipping, on FSDP2."""

    steps: int = option(3, "SGD steps per optimizer-order run")


@entry_point(FsdpEssentialsConfig)
def main(cfg: FsdpEssentialsConfig) -> None:
    with distributed("cpu") as runtime:
        report = run_all(runtime, cfg.steps)
        local_norms = [0.0] * runtime.world_size
        torch.distributed.all_gather_object(local_norms, report["clipping"]["local_norm"])
        report["clipping"]["local_norm_by_rank"] = local_norms
        for order, label in (("optimizer_first", "optimizer made before fully_shard"),
                             ("optimizer_after", "optimizer made after fully_shard ")):  # fmt: skip
            run = report[order]
            runtime.log(f"{label}: losses {', '.join(f'{x:.4f}' for x in run['losses'])}; "
                        f"{run['moved']} of {run['parameters']} parameters moved")  # fmt: skip
        meta = report["meta"]
        runtime.log(f"built on meta, sharded, then initialised: rank 0 allocates {meta['held_bytes']:,} of the "
                    f"model's {meta['whole_bytes']:,} bytes ({meta['held_bytes'] / meta['whole_bytes']:.3f}); "
                    f"largest difference from one process's weights: {meta['largest_difference']:.1e}")  # fmt: skip
        clip = report["clipping"]
        runtime.log(f"gradient norm: clip_grad_norm_ {clip['torch_norm']:.6f}, "
                    f"whole gradients {clip['whole_norm']:.6f}, "
                    f"local shards only {', '.join(f'{x:.6f}' for x in local_norms)} (rank by rank); "
                    f"after clipping to {MAX_NORM}: {clip['norm_after_clipping']:.6f}")  # fmt: skip
        name = cfg.output.name or "fsdp-essentials"
        finish_run(runtime, cfg.output.out, name, "fsdp_essentials", asdict(cfg), report)


if __name__ == "__main__":
    run_main(main)
