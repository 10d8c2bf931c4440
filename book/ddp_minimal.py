import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")                      # torchrun set RANK, WORLD_SIZE and the rendezvous
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)                                 # the same data on every rank; DDP copies rank 0's weights anyway
inputs, w_true = torch.randn(256, 20), torch.randn(20, 1)
data = TensorDataset(inputs, inputs @ w_true + 0.1 * torch.randn(256, 1))   # y depends on x: something to learn
sampler = DistributedSampler(data, shuffle=True, seed=0)   # rank r gets every world-th sample
loader = DataLoader(data, batch_size=16, sampler=sampler)
model = DDP(torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
for epoch in range(3):
    sampler.set_epoch(epoch)                         # a new shuffle each epoch, the same on every rank
    total = 0.0
    for x, y in loader:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()                              # DDP all-reduces the gradients here
        optimizer.step()
        total += loss.item()
    print(f"rank {rank}/{world} epoch {epoch}: {len(sampler)} samples, mean loss {total / len(loader):.4f}")
checksum = sum(p.sum().item() for p in model.parameters())
print(f"rank {rank}: weights sum to {checksum:.6f}")    # the same on every rank: one model, N replicas
dist.destroy_process_group()
