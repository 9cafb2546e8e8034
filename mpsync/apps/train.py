"""``mpsync train``: train a model under one synchronization policy (run under mpirun).

The training loop is a user of the public ``mpsync.torch`` API only (init,
DistributedOptimizer, broadcast_parameters, allreduce, gather_object, stats, shutdown).  With
``--server dedicated`` world rank 0 is the state server and never runs the loop.

Stopping must be agreed by all workers on the ring (a worker that leaves early would leave the
others in a collective): ring policies decide at round boundaries, where every worker is
present, with one small allreduce of (samples, time-is-up).  PS policies (asp, ssp, dssp) have
no common rounds; each worker stops on its own clock, or when the server's count of samples
reaches the epochs asked for.

Checkpoints (``--checkpoint-every K``) are consistent cuts, written by worker 0 alone:

* ring: at every K-th round, right after an aggregation, when every replica is the global
  model; the file holds that model, each worker's optimizer state, RNG states, data position
  and counters, the step, wall time and evaluations so far.
* ps: at each worker's K-th, 2K-th, ... push (its round), right after its push and pull.  The
  workers gather their state to worker 0 (which waits until every worker has made that many
  pushes, so all of them are applied on the server), worker 0 pulls the global weights (that
  model, exactly: the workers wait for worker 0 before pushing again) and writes them with the
  gathered state.  Every K rounds is therefore a short barrier of all workers, and the stop
  decision is taken there too (a worker stopping on its own clock would leave the others in
  the checkpoint's collective): training may run up to K rounds past its budget.  A worker
  that stalls holds the others at the next checkpoint round (until ``--deadline``).

Server state: at either cut every worker has made the same number of pushes (ps) or rounds
(ring), so the staleness clocks of SSP/DSSP and the round counters, which a resumed server
starts at zero for every worker, have the same gaps (none) as at the cut; the global weights
are the checkpoint's model, which worker 0 sends in ``ps_init`` on resume.  The rest is soft
state the server re-learns: ElasticBSP's and ESync's iteration times (within the first round:
ElasticBSP's monitoring phase, ESync's first reports), DSSP's push-interval table, and the
server's statistics (``server_stats.json`` of a resumed run covers the resumed part).  Updates
made after the newest checkpoint are lost on a crash: the rollback is at most K rounds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import socket
import sys
import time
from pathlib import Path

import numpy as np

from mpsync.config import ConfigError, POLICIES, PS_ONLY_POLICIES, SyncConfig, TOPOLOGIES, \
    ZIPLINE_VARIANTS

__all__ = ["add_arguments", "main", "build_config", "validate", "default_topology"]


def default_topology(policy: str) -> str:
    return "ps" if policy in PS_ONLY_POLICIES else "ring"


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("synchronization")
    g.add_argument("--policy", default="bsp", help=f"one of {', '.join(POLICIES)}")
    g.add_argument("--topology", default=None,
                   help="ring | ps (default: ps for asp/ssp/dssp, ring otherwise)")
    g.add_argument("--backend", default="mpi", help="horovod | mpi (ring aggregation)")
    g.add_argument("--server", default="dedicated", help="dedicated (rank 0) | colocated")
    g.add_argument("--staleness", type=int, default=None, help="SSP threshold s")
    g.add_argument("--staleness-range", default=None, metavar="sL,sU", help="DSSP [s_L, s_U]")
    g.add_argument("--lookahead", type=int, default=None, help="ElasticBSP lookahead R")
    g.add_argument("--zipline-variant", default=None, help=", ".join(ZIPLINE_VARIANTS))
    g.add_argument("--epsilon", type=float, default=None, help="ESync global learning rate")
    d = SyncConfig()
    g.add_argument("--deadline", type=float, default=None,
                   help=f"seconds any blocking wait may take before the job fails (default "
                        f"{d.deadline:g}); raise it if an evaluation or checkpoint write on "
                        f"worker 0 can take longer")
    g.add_argument("--silent-timeout", type=float, default=None,
                   help=f"seconds after which the server counts a quiet worker as gone "
                        f"(default {d.silent_timeout:g}; start-up before a worker's first "
                        f"step has its own allowance of {d.startup_timeout:g} s)")
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=float, default=None, help="passes over the training set")
    g.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="train for S seconds of wall time (evaluation excluded)")
    g.add_argument("--dataset", default="digits", help="digits | synthetic | npz:PATH")
    g.add_argument("--partition", default="iid", help="iid | noniid (class-sorted shards)")
    g.add_argument("--model", default="auto",
                   help="auto (cnn for images, mlp for features) | cnn | mlp | wide-mlp "
                        "(8.7 MB of gradients on digits: communication shows on a network)")
    g.add_argument("--synthetic-samples", type=int, default=4096)
    g.add_argument("--synthetic-features", type=int, default=32)
    g.add_argument("--synthetic-classes", type=int, default=10)
    g.add_argument("--synthetic-noise", type=float, default=1.0, help="higher = harder")
    g.add_argument("--lr", type=float, default=0.05)
    g.add_argument("--momentum", type=float, default=0.9)
    g.add_argument("--batch-size", type=int, default=32, help="per worker")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--target-acc", type=float, default=None)
    g.add_argument("--eval-every", type=float, default=None, metavar="S",
                   help="evaluate every S seconds of wall time (default: budget/30 or 1 s)")
    g = p.add_argument_group("heterogeneity (emulated)")
    g.add_argument("--slowdown", default=None, metavar="F0,F1,..",
                   help="per-worker slowdown factors (>= 1), e.g. 1,1,2,4")
    g.add_argument("--slowdown-schedule", default=None, metavar="T:F0,..;T2:..",
                   help="new factors from wall time T on")
    g.add_argument("--iter-time", type=float, default=None, metavar="S",
                   help="emulated device time of one iteration at factor 1")
    g.add_argument("--comm-delay", type=float, default=0.0, metavar="S",
                   help="extra latency added to every aggregation (booked as aggregation time)")
    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, help="directory for metrics.json, plots, trace")
    g.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                   help="checkpoint every K rounds into OUT/checkpoints (ps: every K pushes of "
                        "each worker, which is then also when the workers agree to stop)")
    g.add_argument("--resume", default=None, metavar="DIR", help="continue from a checkpoint")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--workers", type=int, default=None, help=argparse.SUPPRESS)
    g = p.add_argument_group("across nodes (started from the login node, not under mpirun)")
    from mpsync.cluster.launching import add_cluster_arguments

    add_cluster_arguments(g)
    g.add_argument("--np", type=int, default=None,
                   help="with --cluster: workers (default one per node besides node1)")
    # Fault injection for the resume test: SIGKILL worker 0 right after this step.
    g.add_argument("--kill-at-step", type=int, default=None, help=argparse.SUPPRESS)


def build_config(args) -> SyncConfig:
    """The SyncConfig the flags describe (validated; ConfigError names the flag)."""
    opts: dict = {"policy": args.policy,
                  "topology": args.topology or default_topology(args.policy),
                  "backend": args.backend, "server": args.server}
    if args.staleness is not None:
        opts["staleness"] = args.staleness
    if args.staleness_range is not None:
        parts = args.staleness_range.split(",")
        try:
            low, high = (int(x) for x in parts)
        except ValueError:
            raise ConfigError(f"--staleness-range: expected sL,sU integers, got "
                              f"{args.staleness_range!r}") from None
        opts.update(staleness_low=low, staleness_high=high)
    for flag, key in (("lookahead", "lookahead"), ("zipline_variant", "zipline_variant"),
                      ("epsilon", "epsilon"), ("deadline", "deadline"),
                      ("silent_timeout", "silent_timeout")):
        if getattr(args, flag) is not None:
            opts[key] = getattr(args, flag)
    if getattr(args, "comm_delay", None) is not None:
        if not args.comm_delay >= 0:
            raise ConfigError(f"--comm-delay must be >= 0 seconds, got {args.comm_delay}")
        opts["comm_delay"] = args.comm_delay
    if args.policy not in POLICIES:  # before topology rules, so the message names the policy
        raise ConfigError(f"unknown policy {args.policy!r}; choose one of: {', '.join(POLICIES)}")
    if opts["topology"] not in TOPOLOGIES:
        raise ConfigError(f"unknown topology {opts['topology']!r}; choose one of: "
                          f"{', '.join(TOPOLOGIES)}")
    return SyncConfig.from_options(env={}, **opts)


def validate(args, workers: int | None) -> SyncConfig:
    """Every check that needs no communicator (run before launch and on every rank)."""
    from mpsync.apps.datasets import check_dataset_spec
    from mpsync.apps.heterogeneity import Heterogeneity

    config = build_config(args)
    if (args.epochs is None) == (args.time_budget is None):
        raise ConfigError("give exactly one of --epochs N or --time-budget S")
    if args.epochs is not None and not args.epochs > 0:
        raise ConfigError(f"--epochs must be > 0, got {args.epochs}")
    if args.time_budget is not None and not args.time_budget > 0:
        raise ConfigError(f"--time-budget must be > 0 seconds, got {args.time_budget}")
    if args.target_acc is not None and not 0 < args.target_acc <= 1:
        raise ConfigError(f"--target-acc must be in (0, 1], got {args.target_acc}")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
    if not args.lr > 0:
        raise ConfigError(f"--lr must be > 0, got {args.lr}")
    if args.partition not in ("iid", "noniid"):
        raise ConfigError(f"unknown --partition {args.partition!r}; choose iid or noniid")
    if args.eval_every is not None and not args.eval_every > 0:
        raise ConfigError(f"--eval-every must be > 0 seconds, got {args.eval_every}")
    if args.checkpoint_every < 0:
        raise ConfigError(f"--checkpoint-every must be >= 0 rounds, got {args.checkpoint_every}")
    if (args.checkpoint_every or args.resume) and not args.out:
        raise ConfigError("--checkpoint-every/--resume need --out DIR (checkpoints and the "
                          "resumed run's results go there)")
    check_dataset_spec(args.dataset)
    from mpsync.apps.models import MODELS
    if args.model not in MODELS:
        raise ConfigError(f"unknown --model {args.model!r}; choose from {', '.join(MODELS)}")
    if workers is not None:
        if workers < 1:
            raise ConfigError(f"need at least 1 worker, got {workers}")
        Heterogeneity.from_flags(0, workers, args.slowdown, args.slowdown_schedule,
                                 args.iter_time, args.comm_delay)
    return config


def _world_rank() -> int:
    return int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))


def _world_size() -> int:
    return int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1")))


def main(args) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.cluster is not None and "OMPI_COMM_WORLD_SIZE" not in os.environ:
        from mpsync.cluster.launching import run_train_on_cluster

        return run_train_on_cluster(args, add_arguments)
    try:
        size = _world_size()
        workers = args.workers or (size - 1 if args.server == "dedicated" else size)
        config = validate(args, workers)
        resume = None
        if args.resume:
            from mpsync.apps.checkpoint import latest_good

            # Every rank reads and verifies the checkpoint before any communication, so a bad
            # one fails the whole job at once with the same message.
            path, resume = latest_good(args.resume, warn=_warn_once)
            if resume["workers"] != workers:
                raise ConfigError(f"--resume {path}: written by {resume['workers']} workers, "
                                  f"this run has {workers}")
            if _world_rank() == 0:
                print(f"mpsync train: resuming from {path}: round {resume['round']}, "
                      f"step {resume['step']}", flush=True)
    except Exception as e:  # noqa: BLE001 - one clear line, not a traceback, for bad input
        from mpsync.apps.checkpoint import CheckpointError

        if not isinstance(e, (ConfigError, CheckpointError)):
            raise
        if _world_rank() == 0:
            print(f"mpsync train: error: {e}", file=sys.stderr)
        return 2
    return _train(args, config, workers, resume)


def _warn_once(msg: str) -> None:
    if _world_rank() == 0:
        print(f"mpsync train: {msg}", file=sys.stderr)


def _train(args, config: SyncConfig, workers: int, resume: dict | None) -> int:
    import torch

    import mpsync.torch as mps
    from mpsync.apps import report
    from mpsync.apps.checkpoint import save_checkpoint
    from mpsync.apps.datasets import load_dataset, partition
    from mpsync.apps.heterogeneity import Heterogeneity
    from mpsync.apps.models import build_model

    torch.set_num_threads(1)
    out = Path(args.out) if args.out else None
    init_kw = {k: v for k, v in config.to_dict().items()
               if k not in ("policy", "topology", "backend", "server", "extra")}
    if out is not None and _world_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
    # Data and model are built before init: the state server counts a registered worker that
    # stays quiet for longer than silent_timeout as gone, and a loaded machine is slow here.
    world_rank = _world_rank()
    is_server_rank = config.server == "dedicated" and world_rank == 0
    me = world_rank - 1 if config.server == "dedicated" else world_rank
    if not is_server_rank:
        ds = load_dataset(args.dataset, seed=args.seed, synthetic_samples=args.synthetic_samples,
                          synthetic_features=args.synthetic_features,
                          synthetic_classes=args.synthetic_classes,
                          synthetic_noise=args.synthetic_noise)
        shard = partition(ds, workers, me, args.partition, seed=args.seed)
        hetero = Heterogeneity.from_flags(me, workers, args.slowdown, args.slowdown_schedule,
                                          args.iter_time, args.comm_delay)
        model = build_model(ds.input_shape, ds.n_classes, args.seed, args.model)
    mps.init(policy=config.policy, topology=config.topology, backend=config.backend,
             server=config.server,
             stats_path=str(out / "server_stats.json") if out else None,
             trace_path=str(out / "server_trace.json") if out else None, **init_kw)
    # Only workers get here (a dedicated server serves inside init and exits).
    n = mps.size()
    if n != workers or mps.rank() != me:
        raise RuntimeError(f"expected worker {me} of {workers}, mpsync.torch reports "
                           f"{mps.rank()} of {n}")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    x_test, y_test = torch.from_numpy(ds.x_test), torch.from_numpy(ds.y_test)

    # Where this worker is in its data, and what was measured before a resume.
    epoch, index, samples, wall_offset = 0, 0, 0, 0.0
    evals: list[dict] = []
    round_offset = 0
    if resume is not None:
        mine = resume["per_worker"][me]
        model.load_state_dict(resume["model"])
        inner.load_state_dict(mine["optimizer"])
        epoch, index, samples = mine["epoch"], mine["index"], mine["samples"]
        torch.set_rng_state(mine["rng_torch"])
        np.random.set_state(mine["rng_numpy"])
        random.setstate(mine["rng_python"])
        wall_offset, evals, round_offset = resume["wall_s"], resume["evals"], resume["round"]
    else:
        torch.manual_seed(args.seed + 1000 * me)
        np.random.seed(args.seed + 1000 * me)
        random.seed(args.seed + 1000 * me)

    opt = mps.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    mps.broadcast_parameters(model.state_dict(), root_rank=0)
    loss_fn = torch.nn.CrossEntropyLoss()
    per_epoch = shard.batches_per_epoch(args.batch_size)
    target_samples = (int(args.epochs * len(ds.y_train)) if args.epochs is not None else None)
    ring = config.topology == "ring"
    check_every = 5 if config.policy in ("bsp", "osp") else 1  # rounds between stop checks
    eval_every = args.eval_every or (args.time_budget / 30 if args.time_budget else 1.0)

    def evaluate() -> tuple[float, float]:
        model.eval()
        with torch.no_grad():
            logits = model(x_test)
            loss = float(loss_fn(logits, y_test))
            acc = float((logits.argmax(1) == y_test).float().mean())
        model.train()
        return acc, loss

    eval_s = 0.0
    start = time.perf_counter()

    def wall() -> float:
        return wall_offset + time.perf_counter() - start - eval_s

    def record_eval(global_samples: int) -> dict:
        nonlocal eval_s
        t0, at = time.perf_counter(), wall()  # the wall time the evaluation is taken at
        acc, loss = evaluate()
        e = {"wall_s": at, "samples": int(global_samples), "accuracy": acc, "loss": loss,
             "wall_clock": time.time()}
        evals.append(e)
        eval_s += time.perf_counter() - t0
        return e

    bar = None
    if me == 0 and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.time_budget if args.time_budget else target_samples,
                   unit="s" if args.time_budget else "sample", file=sys.stderr,
                   desc=f"{config.policy}", mininterval=0.5, dynamic_ncols=True)

    global_samples = samples * n  # estimate between stop checks; exact at each check
    if me == 0 and resume is None:
        record_eval(0)
    last_eval = wall()
    last_round_checked = opt.strategy.round
    step = 0
    done = False
    while not done:
        t_iter = time.perf_counter()
        xb, yb = shard.batch(epoch, index, args.batch_size)
        opt.zero_grad()
        loss = loss_fn(model(torch.from_numpy(xb)), torch.from_numpy(yb))
        loss.backward()
        hetero.pad(time.perf_counter() - t_iter, wall())
        round_before = opt.strategy.round
        opt.step()
        step += 1
        samples += len(yb)
        index += 1
        if index >= per_epoch:
            epoch, index = epoch + 1, 0
        if args.kill_at_step is not None and me == 0 and step + _steps_before(resume) == args.kill_at_step:
            # Says where the run got to, so a test can measure how far a resume rolls back.
            print(f"mpsync train: fault injection: SIGKILL worker 0 after step "
                  f"{args.kill_at_step}, round {opt.strategy.round + round_offset}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        # -- stop decision ---------------------------------------------------------------
        rnd = opt.strategy.round
        before = resume["per_worker"][me]["counters"] if resume else {}
        if ring:
            if rnd != last_round_checked and (rnd + round_offset) % check_every == 0:
                last_round_checked = rnd
                flag = 1.0 if (args.time_budget and wall() >= args.time_budget) else 0.0
                agreed = mps.allreduce(torch.tensor([samples, int(flag)], dtype=torch.int64),
                                       average=False, name="stop check")
                global_samples = int(agreed[0])
                done = agreed[1] > 0 or (target_samples is not None
                                         and global_samples >= target_samples)
            else:
                global_samples = max(global_samples, samples * n)
            # Every K rounds, whether or not this round also checks for the stop (BSP and OSP
            # check every 5): every worker completes the same rounds, so all of them get here.
            if args.checkpoint_every and rnd != round_before \
                    and (rnd + round_offset) % args.checkpoint_every == 0 and not done:
                gathered = mps.gather_object(
                    _worker_state(mps, inner, epoch, index, samples, before, hetero.slept_s),
                    root_rank=0, name="checkpoint state")
                if me == 0:
                    _write_checkpoint(save_checkpoint, out, model, gathered, n, wall(), evals,
                                      rnd + round_offset, step + _steps_before(resume), config)
        elif args.checkpoint_every:
            # PS with checkpoints: stop decisions only at checkpoint rounds (module doc).
            if rnd != round_before and (rnd + round_offset) % args.checkpoint_every == 0:
                time_up = bool(args.time_budget and wall() >= args.time_budget)
                done, global_samples = _ps_checkpoint(
                    mps, opt, save_checkpoint, out, model, me, n,
                    _worker_state(mps, inner, epoch, index, samples, before, hetero.slept_s),
                    time_up, target_samples, wall, evals, rnd + round_offset,
                    step + _steps_before(resume), config)
            else:
                global_samples = max(global_samples, samples * n)
        else:
            if args.time_budget and wall() >= args.time_budget:
                done = True
            elif target_samples is not None and step % 10 == 0:
                server = mps.stats()["server"] or {}
                counted = sum(w.get("iterations", 0) for w in server.get("workers", {}).values())
                global_samples = max(samples * n, counted * args.batch_size)
                done = global_samples >= target_samples
            else:
                global_samples = max(global_samples, samples * n)
        # On the ring, worker 0's replica is the global model only right after an aggregation
        # (ESync and ElasticBSP run local steps between rounds), so a due evaluation waits for
        # the next round boundary: every recorded point is a model all workers hold.  BSP and
        # OSP aggregate every step, so for them this changes nothing.
        if me == 0 and wall() - last_eval >= eval_every and (not ring or rnd != round_before):
            t_eval = time.perf_counter()
            e = record_eval(global_samples)
            last_eval = wall()
            _warn_if_slow(time.perf_counter() - t_eval, "an evaluation", config)
            if bar is not None:
                _progress(bar, args, e, epoch, wall(), global_samples,
                          mps.stats(server=False)["local"])
    if not ring:
        # Last push before any collective: under SSP/DSSP a faster worker's pull may be held
        # until every other worker's last update is in, so a gather first would deadlock.
        opt.synchronize()
    elif config.policy != "bsp":
        # The final aggregation (shutdown would do it too) before the metrics are gathered, so
        # each worker's parameter checksum below is of the model it ends with: OSP may still
        # have an In-Computation Sync in flight here.  BSP replicas are equal after every step.
        opt.synchronize()
    local = mps.stats()["local"]
    before = resume["per_worker"][me]["counters"] if resume else {}
    mine = {k: local[k] + before.get(k, 0) for k in ("iterations", "rounds", "compute_s",
                                                     "wait_s", "aggregation_s", "bytes_sent")}
    mine.update(samples=samples, slept_s=hetero.slept_s + before.get("slept_s", 0.0),
                param_sha256=_param_sha256(model), events=local["events"],
                host=socket.gethostname())
    gathered = mps.gather_object(mine, root_rank=0, name="final metrics")
    final_wall = wall()
    mps.shutdown()
    if bar is not None:
        bar.close()
    if me != 0:
        return 0
    e = record_eval(sum(g["samples"] for g in gathered))
    e["wall_s"] = final_wall
    events = {w: g.pop("events") for w, g in enumerate(gathered)}
    workers_metrics = {str(w): g for w, g in enumerate(gathered)}
    metrics = {
        "schema": 1,
        "config": {**config.to_dict(), "workers": n, "dataset": ds.name,
                   "partition": args.partition, "batch_size": args.batch_size, "lr": args.lr,
                   "momentum": args.momentum, "seed": args.seed, "epochs": args.epochs,
                   "time_budget": args.time_budget, "target_acc": args.target_acc,
                   "slowdown": hetero.factors, "slowdown_schedule": args.slowdown_schedule,
                   "iter_time": args.iter_time, "comm_delay": args.comm_delay,
                   "heterogeneity": hetero.describe(), "train_samples": len(ds.y_train),
                   "test_samples": len(ds.y_test), "resumed": resume is not None},
        "evals": [{k: v for k, v in ev.items() if k != "wall_clock"} for ev in evals],
        "workers": workers_metrics,
        "wall_s": final_wall,
        "final_param_sha256": _param_sha256(model),
        "server": mps.stats()["server"],
    }
    report.summarize(metrics, args.target_acc)
    _print_summary(metrics)
    if out is not None:
        report.write_metrics(metrics, out)
        torch.save(model.state_dict(), out / "model.pt")
        t0 = min((a for evs in events.values() for _, a, _ in evs), default=time.time())
        title = f"{config.policy} on {config.topology}, {hetero.describe()}"
        report.plot_accuracy({config.policy: metrics["evals"]}, out / "accuracy.png",
                             target=args.target_acc, title=title)
        report.plot_timeline(events, out / "timeline.png", t0=t0, title=title)
        report.write_trace(events, evals, out / "trace.json", t0=t0)
    return 0


def _param_sha256(model) -> str:
    import torch

    flat = torch.cat([p.detach().reshape(-1).to(torch.float64) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def _steps_before(resume: dict | None) -> int:
    return resume["step"] if resume else 0


def _worker_state(mps, inner, epoch, index, samples, before: dict, slept_s: float) -> dict:
    """What one worker contributes to a checkpoint: data position, optimizer state, RNG states
    and its counters so far (``before``: those of the run it resumed)."""
    import torch

    local = mps.stats(server=False)["local"]
    return {"epoch": epoch, "index": index, "samples": samples,
            "optimizer": inner.state_dict(), "rng_torch": torch.get_rng_state(),
            "rng_numpy": np.random.get_state(), "rng_python": random.getstate(),
            "counters": {**{k: local[k] + before.get(k, 0) for k in (
                "iterations", "rounds", "compute_s", "wait_s", "aggregation_s", "bytes_sent")},
                "slept_s": slept_s + before.get("slept_s", 0.0)}}


def _write_checkpoint(save_checkpoint, out, model, gathered: list, n, wall_s, evals, round_,
                      step, config, server: dict | None = None) -> None:
    """Worker 0: one file, written atomically, with the model every worker holds (ring) or the
    global weights (ps) and every worker's state."""
    state = {"model": model.state_dict(), "per_worker": gathered, "workers": n,
             "round": round_, "step": step, "wall_s": wall_s, "evals": list(evals),
             "policy": config.to_dict(),
             # For the record: a resumed server starts from the model above and zero clocks
             # (module doc: what is needed for correctness and what is re-learned).
             "server": {"topology": config.topology, **(server or {})}}
    t0 = time.perf_counter()
    save_checkpoint(out / "checkpoints", round_, state)
    _warn_if_slow(time.perf_counter() - t0, "a checkpoint write", config)


