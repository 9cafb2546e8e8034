"""A Horovod-style PyTorch script on mpsync: a small MLP on scikit-learn's 8x8 digits (shipped
inside scikit-learn, no download).

    mpirun --allow-run-as-root --oversubscribe -np 5 -x MPSYNC_POLICY=esync \\
        python examples/train_digits.py --epochs 3

The settings come from the launch (``MPSYNC_POLICY``, ``MPSYNC_TOPOLOGY``, ...; bsp when none is
given).  With the default dedicated server, rank 0 is the state server and every other rank
trains.  A Horovod script becomes this one by changing its import line.
"""

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

import mpsync.torch as mps

parser = argparse.ArgumentParser(description="digits on mpsync, written as a Horovod script")
parser.add_argument("--epochs", type=int, default=3, help="passes over the training set")
parser.add_argument("--batch-size", type=int, default=32, help="per worker")
parser.add_argument("--lr", type=float, default=0.05, help="per worker; scaled by mps.size()")
args = parser.parse_args()

mps.init()  # with server="dedicated", rank 0 serves and never returns from init
torch.manual_seed(0)
torch.set_num_threads(1)  # several ranks share this machine's cores

digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
y = torch.tensor(digits.target)
train = torch.utils.data.TensorDataset(x[:1437], y[:1437])
sampler = torch.utils.data.distributed.DistributedSampler(
    train, num_replicas=mps.size(), rank=mps.rank())
loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, sampler=sampler)

model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
opt = torch.optim.SGD(model.parameters(), lr=args.lr * mps.size(), momentum=0.5)
opt = mps.DistributedOptimizer(opt, named_parameters=model.named_parameters())
mps.broadcast_parameters(model.state_dict(), root_rank=0)
mps.broadcast_optimizer_state(opt, root_rank=0)

for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    for xb, yb in loader:  # this worker's shard
        opt.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.report_loss(loss, epoch=epoch + 1)  # optional: policy auto's loss watch, OSP
        opt.step()  # a local step or an aggregation, as the state server decides

rank, workers, policy = mps.rank(), mps.size(), mps.config().policy
mps.shutdown()  # the final aggregation: every worker ends with the same model
with torch.no_grad():
    accuracy = (model(x[1437:]).argmax(1) == y[1437:]).float().mean().item()
local = mps.stats()["local"]
if rank == 0:
    print(f"{policy}, {workers} workers: test accuracy {accuracy:.3f}, "
          f"{local['iterations']} iterations and {local['rounds']} aggregations on worker 0")
