"""Handwritten digits (8x8) with an MLP, written the way Horovod's PyTorch examples are
(examples/pytorch/pytorch_mnist.py): argparse, DistributedSampler over hvd.size()/hvd.rank(),
learning rate scaled by the number of workers, metric averaging through hvd.allreduce, a
compression flag and an op flag, a fixed number of epochs.

It runs on Horovod as it is.  The tests run it on mpsync with only the import line changed
(``import mpsync.torch as hvd``); the policy comes from MPSYNC_POLICY / MPSYNC_TOPOLOGY.

``--device cuda`` trains on the GPU (``cuda:local_rank``), as Horovod's examples do by default;
each rank prints its training throughput over the epochs (``THROUGHPUT``).

After the epochs, ``--fixed-steps N`` runs N more steps on every worker (``--uneven-steps K``:
worker r runs K*r more), then ``optimizer.synchronize()`` (``--end join``: ``hvd.join()``
first, each worker printing the wall-clock time it called it, ``JOIN-CALLED``), an evaluation
and ``hvd.shutdown()``.
"""

import argparse
import hashlib
import itertools
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data.distributed

import horovod.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch digits example")
parser.add_argument("--data", required=True, help="digits.npz (x: [n,8,8] uint8, y: [n])")
parser.add_argument("--batch-size", type=int, default=16, help="input batch size for training")
parser.add_argument("--test-batch-size", type=int, default=100, help="input batch size for testing")
parser.add_argument("--epochs", type=int, default=3, help="number of epochs to train")
parser.add_argument("--lr", type=float, default=0.05, help="learning rate")
parser.add_argument("--momentum", type=float, default=0.5, help="SGD momentum")
parser.add_argument("--seed", type=int, default=42, help="random seed")
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")
parser.add_argument("--op", choices=("average", "sum"), default="average",
                    help="reduction of the gradients")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0,
                    help="apply gradient predivide factor in optimizer")
parser.add_argument("--backward-passes-per-step", type=int, default=1,
                    help="backward passes (micro-batches) per optimizer step")
parser.add_argument("--fixed-steps", type=int, default=0, help="steps after the epochs")
parser.add_argument("--uneven-steps", type=int, default=0, help="worker r runs this x r more")
parser.add_argument("--end", choices=("synchronize", "join"), default="synchronize")
parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="train on the CPU or on the GPU of this rank's local rank")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 64)
        self.fc2 = nn.Linear(64, 32)
        self.fc3 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return F.log_softmax(self.fc3(x), dim=1)


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def main():
    args = parser.parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    raw = np.load(args.data)
    x = torch.from_numpy(raw["x"].reshape(len(raw["x"]), -1).astype(np.float32) / 16.0)
    y = torch.from_numpy(raw["y"])
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * len(x))
    train_dataset = torch.utils.data.TensorDataset(x[order[:cut]], y[order[:cut]])
    test_dataset = torch.utils.data.TensorDataset(x[order[cut:]], y[order[cut:]])
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size,
                                               sampler=train_sampler)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size,
                                              sampler=test_sampler)

    if args.device == "cuda":
        device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    model = Net().to(device)
    lr_scaler = hvd.size() if args.op == "average" else 1
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * lr_scaler,
                                momentum=args.momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=compression,
        op=hvd.Sum if args.op == "sum" else hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor,
        backward_passes_per_step=args.backward_passes_per_step)

    def train_batch(data, target):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        loss = 0.0
        for part_x, part_y in zip(data.chunk(args.backward_passes_per_step),
                                  target.chunk(args.backward_passes_per_step)):
            part = F.nll_loss(model(part_x), part_y) / args.backward_passes_per_step
            part.backward()
            loss += part.item()
        optimizer.step()
        return loss

    def train(epoch):
        model.train()
        train_sampler.set_epoch(epoch)
        total, batches = 0.0, 0
        for data, target in train_loader:
            total += train_batch(data, target)
            batches += 1
        avg = metric_average(total / batches, "avg_loss")
        if hvd.rank() == 0:
            print(f"EPOCH {epoch} loss {avg:.6f}", flush=True)

    def test():
        model.eval()
        test_loss, test_accuracy = 0.0, 0.0
        with torch.no_grad():
            for data, target in test_loader:
                data, target = data.to(device), target.to(device)
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                pred = output.max(1, keepdim=True)[1]
                test_accuracy += pred.eq(target.view_as(pred)).float().sum().item()
        test_loss /= len(test_sampler)
        test_accuracy /= len(test_sampler)
        test_loss = metric_average(test_loss, "avg_loss")
        test_accuracy = metric_average(test_accuracy, "avg_accuracy")
        if hvd.rank() == 0:
            print(f"TEST loss {test_loss:.4f} accuracy {100.0 * test_accuracy:.2f}%", flush=True)
        return test_accuracy

    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        train(epoch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    print(f"THROUGHPUT rank={hvd.rank()} samples={args.epochs * len(train_sampler)} "
          f"seconds={seconds:.6f}", flush=True)

    steps = args.fixed_steps + args.uneven_steps * hvd.rank()
    batches = itertools.cycle(list(train_loader))
    for _ in range(steps):
        train_batch(*next(batches))
    if args.end == "join":
        print(f"JOIN-CALLED rank={hvd.rank()} at={time.time():.6f}", flush=True)
        last = hvd.join()
        if hvd.rank() == 0:
            print(f"JOINED last={last}", flush=True)
    optimizer.synchronize()
    accuracy = test()

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
    print(f"FINAL rank={hvd.rank()} size={hvd.size()} steps={steps} digest={digest} "
          f"accuracy={accuracy:.6f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
