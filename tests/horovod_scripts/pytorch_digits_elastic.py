"""Handwritten digits (8x8) with an MLP, written the way Horovod's elastic PyTorch examples are
(examples/elastic/pytorch/pytorch_mnist_elastic.py): an ElasticSampler, the learning rate
scaled by the number of workers and rescaled in a reset callback, a TorchState holding model,
optimizer, sampler, epoch and batch, ``state.commit()`` every few batches, and the training
function decorated with ``@hvd.elastic.run``.

The tests run it with only the import line changed (``import mpsync.torch as hvd``) under
mpsync's elastic launcher and kill a worker in the middle.  ``--batch-sleep S`` slows each
batch down so that there is a middle to kill in.
"""

import argparse
import hashlib
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import horovod.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch digits elastic example")
parser.add_argument("--data", required=True, help="digits.npz (x: [n,8,8] uint8, y: [n])")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--momentum", type=float, default=0.5)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--batches-per-commit", type=int, default=5)
parser.add_argument("--batch-sleep", type=float, default=0.0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


args = parser.parse_args()
hvd.init()
torch.manual_seed(args.seed)
torch.set_num_threads(1)

data = np.load(args.data)
x = torch.from_numpy(data["x"].reshape(len(data["x"]), 64).astype(np.float32) / 16.0)
y = torch.from_numpy(data["y"].astype(np.int64))
split = int(0.8 * len(y))
train_dataset = torch.utils.data.TensorDataset(x[:split], y[:split])
test_x, test_y = x[split:], y[split:]

train_sampler = hvd.elastic.ElasticSampler(train_dataset, shuffle=True, seed=args.seed)
train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size,
                                           sampler=train_sampler)

model = Net()
lr_scaler = hvd.size()
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())


@hvd.elastic.run
def train(state):
    for state.epoch in range(state.epoch, args.epochs + 1):
        state.model.train()
        # After a restart the sampler holds only the samples of this epoch not yet trained.
        for state.batch, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            state.train_sampler.record_batch(state.batch, args.batch_size)
            if args.batch_sleep:
                time.sleep(args.batch_sleep)
            if state.batch % args.batches_per_commit == 0:
                state.commit()
        if hvd.rank() == 0:
            print(f"EPOCH {state.epoch} loss {loss.item():.4f} size {hvd.size()}", flush=True)
        state.batch = 0
        state.train_sampler.set_epoch(state.epoch + 1)
        state.commit()


def on_state_reset():
    # The worker count changed: rescale the learning rate as the examples do.
    for param_group in optimizer.param_groups:
        param_group["lr"] = args.lr * hvd.size()
    if hvd.rank() == 0:
        print(f"RESET size {hvd.size()} lr {optimizer.param_groups[0]['lr']:.4f}", flush=True)


state = hvd.elastic.TorchState(model=model, optimizer=optimizer, train_sampler=train_sampler,
                               epoch=1, batch=0)
state.register_reset_callbacks([on_state_reset])
train(state)

model.eval()
with torch.no_grad():
    accuracy = float((model(test_x).argmax(1) == test_y).float().mean())
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                 for p in model.parameters())).hexdigest()[:16]
print(f"FINAL rank={hvd.rank()} size={hvd.size()} epoch={state.epoch} digest={digest} "
      f"accuracy={accuracy:.4f}", flush=True)
hvd.shutdown()
