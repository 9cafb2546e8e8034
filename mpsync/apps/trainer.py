"""The worker side of ``mpsync train``: one training run through the public ``mpsync.torch`` API.

:func:`train` is the loop; :class:`Worker` holds what one worker trains and where it is
(data position, clock, evaluations); the stop rules of :mod:`mpsync.apps.train_stops` decide,
per topology, when the workers end;
:mod:`mpsync.apps.train_checkpoints` writes the consistent cuts; :func:`finish` gathers the
metrics and worker 0 writes the results.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import socket
import sys
import time
from pathlib import Path

import numpy as np

# torch, mpsync.torch and the models (torch) are imported inside the functions that use them:
# `mpsync train` checks its arguments and starts mpirun without loading torch.
from mpsync.apps import report
from mpsync.apps.datasets import load_dataset, partition
from mpsync.apps.heterogeneity import Heterogeneity
from mpsync.apps.train_checkpoints import COUNTERS, check_model_fits, flush_checkpoints, \
    remap_position, restore_rng_states, warn_if_slow, worker_state
from mpsync.apps.train_stops import make_stop
from mpsync.config import OptimizerChoice, SyncConfig, optimizer_choice

__all__ = ["train", "finish", "world_rank", "world_size", "Worker", "build_optimizer_choice"]


# When this rank's start-up passed each of its parts, seconds since the epoch (worker 0's go
# to metrics.json as ``startup_clock``): what a restart's cost is made of.
STARTUP_CLOCK: dict[str, float] = {}


def process_start_clock() -> float | None:
    """When this process was started (exec), seconds since the epoch; None off Linux."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(ln.split()[1]) for ln in f if ln.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def mark_startup(part: str) -> None:
    STARTUP_CLOCK[part] = time.time()


def world_rank() -> int:
    """This process's rank in the job, from the launcher's environment (before MPI_Init)."""
    return int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))


def world_size() -> int:
    return int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1")))


def build_optimizer_choice(args) -> OptimizerChoice:
    """The optimizer ``mpsync train``'s flags describe (validated: a setting given to an
    optimizer it means nothing to is a ConfigError naming the flag)."""
    return optimizer_choice(getattr(args, "optimizer", None), args.lr,
                            momentum=getattr(args, "momentum", None),
                            nesterov=getattr(args, "nesterov", False),
                            weight_decay=getattr(args, "weight_decay", None))


def fused_step(model, device) -> dict:
    """``fused=True`` where torch has a fused step for the model's device and dtypes: the
    optimizer then updates each parameter, its gradient and state in one pass instead of one
    per arithmetic operation (SGD with momentum: three passes over the model fewer).  On the
    wide MLP (2,176,010 float32) the step takes 0.58 ms instead of 0.78 alone, and four
    compute-only processes on two cores train 6-9% more samples a second.  The arithmetic is
    torch's own; in float32 and float64 it agrees with the default step's to rounding (the
    fused kernel may contract a multiply and an add into one instruction: after 20 SGD steps
    on the wide MLP, 1.5e-8 apart at most).  In half precision the fused kernels round once
    where the default rounds per operation, so a bfloat16 or float16 model (and any device but
    the CPU and CUDA) keeps torch's default step, as it would without mpsync.  (torch has
    fused SGD, Adam and AdamW on the CPU and CUDA since 2.4; the pinned torch is newer.)"""
    import torch

    if device.type not in ("cpu", "cuda"):
        return {}
    if not all(p.dtype in (torch.float32, torch.float64) and p.device == device
               for p in model.parameters()):
        return {}
    return {"fused": True}


def train(args, config: SyncConfig, workers: int, resume: dict | None) -> int:
    """Run the training loop on this rank (a dedicated server rank serves inside init)."""
    w = Worker.start(args, config, workers, resume)
    stop = make_stop(w)
    if w.me == 0 and resume is None:
        w.record_eval(0)
    w.last_eval = w.wall()
    done = False
    while not done:
        round_before = w.step()
        done = stop.after_step(round_before)
        w.maybe_evaluate(round_before, at_round_boundary_only=config.topology == "ring")
    # PS: the last push comes before any collective (under SSP/DSSP a faster worker's pull
    # may be held until every other worker's last update is in, so a gather first would
    # deadlock).  Ring: the final aggregation before the metrics are gathered, so each
    # worker's parameter checksum is of the model it ends with.
    w.opt.strategy.finish()
    stop.close()
    w.stop_reason = stop.reason
    return finish(w)


