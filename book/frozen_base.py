import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.comm.traffic import TrafficCounter
from distlab.predict.traffic import expected_bytes_per_step

dist.init_process_group("gloo")                       # torchrun set RANK, WORLD_SIZE and the rendezvous
rank, world = dist.get_rank(), dist.get_world_size()


class Adapted(torch.nn.Module):                       # a frozen 512 x 512 layer and a trainable rank-8 adapter
    def __init__(self):
        super().__init__()
        self.base = torch.nn.Linear(512, 512).requires_grad_(False)
        self.down, self.up = torch.nn.Linear(512, 8, bias=False), torch.nn.Linear(8, 512, bias=False)

    def forward(self, x):
        return torch.relu(self.base(x) + self.up(self.down(x)))


def one_step(name, strategy, net):
    every = sum(p.numel() for p in net.parameters())
    trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)
    with TrafficCounter(world) as counted:
        net(torch.randn(8, 512)).sum().backward()     # each rank its own 8 samples
    predicted = expected_bytes_per_step(strategy, every, world, trainable=trainable)
    calls = ", ".join(f"{n} {op}" for op, n in counted.calls.items())
    for turn in range(world):                         # one rank at a time, so that the lines do not mix
        if turn == rank:
            print(f"rank {rank} {name}: {trainable:,} of {every:,} values train; sent {counted.total_bytes:,.0f} B "
                  f"in {calls}; predicted {predicted:,.0f} B", flush=True)
        dist.barrier()


torch.manual_seed(0)
one_step("DDP", "ddp", DDP(torch.nn.Sequential(*[Adapted() for _ in range(4)])))
sharded = torch.nn.Sequential(*[Adapted() for _ in range(4)])
for block in sharded:                                 # one FSDP unit per block, then the root
    fully_shard(block)
one_step("FSDP2", "fsdp", fully_shard(sharded))
dist.destroy_process_group()
