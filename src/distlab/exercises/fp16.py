"""The fp16 chapter's exercise: one loss-scaled step on a rank that holds a shard of the gradients.

Each rank holds its own rows of one weight, as a sharded strategy's rank does after the reduce-scatter, and gets
a loss whose gradient falls on those rows only, computed in fp16 under autocast. The last rank's gradient is large:
at the scale reached after ``growth_interval`` clean steps it overflows fp16, on that rank alone. The answer is
torch's own ``GradScaler`` on the whole weight in one process, where that inf is in the one gradient it checks:
what ``ShardedGradScaler`` reproduces on shards by all-reducing what each rank found. Every rank computes the whole
reference itself, from the same numbers, so the trial makes no collective of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .catalog import Exercise
from .trial import Trial

INIT_SCALE, GROWTH_INTERVAL, CLEAN_AT_START, LR, STEPS = 2.0**15, 2, 1, 0.1, 5
"""One clean step already counted (a run resumed mid-count); the last rank's gradient overflows at 32,768
(2.5 x 32,768 > 65,504), so the first step is skipped on every rank, the scale halves and the count starts again;
two clean steps double it back, and it overflows once more; then a clean step. An answer that does not start the
count again after a skip doubles the scale one step early."""


def _loss_weights(rank: int, world: int) -> list[float]:
    """How much each of the rank's two rows weighs in its loss: the gradient of row j is this weight. Rank 0's
    1e-8 is below fp16's smallest subnormal (6e-8) unless scaled; the last rank's 2.5 overflows at a scale of
    32,768."""
    if rank == world - 1 and world > 1:
        return [0.5, 2.5]
    return [1e-3, 1e-8] if rank == 0 else [0.25, 0.5]


def _start(rank: int) -> torch.Tensor:
    return torch.full((2, 4), float(rank))  # rank 0 at 0: its updates of 1e-9 show


def _loss(shard: torch.Tensor, weights: torch.Tensor, device_type: str) -> torch.Tensor:
    x = torch.ones(1, 4, device=shard.device)
    with torch.autocast(device_type, dtype=torch.float16):
        out = F.linear(x, shard)  # fp16: its gradient is fp16 too, where a scaled gradient can overflow
    return (out.float() * weights).sum()


def _reference(world: int) -> list[dict]:
    """torch's GradScaler on the whole weight, in this process: after each step the scale, the clean steps, whether
    it stepped, and the weight."""
    whole = torch.nn.Parameter(torch.cat([_start(r) for r in range(world)]))
    weights = torch.tensor([w for r in range(world) for w in _loss_weights(r, world)])
    optimizer = torch.optim.SGD([whole], lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    scaler.load_state_dict({"scale": INIT_SCALE, "growth_factor": 2.0, "backoff_factor": 0.5,
                            "growth_interval": GROWTH_INTERVAL, "_growth_tracker": CLEAN_AT_START})  # fmt: skip
    steps = []
    for _ in range(STEPS):
        before = whole.detach().clone()
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(_loss(whole, weights, "cpu")).backward()
        scaler.step(optimizer)
        scaler.update()
        state = scaler.state_dict()
        after = whole.detach().clone()
        steps.append({"scale": state["scale"], "clean_steps": state["_growth_tracker"], "weight": after,
                      "stepped": not torch.equal(after, before), "update": after - before})  # fmt: skip
    return steps


def _own_inf(rank: int, world: int, scale: float) -> bool:
    return any(not torch.isfinite(torch.tensor(w * scale, dtype=torch.float16)) for w in _loss_weights(rank, world))


def loss_scaled_step_trial(t: Trial, fn) -> None:
    n, r = t.world_size, t.rank
    reference = _reference(n)
    mine = slice(2 * r, 2 * r + 2)
    shard = torch.nn.Parameter(_start(r).to(t.device))
    weights = torch.tensor(_loss_weights(r, n), device=t.device)
    optimizer = torch.optim.SGD([shard], lr=LR)
    scaler = {"scale": INIT_SCALE, "growth_interval": GROWTH_INTERVAL, "clean_steps": CLEAN_AT_START}
    scale = INIT_SCALE
    for step, want in enumerate(reference):
        with t.case(f"step {step + 1} at scale {scale:,.0f}"):
            before = shard.detach().cpu().clone()
            shard.grad = None
            t.call(fn, _loss(shard, weights, t.device.type), optimizer, scaler)
            got = shard.detach().cpu()
            _check_step(t, got, before, want, mine, scale, step, weights.cpu())
            _check_scale(t, scaler, want, scale)
            scale = want["scale"]
    skipped = [k + 1 for k, want in enumerate(reference) if not want["stepped"]]
    scales = ", ".join(f"{s:,.0f}" for s in [INIT_SCALE, *(want["scale"] for want in reference)])
    t.note(f"steps {' and '.join(map(str, skipped))} were skipped on every rank: rank {n - 1}'s shard overflowed fp16 "
           f"at 32,768; the scale went {scales}.")  # fmt: skip


def _check_step(t: Trial, got: torch.Tensor, before: torch.Tensor, want: dict, mine: slice, scale: float,
                step: int, weights: torch.Tensor) -> None:  # fmt: skip
    n, r = t.world_size, t.rank
    what = f"shard after step {step + 1}"
    if not torch.isfinite(got).all():
        t.fail(what, f"it holds {int((~torch.isfinite(got)).sum())} inf or NaN values: the optimizer stepped with "
               "this rank's inf gradient", "stepped_on_inf")  # fmt: skip
    stepped = not torch.equal(got, before)
    if not want["stepped"] and stepped and torch.allclose(got - before, -LR * weights[:, None].expand_as(got) / scale,
                                                          rtol=1e-2, atol=1e-12):  # fmt: skip
        t.fail(what, f"it stepped, {scale:,.0f} times too little, where every rank should have skipped: the loss was "
               "never multiplied by the scale, so no gradient overflowed", "loss_not_scaled")  # fmt: skip
    if not want["stepped"] and stepped:
        holders = [s for s in range(n) if _own_inf(s, n, scale)]
        if r not in holders:
            t.fail(what, f"it stepped, while rank {holders[0]}'s shard held an inf and rank {holders[0]} skipped: "
                   "the ranks now hold different steps of one model", "local_found_inf", certain=False)  # fmt: skip
    if want["stepped"] and not stepped:
        t.fail(what, f"it did not change: the step was skipped though no rank found an inf at scale {scale:,.0f}",
               "skipped_without_inf")  # fmt: skip
    update, expected = got - before, want["update"][mine]
    if want["stepped"] and torch.allclose(update, expected * scale, rtol=1e-3, atol=0):
        t.fail(what, f"it moved {scale:,.0f} times too far: the step used the scaled gradients", "not_unscaled")
    if want["stepped"] and torch.allclose(update, expected / scale, rtol=1e-3, atol=1e-12):
        t.fail(what, f"it moved {scale:,.0f} times too little: the gradients were divided by a scale the loss was "
               "never multiplied by", "loss_not_scaled")  # fmt: skip
    t.expect_close(got, want["weight"][mine], what, atol=1e-12, rtol=1e-3)


def _check_scale(t: Trial, scaler: dict, want: dict, scale: float) -> None:
    got = scaler.get("scale")
    if not isinstance(got, (int, float)) or isinstance(got, bool):
        t.fail("scaler['scale']", f"it is {type(got).__name__}, not a number", "scale_not_a_number")
    if got == want["scale"]:
        if not want["stepped"] and scaler.get("clean_steps") != want["clean_steps"]:
            t.fail("scaler['clean_steps']", f"it is {scaler.get('clean_steps')!r} after a skipped step, expected "
                   f"{want['clean_steps']}: the count went on from before the skip", "count_not_restarted")  # fmt: skip
        if scaler.get("clean_steps") != want["clean_steps"]:
            t.fail("scaler['clean_steps']", f"it is {scaler.get('clean_steps')!r}, expected {want['clean_steps']}",
                   None)  # fmt: skip
        return
    if not want["stepped"] and got == scale:
        t.fail("scaler['scale']", f"it stayed {scale:,.0f} after a skipped step; torch's scaler halves it to "
               f"{want['scale']:,.0f}", "scale_not_backed_off")  # fmt: skip
    if want["stepped"] and want["scale"] == scale and got == 2 * scale:
        t.fail("scaler['scale']", f"it doubled to {got:,.0f} one clean step early: the count of clean steps went on "
               "from before the skipped step", "count_not_restarted")  # fmt: skip
    if want["scale"] > scale and got == scale:
        t.fail("scaler['scale']", f"it stayed {scale:,.0f} after {GROWTH_INTERVAL} clean steps in a row; torch's "
               f"scaler doubles it to {want['scale']:,.0f}", "scale_not_grown")  # fmt: skip
    t.fail("scaler['scale']", f"it is {got:,.0f}, expected {want['scale']:,.0f} (it was {scale:,.0f})", None)


EXERCISES = (
    Exercise(
        name="loss_scaled_step",
        page="fp16",
        task="Take one fp16 step on a rank that holds a shard of the gradients: backward the loss times "
        "scaler['scale'], divide every gradient by that scale, find whether any gradient of this rank is inf or NaN, "
        "share that across the ranks with an all-reduce, then skip the step and halve the scale if any rank found "
        "one, or else step the optimizer and count a clean step, doubling the scale after "
        "scaler['growth_interval'] clean steps in a row (and starting the count again). scaler['clean_steps'] "
        "holds the clean steps counted so far.",
        signature="def loss_scaled_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer, scaler: dict) -> None:",
        solution="fp16.loss_scaled_step",
        library="torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler",
        trial=loss_scaled_step_trial,
        ranks=2,
        min_ranks=2,
        min_ranks_why="on one rank its own inf is every rank's inf, so a found-inf that is not shared cannot show",
        mistakes={
            "local_found_inf": "a rank with no inf in its shard stepped while another rank skipped. Each rank checks "
            "only its own shard: all-reduce the found-inf (dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)) before "
            "deciding, so that every rank skips the same step.",
            "stepped_on_inf": "the optimizer stepped with an inf gradient, and the weights are now inf or NaN. Check "
            "every gradient with torch.isfinite after unscaling, and skip optimizer.step() when any is not finite.",
            "not_unscaled": "the step used the scaled gradients. Divide every p.grad by the scale before "
            "optimizer.step() (torch's scaler.step unscales them for you).",
            "loss_not_scaled": "the gradients were divided by the scale, but the loss was never multiplied by it. "
            "Backward (loss * scaler['scale']), then divide.",
            "scale_not_backed_off": "after a skipped step the scale stays too large, so the next step overflows "
            "again. Halve scaler['scale'] and set scaler['clean_steps'] to 0 when any rank found an inf.",
            "count_not_restarted": "a skipped step starts the count of clean steps again: set scaler['clean_steps'] "
            "to 0 when any rank found an inf, so that growth_interval clean steps in a row come after it.",
            "scale_not_grown": "the scale never grows back. Count clean steps in scaler['clean_steps'] and double "
            "the scale when the count reaches scaler['growth_interval'], then start the count again.",
            "skipped_without_inf": "a step was skipped though no rank found an inf. Skip only when the shared "
            "found-inf is above 0.",
            "scale_not_a_number": "keep scaler['scale'] a Python number (float).",
        },
    ),
)