def _serve_and_exit(init_kw: dict, outputs: dict) -> None:
    """The dedicated server rank: what ``mps.init`` does there (the same collectives, then
    serve), without importing torch, which this rank never uses."""
    from mpi4py import MPI

    from mpsync.server import job

    config = job.config_of(**init_kw)
    job.serve_dedicated(job.join(MPI.COMM_WORLD, config), config, **outputs)
    sys.exit(0)


class Worker:
    """One worker's run: model, optimizer, data shard, clock and evaluations."""

    def __init__(self, args, config: SyncConfig, resume: dict | None):
        self.args, self.config, self.resume = args, config, resume
        self.optimizer_choice = build_optimizer_choice(args)
        self.out = Path(args.out) if args.out else None
        self.me = self.n = 0          # this worker's rank and the number of workers
        # Built by start(): data set, shard, heterogeneity, model, the mpsync.torch module,
        # optimizers, test tensors and loss.
        self.ds = self.shard = self.hetero = self.model = self.mps = None
        self.device = None            # torch.device, from --device (_take_device)
        self.inner = self.opt = self.x_test = self.y_test = self.loss_fn = None
        self.epoch = self.index = self.samples = self.step_count = 0
        self.wall_offset, self.eval_s, self.round_offset = 0.0, 0.0, 0
        self.evals: list[dict] = []
        self.bar = None
        self.last_eval = 0.0
        # Worker 0 (the one that evaluates), with --stop-at-target: an evaluation reached it.
        self.reached_target = False
        self.stop_reason: str | None = None

    @classmethod
    def start(cls, args, config: SyncConfig, workers: int, resume: dict | None) -> "Worker":
        """Build data and model, then ``mps.init`` (a dedicated server rank never returns)."""
        w = cls(args, config, resume)
        rank = world_rank()
        if w.out is not None and rank == 0:
            w.out.mkdir(parents=True, exist_ok=True)
        init_kw = {k: v for k, v in config.to_dict().items() if k != "extra"}
        outputs = dict(stats_path=str(w.out / "server_stats.json") if w.out else None,
                       trace_path=str(w.out / "server_trace.json") if w.out else None)
        if config.server == "dedicated" and rank == 0:
            _serve_and_exit(init_kw, outputs)
        import torch

        import mpsync.torch as mps
        from mpsync.apps.models import build_model

        mark_startup("torch_imported")
        torch.set_num_threads(1)
        # Data and model are built before init: the state server counts a registered worker
        # that stays quiet for longer than silent_timeout as gone, and a loaded machine is
        # slow here.
        dedicated = config.server == "dedicated"
        w.me = rank - 1 if dedicated else rank
        if not (dedicated and rank == 0):
            w.ds = load_dataset(args.dataset, seed=args.seed,
                                synthetic_samples=args.synthetic_samples,
                                synthetic_features=args.synthetic_features,
                                synthetic_classes=args.synthetic_classes,
                                synthetic_noise=args.synthetic_noise)
            w.shard = partition(w.ds, workers, w.me, args.partition, seed=args.seed)
            w.hetero = Heterogeneity.from_flags(w.me, workers, args.slowdown,
                                                args.slowdown_schedule, args.iter_time,
                                                args.comm_delay)
            w.model = build_model(w.ds.input_shape, w.ds.n_classes, args.seed, args.model)
        mark_startup("data_and_model")
        mps.init(**init_kw, **outputs)
        mark_startup("init")
        # Only workers get here (a dedicated server serves inside init and exits).
        w.mps, w.n = mps, mps.size()
        if w.n != workers or mps.rank() != w.me:
            raise RuntimeError(f"expected worker {w.me} of {workers}, mpsync.torch reports "
                               f"{mps.rank()} of {w.n}")
        w._take_device()
        w._build_optimizer()
        return w

    def _take_device(self) -> None:
        """This worker's device (``--device``, :mod:`mpsync.apps.devices`), the model moved
        there; one line per worker says which.  A device that cannot be had ends the job as
        one line, exit status 2."""
        import torch

        from mpsync.apps.devices import choose_device
        from mpsync.config import ConfigError
        from mpsync.server.job import refuse

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        local, local_size = self.mps.local_rank(), self.mps.local_size()
        try:
            name, note = choose_device(getattr(self.args, "device", "auto"), local,
                                       local_size, gpus)
        except ConfigError as e:
            refuse(e)   # never returns
        self.device = torch.device(name)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            what = torch.cuda.get_device_name(self.device)
        else:
            what = "host"
        if note is not None and local == 0:
            print(f"mpsync train: {note}", flush=True)
        print(f"mpsync train: worker {self.me} (local {local} of {local_size}) on "
              f"{self.device} ({what})", flush=True)
        self.model.to(self.device)

    def _build_optimizer(self) -> None:
        import torch

        args, mps = self.args, self.mps
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
        self.inner = getattr(torch.optim, self.optimizer_choice.torch_class)(
            self.model.parameters(), **self.optimizer_choice.torch_kwargs(),
            **fused_step(self.model, self.device))
        self.x_test = torch.from_numpy(self.ds.x_test).to(self.device)
        self.y_test = torch.from_numpy(self.ds.y_test).to(self.device)
        self._restore_or_seed()
        self.opt = mps.DistributedOptimizer(self.inner,
                                            named_parameters=self.model.named_parameters())
        shards_state = (self.resume or {}).get("server", {}).get("optimizer")
        if shards_state is not None and self.me == 0 and self.config.ps_optimizer == "server":
            self.opt.strategy.restore_server_optimizer(shards_state)
        mps.broadcast_parameters(self.model.state_dict(), root_rank=0)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.per_epoch = self.shard.batches_per_epoch(args.batch_size)
        self.target_samples = (int(args.epochs * len(self.ds.y_train))
                               if args.epochs is not None else None)
        self.eval_every = args.eval_every or (args.time_budget / 30 if args.time_budget else 1.0)
        self.global_samples = self.samples * self.n  # estimate between stop checks
        # A resumed run's samples before it (on the PS every worker made as many pushes at
        # the cut, so this is exact): the server's count of updates starts again from 0.
        self.samples_at_start = self.global_samples
        # The workers' samples as last summed exactly (the ring's stop checks).
        self.agreed_samples = self.global_samples
        self.ps_samples_base = self.global_samples   # auto: where the PS's count starts
        self.start_time = time.perf_counter()
        # When a resumed run is ready to train: a supervisor's restart cost ends here.
        self.resumed_at_clock = time.time() if self.resume is not None else None
        mark_startup("ready")
        if self.me == 0 and not args.no_progress:
            from tqdm import tqdm

            self.bar = tqdm(total=args.time_budget if args.time_budget else self.target_samples,
                            unit="s" if args.time_budget else "sample", file=sys.stderr,
                            desc=self.config.policy, mininterval=0.5, dynamic_ncols=True)

    def _restore_or_seed(self) -> None:
        """Where this worker is in its data, and what was measured before a resume."""
        import torch

        if self.resume is None:
            seed = self.args.seed + 1000 * self.me
            torch.manual_seed(seed)
            np.random.seed(seed)
            random.seed(seed)
            return
        mine = self.resume["per_worker"][self.me]
        check_model_fits(self.model, self.resume["model"], self.args.resume, self.args)
        self.model.load_state_dict(self.resume["model"])
        self.inner.load_state_dict(mine["optimizer"])
        self.epoch, self.index, self.samples = mine["epoch"], mine["index"], mine["samples"]
        if "resharded_from" in mine:   # written by another number of workers: same fraction
            old_n, old_me = mine["resharded_from"]
            old = partition(self.ds, old_n, old_me, self.args.partition, seed=self.args.seed)
            self.index = remap_position(self.index, old.batches_per_epoch(self.args.batch_size),
                                        self.shard.batches_per_epoch(self.args.batch_size))
        restore_rng_states(mine)
        self.wall_offset, self.evals = self.resume["wall_s"], self.resume["evals"]
        self.round_offset = self.resume["round"]

    # -- clock, rounds and counters ------------------------------------------------------------
    def wall(self) -> float:
        """Training wall time: evaluations excluded, a resumed run's time included."""
        return self.wall_offset + time.perf_counter() - self.start_time - self.eval_s

    @property
    def round(self) -> int:
        """Aggregations so far, counted from the start of the first run."""
        return self.opt.strategy.round + self.round_offset

    @property
    def steps(self) -> int:
        """Steps so far, counted from the start of the first run."""
        return self.step_count + (self.resume["step"] if self.resume else 0)

    @property
    def counters_before(self) -> dict:
        """This worker's counters of the run it resumed."""
        return self.resume["per_worker"][self.me]["counters"] if self.resume else {}

    def state(self) -> dict:
        return worker_state(self.mps, self.inner, self.epoch, self.index, self.samples,
                            self.counters_before, self.hetero.slept_s)

    def time_up(self) -> bool:
        return bool(self.args.time_budget and self.wall() >= self.args.time_budget)

    # -- one iteration ---------------------------------------------------------------------------
    def _probe(self):
        """The next batch's gradients at the weights as they are (``probe_gradient_noise``),
        and its loss (the step test takes it twice)."""
        import torch

        index = (self.index + 1) % self.per_epoch
        xb, yb = self.shard.batch(self.epoch, index, self.args.batch_size)
        x = torch.from_numpy(xb).to(self.device, non_blocking=True)
        y = torch.from_numpy(yb).to(self.device, non_blocking=True)
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        return loss

    def step(self) -> int:
        """One local iteration (forward, backward, emulated device time, ``opt.step()``);
        returns the strategy's round before the step."""
        import torch

        args = self.args
        t_iter = time.perf_counter()
        xb, yb = self.shard.batch(self.epoch, self.index, args.batch_size)
        self.opt.zero_grad()
        xb_t = torch.from_numpy(xb).to(self.device, non_blocking=True)
        yb_t = torch.from_numpy(yb).to(self.device, non_blocking=True)
        loss = self.loss_fn(self.model(xb_t), yb_t)
        loss.backward()
        self.opt.report_loss(loss, epoch=self.epoch + 1)   # auto's loss watch, OSP's Alg. 1
        self.opt.probe_gradient_noise(self._probe)         # auto's noise scale, once a second
        self.hetero.pad(time.perf_counter() - t_iter, self.wall())
        round_before = self.opt.strategy.round
        self.opt.step()
        self.step_count += 1
        self.samples += len(yb)
        self.index += 1
        if self.index >= self.per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        if args.kill_at_step is not None and self.me == 0 and self.steps == args.kill_at_step:
            # Says where the run got to, so a test can measure how far a resume rolls back.
            print(f"mpsync train: fault injection: SIGKILL worker 0 after step "
                  f"{args.kill_at_step}, round {self.round}", flush=True)
            flush_checkpoints()   # the cut before the kill is on disk: a test knows which
            os.kill(os.getpid(), signal.SIGKILL)
        if args.stop_at_step is not None and self.me == self.n - 1 and \
                self.steps == args.stop_at_step:
            # The last worker goes silent (SIGSTOP: alive, answering nothing), for fault tests.
            # The clock: a test times the job's end from the fault.
            print(f"mpsync train: fault injection: SIGSTOP worker {self.me} after step "
                  f"{args.stop_at_step} at clock {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        return round_before

    # -- evaluation --------------------------------------------------------------------------
    def evaluate(self) -> tuple[float, float]:
        import torch

        self.model.eval()
        with torch.no_grad():
            logits = self.model(self.x_test)
            loss = float(self.loss_fn(logits, self.y_test))
            acc = float((logits.argmax(1) == self.y_test).float().mean())
        self.model.train()
        return acc, loss

    def record_eval(self, global_samples: int) -> dict:
        t0, at = time.perf_counter(), self.wall()  # the wall time the evaluation is taken at
        acc, loss = self.evaluate()
        e = {"wall_s": at, "samples": int(global_samples), "accuracy": acc, "loss": loss,
             "wall_clock": time.time()}
        self.evals.append(e)
        took = time.perf_counter() - t0
        self.eval_s += took
        if self.opt is not None:   # worker 0's evaluations are not its compute (its speed)
            self.opt.exclude_from_compute(took)
        if self.args.stop_at_target and acc >= self.args.target_acc:
            self.reached_target = True
        return e

    def maybe_evaluate(self, round_before: int, at_round_boundary_only: bool) -> None:
        """Worker 0 evaluates every ``eval_every`` seconds.  On the ring its replica is the
        global model only right after an aggregation (ESync and ElasticBSP run local steps
        between rounds), so a due evaluation waits for the next round boundary: every recorded
        point is a model all workers hold."""
        if self.me != 0 or self.wall() - self.last_eval < self.eval_every:
            return
        if at_round_boundary_only and self.opt.strategy.round == round_before:
            return
        t_eval = time.perf_counter()
        e = self.record_eval(self.global_samples)
        self.last_eval = self.wall()
        warn_if_slow(time.perf_counter() - t_eval, "an evaluation", self.config)
        if self.bar is not None:
            _progress(self, e)


def _progress(w: Worker, e: dict) -> None:
    args, bar, wall_s = w.args, w.bar, w.wall()
    local = w.mps.stats(server=False)["local"]
    bar.n = min(wall_s, args.time_budget) if args.time_budget else min(w.global_samples, bar.total)
    post = {"epoch": w.epoch, "acc": f"{e['accuracy']:.3f}",
            "samples/s": f"{w.global_samples / max(wall_s, 1e-9):.0f}"}
    if local:
        busy = local["compute_s"] + local["wait_s"] + local["aggregation_s"]
        post["wait"] = f"{(local['wait_s'] + local['aggregation_s']) / max(busy, 1e-9):.2f}"
    bar.set_postfix(post, refresh=True)


# -- the end of the run ------------------------------------------------------------------------
def finish(w: Worker) -> int:
    """Gather every worker's counters to worker 0, shut down, and (worker 0) write results."""
    flush_checkpoints()
    local = w.mps.stats()["local"]
    before = w.counters_before
    mine = {k: local[k] + before.get(k, 0) for k in COUNTERS}
    mine.update(samples=w.samples, slept_s=w.hetero.slept_s + before.get("slept_s", 0.0),
                param_sha256=_param_sha256(w.model), events=local["events"],
                host=socket.gethostname())
    gathered = w.mps.gather_object(mine, root_rank=0, name="final metrics")
    final_wall = w.wall()
    w.mps.shutdown()
    if w.bar is not None:
        w.bar.close()
    if w.me != 0:
        return 0
    e = w.record_eval(sum(g["samples"] for g in gathered))
    e["wall_s"] = final_wall
    events = {i: g.pop("events") for i, g in enumerate(gathered)}
    metrics = _metrics(w, gathered, final_wall)
    report.summarize(metrics, w.args.target_acc)
    _print_summary(metrics)
    if w.out is not None:
        _write_results(w, metrics, events)
    return 0


def _metrics(w: Worker, gathered: list[dict], final_wall: float) -> dict:
    args, ds, hetero = w.args, w.ds, w.hetero
    server = w.mps.stats()["server"]
    # The policy's own per-epoch / per-superstep record (osp_ics_fraction, ebsp_supersteps).
    policy_metrics = ((server or {}).get("policy_state") or {}).get("metrics") or {}
    return {**policy_metrics,
        "schema": 1,
        "config": {**w.config.to_dict(), "workers": w.n, "dataset": ds.name,
                   "partition": args.partition, "batch_size": args.batch_size,
                   **w.optimizer_choice.to_dict(),
                   "fused_step": bool(w.inner.param_groups[0].get("fused")),
                   "seed": args.seed, "epochs": args.epochs,
                   "time_budget": args.time_budget, "target_acc": args.target_acc,
                   "stop_at_target": args.stop_at_target,
                   "slowdown": hetero.factors, "slowdown_schedule": args.slowdown_schedule,
                   "iter_time": args.iter_time, "comm_delay": args.comm_delay,
                   "heterogeneity": hetero.describe(), "train_samples": len(ds.y_train),
                   "test_samples": len(ds.y_test), "resumed": w.resume is not None},
        "evals": [{k: v for k, v in ev.items() if k != "wall_clock"} for ev in w.evals],
        "workers": {str(i): g for i, g in enumerate(gathered)},
        "wall_s": final_wall,
        "eval_s": round(w.eval_s, 4),   # worker 0's evaluations, excluded from wall_s
        # What ended training: "target" (--stop-at-target), "budget" or "epochs".
        "stop_reason": w.stop_reason,
        # When training began (worker 0's first evaluation), seconds since the epoch: what a
        # launcher subtracts its own start from to time the start-up.
        "train_start_clock": w.evals[0].get("wall_clock") if w.evals else None,
        "resumed_at_clock": w.resumed_at_clock,
        # Worker 0's start-up, part by part (STARTUP_CLOCK): process, main (the interpreter and
        # mpsync's modules), checkpoint_read, torch_imported, data_and_model, init (MPI, the
        # state server, the shards, Numba's cached kernels), ready (optimizer and broadcast).
        "startup_clock": dict(STARTUP_CLOCK),
        "final_param_sha256": _param_sha256(w.model),
        "server": server,
        **_switches(w),
    }


def _switches(w: Worker) -> dict:
    """Policy auto: worker 0's switches, each with its training wall time (evaluations
    excluded, as the evals' ``wall_s``), for the summary and the plots."""
    switches = getattr(w.opt.strategy, "switches", None)
    if not switches:
        return {}
    out = []
    for s in switches:
        # Evaluation time taken before the switch: that of the last evaluation before it.
        before = [e for e in w.evals if e.get("wall_clock", 0) <= s["at_clock"]]
        offset = before[-1]["wall_clock"] - before[-1]["wall_s"] if before else s["at_clock"]
        out.append({k: v for k, v in s.items() if k != "at_clock"} |
                   {"wall_s": round(s["at_clock"] - offset, 3)})
    return {"switches": out}


def _write_results(w: Worker, metrics: dict, events: dict) -> None:
    import torch

    out, config = w.out, w.config
    report.write_metrics(metrics, out)
    torch.save(w.model.state_dict(), out / "model.pt")
    t0 = min((a for evs in events.values() for _, a, _ in evs), default=time.time())
    report.write_trace(events, w.evals, out / "trace.json", t0=t0)
    if not getattr(w.args, "no_plots", False):   # else the caller plots (report.plot_run)
        report.plot_run(out)


def _param_sha256(model) -> str:
    import torch

    flat = torch.cat([p.detach().reshape(-1).to("cpu", torch.float64)
                      for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def _print_summary(m: dict) -> None:
    c = m["config"]
    ttt = m["time_to_target_s"]
    print(f"mpsync train: policy={c['policy']} topology={c['topology']} workers={c['workers']} "
          f"dataset={c['dataset']} ({c['heterogeneity']})")
    print(f"  final accuracy {m['final_acc']:.4f}  loss {m['final_loss']:.4f}  "
          f"wall {m['wall_s']:.1f}s  samples {m['total_samples']}  "
          f"samples/s {m['samples_per_s']:.0f}  wait fraction {m['wait_fraction']:.2f}  "
          f"time to target {'-' if ttt is None else f'{ttt:.1f}s'}")
    for d in m.get("decisions") or ():
        print(f"  auto at {d['at_s']:.1f}s ({d['trigger']}): {d['reason']}")
    noise = m.get("auto_gradient_noise")
    if noise:
        print(f"  auto's full-update gain for this job (the parameter server's progress per "
              f"sample over the ring's): {noise['note']}")
    for p in m.get("auto_progress") or ():
        print(f"  auto measured at {p['at_s']:.1f}s: {p['note']}")
    for s in m.get("switches") or ():
        print(f"  auto switched {s['from']}/{s.get('from_topology', 'ring')} -> "
              f"{s['to']}/{s.get('to_topology', 'ring')} after round {s['round']} "
              f"(wall {s['wall_s']:.1f}s, the switch took {s.get('took_s', 0) * 1e3:.1f} ms)")
    print("  worker  iterations  samples  compute_s  wait_s  aggregation_s  bytes_sent")
    for w, s in m["workers"].items():
        print(f"  {w:>6}  {s['iterations']:>10}  {s['samples']:>7}  {s['compute_s']:>9.1f}  "
              f"{s['wait_s']:>6.1f}  {s['aggregation_s']:>13.1f}  {s['bytes_sent']:>10}")
    sys.stdout.flush()