def _ps_checkpoint(mps, opt, save_checkpoint, out, model, me, n, mine: dict, time_up: bool,
                   target_samples, wall, evals, round_, step, config) -> tuple[bool, int]:
    """PS checkpoint round (every worker has just made its ``round_``-th push and pull):
    agree whether to stop and, if not, write the global model at this cut.

    1. gather every worker's state to worker 0: once it returns, every worker has made
       ``round_`` pushes and the server has applied them all;
    2. worker 0 pulls the global weights, which then hold exactly those pushes, and writes;
    3. a sum-allreduce carries worker 0's decision to all: no worker pushes again before
       worker 0's pull, so no later update leaks into the saved weights.
    Returns (stop, samples of all workers)."""
    import torch

    gathered = mps.gather_object({**mine, "time_up": time_up}, root_rank=0,
                                 name="checkpoint state")
    decision = torch.zeros(2, dtype=torch.int64)
    if me == 0:
        total = sum(g["samples"] for g in gathered)
        time_up = [g.pop("time_up") for g in gathered]
        stop = any(time_up) or (target_samples is not None and total >= target_samples)
        if not stop:
            version = opt.strategy.pull_global()
            # ps_version: the updates this server applied, counted from the start of this run
            # (a resumed run's server counts from zero again).
            _write_checkpoint(save_checkpoint, out, model, gathered, n, wall(), evals, round_,
                              step, config, server={"ps_version": version})
        decision = torch.tensor([total, int(stop)], dtype=torch.int64)
    agreed = mps.allreduce(decision, average=False, name="checkpoint decision")
    return bool(agreed[1] > 0), int(agreed[0])


