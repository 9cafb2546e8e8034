"""examples/train_digits.py written for Horovod's elastic API: the training function under
``@mps.elastic.run``, its progress in a ``TorchState`` committed every few batches, and the
learning rate rescaled when the number of workers changes.

    mpsync run --np 2 --min-np 1 --max-restarts 2 --commit-dir runs/commits \\
        python examples/train_digits_elastic.py --epochs 2

Open MPI ends the whole job when a rank dies, so here a lost worker ends ``mpirun``; mpsync's
launcher starts the job again on what remains and ``mps.elastic.run`` resumes every worker from
the newest commit complete on all of them.
"""

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

import mpsync.torch as mps

parser = argparse.ArgumentParser(description="digits on mpsync's elastic API")
parser.add_argument("--epochs", type=int, default=3, help="passes over the training set")
parser.add_argument("--batch-size", type=int, default=32, help="per worker")
parser.add_argument("--lr", type=float, default=0.05, help="per worker; scaled by mps.size()")
parser.add_argument("--batches-per-commit", type=int, default=10)
args = parser.parse_args()

mps.init()  # with server="dedicated", rank 0 serves and never returns from init
torch.manual_seed(0)
torch.set_num_threads(1)  # several ranks share this machine's cores

digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
y = torch.tensor(digits.target)
train_set = torch.utils.data.TensorDataset(x[:1437], y[:1437])
sampler = mps.elastic.ElasticSampler(train_set, shuffle=True, seed=0)
loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
opt = torch.optim.SGD(model.parameters(), lr=args.lr * mps.size(), momentum=0.5)
opt = mps.DistributedOptimizer(opt, named_parameters=model.named_parameters())


@mps.elastic.run
def train(state):
    for state.epoch in range(state.epoch, args.epochs):
        # After a restart the sampler holds only the samples of this epoch not yet trained.
        for state.batch, (xb, yb) in enumerate(loader):
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
            state.sampler.record_batch(state.batch, args.batch_size)
            if state.batch % args.batches_per_commit == 0:
                state.commit()
        state.batch = 0
        state.sampler.set_epoch(state.epoch + 1)
        state.commit()


def rescale_lr():
    """The number of workers changed at a restart: scale the learning rate with it."""
    for group in opt.param_groups:
        group["lr"] = args.lr * mps.size()


state = mps.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0, batch=0)
state.register_reset_callbacks([rescale_lr])
train(state)

rank, workers = mps.rank(), mps.size()
mps.shutdown()  # the final aggregation: every worker ends with the same model
with torch.no_grad():
    accuracy = (model(x[1437:]).argmax(1) == y[1437:]).float().mean().item()
if rank == 0:
    print(f"elastic, {workers} workers: test accuracy {accuracy:.3f} after {args.epochs} epochs")
