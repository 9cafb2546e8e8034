"""The compute-only ceiling of `mpsync train --np 4 --model wide-mlp`: one process of it.

Each process runs what a worker's iteration computes and nothing else (the wide MLP's
forward, backward and SGD step with momentum on digits batches of 32, one thread), for
SECONDS, and prints how many samples it trained on.  Four of them at once on this machine's
cores give the samples/s that no synchronization policy can exceed there:

    for r in 0 1 2 3; do OMP_NUM_THREADS=1 python compute_only.py 10 $r > out$r & done; wait
"""

import sys
import time

import numpy as np
import torch

from mpsync.apps.datasets import load_dataset
from mpsync.apps.models import build_model


def main(seconds: float, rank: int) -> int:
    torch.set_num_threads(1)
    data = load_dataset("digits")
    model = build_model(data.input_shape, data.n_classes, 0, "wide-mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    rng, samples = np.random.default_rng(rank), 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        i = int(rng.integers(0, len(y) - 32))
        opt.zero_grad()
        loss_fn(model(x[i:i + 32]), y[i:i + 32]).backward()
        opt.step()
        samples += 32
    return samples


if __name__ == "__main__":
    print(main(float(sys.argv[1]), int(sys.argv[2])))