_slow_warned: set = set()


def _warn_if_slow(seconds: float, what: str, config: SyncConfig) -> None:
    """Worker 0 evaluates and writes checkpoints while the other workers wait for it (in the
    next collective) and the state server hears nothing from it: past ``deadline`` or
    ``silent_timeout`` that wait fails the job.  Warn once when it gets within half of them."""
    limit = min(config.deadline, config.silent_timeout)
    if seconds > limit / 2 and what not in _slow_warned:
        _slow_warned.add(what)
        print(f"mpsync train: warning: {what} on worker 0 took {seconds:.1f}s while the other "
              f"workers waited; the job fails if it exceeds {limit:g}s (--deadline "
              f"{config.deadline:g}, --silent-timeout {config.silent_timeout:g}): raise both",
              file=sys.stderr, flush=True)


def _progress(bar, args, e: dict, epoch: int, wall_s: float, global_samples: int,
              local: dict | None) -> None:
    bar.n = min(wall_s, args.time_budget) if args.time_budget else min(global_samples, bar.total)
    post = {"epoch": epoch, "acc": f"{e['accuracy']:.3f}",
            "samples/s": f"{global_samples / max(wall_s, 1e-9):.0f}"}
    if local:
        busy = local["compute_s"] + local["wait_s"] + local["aggregation_s"]
        post["wait"] = f"{(local['wait_s'] + local['aggregation_s']) / max(busy, 1e-9):.2f}"
    bar.set_postfix(post, refresh=True)


def _print_summary(m: dict) -> None:
    c = m["config"]
    ttt = m["time_to_target_s"]
    print(f"mpsync train: policy={c['policy']} topology={c['topology']} workers={c['workers']} "
          f"dataset={c['dataset']} ({c['heterogeneity']})")
    print(f"  final accuracy {m['final_acc']:.4f}  loss {m['final_loss']:.4f}  "
          f"wall {m['wall_s']:.1f}s  samples {m['total_samples']}  "
          f"samples/s {m['samples_per_s']:.0f}  wait fraction {m['wait_fraction']:.2f}  "
          f"time to target {'-' if ttt is None else f'{ttt:.1f}s'}")
    print("  worker  iterations  samples  compute_s  wait_s  aggregation_s  bytes_sent")
    for w, s in m["workers"].items():
        print(f"  {w:>6}  {s['iterations']:>10}  {s['samples']:>7}  {s['compute_s']:>9.1f}  "
              f"{s['wait_s']:>6.1f}  {s['aggregation_s']:>13.1f}  {s['bytes_sent']:>10}")
    sys.stdout.flush()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="mpsync train")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
