import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")                       # torchrun set RANK, WORLD_SIZE and the rendezvous
rank, world = dist.get_rank(), dist.get_world_size()
LENGTHS = [[2, 12], [9, 9]]                           # the tokens of each micro-batch, by rank; padded to 12
gen = torch.Generator().manual_seed(0)                # every rank draws every rank's micro-batches
step = [[(torch.randn(12, 16, generator=gen),         # 12 positions of 16 features, their targets -100 past n
          torch.randint(4, (12,), generator=gen).masked_fill(torch.arange(12) >= n, -100)) for n in lengths]
        for lengths in LENGTHS]
torch.manual_seed(0)
model = DDP(torch.nn.Linear(16, 4))                   # a per-token classifier: the smallest per-token loss
one = torch.nn.Linear(16, 4)
one.load_state_dict(model.module.state_dict())        # one process on the whole batch: the answer
x, y = (torch.cat(parts) for parts in zip(*(batch for mine in step for batch in mine)))
F.cross_entropy(one(x), y).backward()                 # the mean over every real token (-100 is left out)

mine, last = step[rank], len(step[rank]) - 1
own = sum(int((y != -100).sum()) for _, y in mine)
tokens = torch.tensor(float(own))
dist.all_reduce(tokens)                               # the step's tokens: every micro-batch of every rank
DIVISORS = {"mean of micro-batch means": lambda n: n * len(mine),   # (L1/n1 + L2/n2) / 2
            "the rank's own tokens": lambda n: own,                 # (L1 + L2) / (n1 + n2) on this rank
            "the step's tokens": lambda n: tokens / world}          # times N: DDP divides by N again
for way, divisor in DIVISORS.items():
    model.zero_grad()
    for micro, (x, y) in enumerate(mine):
        model.require_backward_grad_sync = micro == last  # nanoGPT's idiom: what no_sync() turns off
        summed = F.cross_entropy(model(x), y, reduction="sum")
        (summed / divisor(int((y != -100).sum()))).backward()
    off = (model.module.weight.grad - one.weight.grad).norm() / one.weight.grad.norm()
    if rank == 0:
        print(f"{way:>25}: the gradient is off by {off:.3g} of its size")
dist.destroy_process_group()
