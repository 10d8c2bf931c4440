import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from distlab.comm.traffic import TrafficCounter
from distlab.measure.memory import MemoryTracker
from distlab.predict.traffic import expected_bytes_per_step

dist.init_process_group("gloo")                       # torchrun set RANK, WORLD_SIZE and the rendezvous
rank, world = dist.get_rank(), dist.get_world_size()
MICRO_STEPS = 3


def say(text):                                        # one rank at a time, so that the lines do not mix
    for turn in range(world):
        if turn == rank:
            print(text, flush=True)
        dist.barrier()


def accumulate(mode, sync_every_micro_step):
    torch.manual_seed(0)                              # four 256 x 256 blocks, each an FSDP unit, then the root
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU()) for _ in range(4)])
    for block in model:
        fully_shard(block)
    fully_shard(model)
    x = torch.randn(MICRO_STEPS, 8, 256)              # each micro-step its own 8 samples
    held_before = [p.to_local() for p in model.parameters()] + [x]   # the shards and the inputs
    with MemoryTracker(lambda: {"parameters": held_before}) as memory:
        start = memory.current_bytes
        for micro in range(MICRO_STEPS):
            model.set_requires_gradient_sync(sync_every_micro_step or micro == MICRO_STEPS - 1)
            with TrafficCounter(world) as counted:
                model(x[micro]).sum().backward()
            dist.barrier()
            time.sleep(0.05)                          # gloo's threads free a collective's buffers just after it ends
            calls = ", ".join(f"{n} {op}" for op, n in counted.calls.items())
            say(f"rank {rank} {mode}, micro-step {micro + 1}: holds {memory.current_bytes - start:,} B above the "
                f"shards; sent {counted.total_bytes:,.0f} B in {calls}")
    say(f"rank {rank} {mode}: peak {memory.peak_bytes - start:,} B above the shards")
    return sum(p.numel() for p in model.parameters())


accumulate("synced every micro-step", sync_every_micro_step=True)
values = accumulate("synced at the last", sync_every_micro_step=False)
gathers = expected_bytes_per_step("fsdp", values, world, trainable=0)   # forward's and backward's all-gathers
reduce = expected_bytes_per_step("fsdp", values, world) - gathers       # the gradients' reduce-scatter
if rank == 0:
    print(f"predicted: a micro-step gathers {gathers:,.0f} B and a sync reduce-scatters {reduce:,.0f} B; "
          f"whole gradients hold {4 * values:,} B, a shard of them {4 * values // world:,} B")
dist.destroy_process_group()
