"""The step test in one process: what it reads along a ring-trained (or ASP-trained) run.

    python bench/auto/step_test_trial.py --model cnn --lr 0.01 --momentum 0.9 --workers 4
    python bench/auto/step_test_trial.py ... --train asp      # along an ASP trajectory

Trains on the digits as the ring would (one SGD step per round on the mean gradient of
``workers`` batches of ``--batch-size``), or as ASP on the parameter server would (``--train
asp``: each of the workers in turn steps the model by its own momentum update of a gradient
taken ``workers - 1`` updates earlier, the Downpour-style round).  Every ``--every`` rounds it
probes as a worker of ``mpsync train`` does (``GradientPairs`` with the job's optimizer, the
next batch as the closure's) ``--probes`` times, puts the strides into a ``StepTest`` and
prints the gain it reads (``mpsync.auto.curvature``) beside the test accuracy.  No MPI: the
point is the estimate's shape over a run, against the comparisons' measured outcome.
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from mpsync.apps.datasets import load_dataset
from mpsync.apps.models import build_model
from mpsync.auto.curvature import StepTest
from mpsync.torch.strategies.gradient_pairs import GradientPairs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--probes", type=int, default=16)
    ap.add_argument("--train", choices=("ring", "asp"), default="ring")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    data = load_dataset("digits")
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    x_test, y_test = torch.from_numpy(data.x_test), torch.from_numpy(data.y_test)
    model = build_model(data.input_shape, data.n_classes, args.seed, args.model)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=args.lr, momentum=args.momentum)
    gen = torch.Generator().manual_seed(args.seed)
    loss_fn = torch.nn.CrossEntropyLoss()
    n, b = args.workers, args.batch_size

    def batch(size):
        idx = torch.randint(0, len(y), (size,), generator=gen)
        return x[idx], y[idx]

    def probe() -> str:
        pairs = GradientPairs(params, every_s=0.0, clock=lambda: 0.0, optimizer=opt,
                              steps_ahead=lambda: n)
        test = StepTest(n)
        for i in range(args.probes):
            (x1, y1), (x2, y2) = batch(b), batch(b)
            opt.zero_grad()
            loss_fn(model(x1), y1).backward()

            def second():
                loss = loss_fn(model(x2), y2)
                loss.backward()
                return loss

            pairs.probe(second)
            test.add(0.1 * i, i % n, *pairs.take_stride())
        est = test.estimate()
        return "no reading" if est.gain is None else f"gain {est.gain:6.2f} +- {est.sd:5.2f}"

    history = collections.deque(maxlen=n)
    velocity = [torch.zeros(sum(p.numel() for p in params)) for _ in range(n)]
    for r in range(args.rounds + 1):
        if r % args.every == 0:
            with torch.no_grad():
                acc = (model(x_test).argmax(1) == y_test).float().mean().item()
            print(f"round {r:4d}  test accuracy {acc:.3f}  step test: {probe()}", flush=True)
        if args.train == "ring":
            opt.zero_grad()
            xb, yb = batch(n * b)
            loss_fn(model(xb), yb).backward()
            opt.step()
            continue
        for w in range(n):       # ASP: each worker's update, computed n - 1 updates ago
            current = parameters_to_vector(params).detach().clone()
            vector_to_parameters(history[0] if len(history) == n else current, params)
            opt.zero_grad()
            xb, yb = batch(b)
            loss_fn(model(xb), yb).backward()
            grad = parameters_to_vector([p.grad for p in params]).detach()
            velocity[w].mul_(args.momentum).add_(grad)
            vector_to_parameters(current - args.lr * velocity[w], params)
            history.append(parameters_to_vector(params).detach().clone())


if __name__ == "__main__":
    main()
