"""``mpsync train``: train a model under one synchronization policy (run under mpirun).

The training loop is a user of the public ``mpsync.torch`` API only (init,
DistributedOptimizer, broadcast_parameters, allreduce, gather_object, stats, shutdown).  With
``--server dedicated`` world rank 0 is the state server and never runs the loop.

Stopping must be agreed by all workers on the ring (a worker that leaves early would leave the
others in a collective): ring policies decide at round boundaries, where every worker is
present, with one small allreduce of (samples, time-is-up).  PS policies (asp, ssp, dssp) have
no common rounds; worker 0 decides the budget on its clock and tells the others (a worker on
its own clock would stop early by the waits worker 0's evaluations cause it, and leave worker
0 training alone), and every worker stops when the server's count of samples reaches the
epochs asked for.

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
are the checkpoint's model, which worker 0 sends in ``ps_init`` on resume, and with
``--ps-optimizer server`` the shards' optimizer state (momentum or Adam's moments and step
count) is in the checkpoint too and goes back to the shards before it.  The rest is soft
state the server re-learns: ElasticBSP's and ESync's iteration times (within the first round:
ElasticBSP's monitoring phase, ESync's first reports), DSSP's push-interval table, and the
server's statistics (``server_stats.json`` of a resumed run covers the resumed part).  Updates
made after the newest checkpoint are lost on a crash: the rollback is at most K rounds.

A checkpoint resumes on another number of workers too (the data re-sharded, each worker at the
same fraction of its epoch: ``mpsync.apps.train_checkpoints.reshard``); ``--max-restarts N``
does that by itself after a lost rank (``mpsync.apps.train_restarts``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from mpsync import cluster as vc
from mpsync import job_end, policies
from mpsync.apps.datasets import check_dataset_spec
from mpsync.apps.devices import check_device_before_launch, check_device_flag
from mpsync.apps.heterogeneity import Heterogeneity
from mpsync.apps.model_names import MODELS
from mpsync.apps.train_checkpoints import check_resume_before_launch, reshard
from mpsync.apps.trainer import STARTUP_CLOCK, build_optimizer_choice, mark_startup, \
    process_start_clock, train, world_rank, world_size
from mpsync.config import BACKENDS, DEFAULTS, SERVER_PLACEMENTS, TOPOLOGIES, ZIPLINE_VARIANTS, \
    OPTIMIZERS, PS_OPTIMIZERS, ConfigError, SyncConfig, check_output_dir, parse_staleness_range, \
    print_user_error
from mpsync.launch.cluster import add_cluster_arguments, argv_from_namespace
from mpsync.launch.command import add_launch_arguments, job_from_args, launch_and_wait
from mpsync.launch.hosts import launched_rank, scheduler_slots
from mpsync.launch.target import LaunchError
from mpsync.launch.mpirun import clean_launch_env, forwarded_env, python_argv
from mpsync.launch.registry import launch_argv

__all__ = ["add_arguments", "main", "build_config", "build_optimizer_choice", "validate"]


def _topology_help() -> str:
    ps_only = [s.name for s in policies.specs() if s.default_topology == "ps"]
    return (f"{' | '.join(TOPOLOGIES)} (default: the policy's own: ps for {', '.join(ps_only)}; "
            f"ring for the others)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    g = p.add_argument_group("synchronization")
    g.add_argument("--policy", default=None,
                   help=f"one of {', '.join(policies.names())} (default {d.policy}, or "
                        f"$MPSYNC_POLICY when set)")
    g.add_argument("--topology", default=None, help=_topology_help())
    g.add_argument("--backend", default=None,
                   help=f"{' | '.join(BACKENDS)}: the ring's transport (mpi4py, Horovod's "
                        f"ops, or a torch.distributed group of the workers: gloo on host "
                        f"tensors, nccl on CUDA tensors; default {d.backend}, or "
                        f"$MPSYNC_BACKEND when set)")
    g.add_argument("--bucket-mb", type=float, default=None, metavar="MB",
                   help=f"BSP on the ring: gradients in buckets of at most MB MiB, each "
                        f"averaged as soon as backward has made it (default: "
                        f"$MPSYNC_BUCKET_MB or {d.bucket_mb:g}, as PyTorch DDP)")
    g.add_argument("--no-overlap", action="store_true", default=None,
                   help="BSP on the ring: average the whole model at step(), after backward, "
                        "instead of bucket by bucket during it (default: $MPSYNC_OVERLAP or on)")
    g.add_argument("--server", default=None,
                   help=f"{' | '.join(SERVER_PLACEMENTS)} (default {d.server}: rank 0 "
                        f"serves; or $MPSYNC_SERVER when set)")
    g.add_argument("--staleness", type=int, default=None, help=f"SSP threshold s (default {d.staleness})")
    g.add_argument("--staleness-range", default=None, metavar="sL,sU", help=f"DSSP [s_L, s_U] (default {d.staleness_low},{d.staleness_high})")
    g.add_argument("--lookahead", type=int, default=None, help=f"ElasticBSP lookahead R (default {d.lookahead})")
    g.add_argument("--zipline-variant", default=None, help=f"{', '.join(ZIPLINE_VARIANTS)} (default {d.zipline_variant})")
    g.add_argument("--epsilon", type=float, default=None, help=f"ESync global learning rate (default {d.epsilon:g})")
    g.add_argument("--deadline", type=float, default=None,
                   help=f"seconds any blocking wait may take before the job fails (default "
                        f"{d.deadline:g}); raise it if an evaluation or checkpoint write on "
                        f"worker 0 can take longer")
    g.add_argument("--silent-timeout", type=float, default=None,
                   help=f"seconds after which the server counts a quiet worker as gone "
                        f"(default {d.silent_timeout:g}; start-up before a worker's first "
                        f"step has its own allowance of {d.startup_timeout:g} s)")
    g.add_argument("--ps-shards", default=None, metavar="N|auto",
                   help=f"parameter-server shards (topology ps): N, or auto = one per node, "
                        f"2 on one host (default: $MPSYNC_PS_SHARDS or {d.ps_shards})")
    g.add_argument("--ps-optimizer", default=None, choices=PS_OPTIMIZERS,
                   help=f"topology ps: who runs the optimizer, each worker (pushing the delta "
                        f"of its step) or the shards (workers push gradients; SGD or Adam; "
                        f"where every push is applied in full, a step per worker's gradient: "
                        f"divide the ring's --lr by the workers) "
                        f"(default: $MPSYNC_PS_OPTIMIZER or {d.ps_optimizer})")
    g.add_argument("--no-auto-ps", action="store_true", default=None,
                   help="policy auto: switch on the ring only, hosting no parameter-server "
                        "shards (default: $MPSYNC_AUTO_PS or on: ASP, SSP and DSSP on the PS "
                        "are among its choices)")
    g.add_argument("--plugins", default=None, metavar="MODULE[,MODULE]",
                   help="modules that register policies of their own, imported on every rank "
                        "(default: $MPSYNC_PLUGINS)")
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=float, default=None, help="passes over the training set (this or --time-budget)")
    g.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="train for S seconds of wall time (evaluation excluded)")
    g.add_argument("--dataset", default="digits", help="digits | synthetic | npz:PATH")
    g.add_argument("--partition", default="iid", help="iid | noniid (class-sorted shards)")
    g.add_argument("--device", default="auto",
                   help="auto | cpu | cuda: where each worker trains; one GPU per worker, "
                        "by its rank among the workers of its node (default auto: CUDA where "
                        "present, GPUs shared when the workers outnumber them)")
    g.add_argument("--model", default="auto",
                   help="auto (cnn for images, mlp for features) | cnn | mlp | wide-mlp "
                        "(8.7 MB of gradients on digits: communication shows on a network) | "
                        "big-mlp (51 MB: backward as long as a 1 Gbit/s allreduce) | resnet")
    g.add_argument("--synthetic-samples", type=int, default=4096,
                   help="--dataset synthetic: samples")
    g.add_argument("--synthetic-features", type=int, default=32,
                   help="--dataset synthetic: features per sample")
    g.add_argument("--synthetic-classes", type=int, default=10,
                   help="--dataset synthetic: classes")
    g.add_argument("--synthetic-noise", type=float, default=1.0, help="higher = harder")
    g.add_argument("--optimizer", default=None, choices=OPTIMIZERS,
                   help="the optimizer every worker runs, and the shards with --ps-optimizer "
                        "server (default: $MPSYNC_OPTIMIZER or sgd)")
    g.add_argument("--lr", type=float, default=0.05, help="learning rate (every optimizer)")
    g.add_argument("--momentum", type=float, default=None,
                   help="sgd only: momentum (default 0.9)")
    g.add_argument("--nesterov", action="store_true",
                   help="sgd only: Nesterov momentum (needs momentum > 0)")
    g.add_argument("--weight-decay", type=float, default=None,
                   help="every optimizer: L2 penalty added to the gradient (sgd, adam) or "
                        "decoupled decay of the weights (adamw) (default: torch's, 0 for sgd "
                        "and adam, 0.01 for adamw)")
    g.add_argument("--batch-size", type=int, default=32, help="per worker")
    g.add_argument("--seed", type=int, default=0, help="random seed")
    g.add_argument("--target-acc", type=float, default=None)
    g.add_argument("--stop-at-target", action="store_true",
                   help="end the run at the first evaluation at or above --target-acc (the "
                        "budget or epochs still cap a run that never reaches it)")
    g.add_argument("--eval-every", type=float, default=None, metavar="S",
                   help="evaluate every S seconds of wall time (default: budget/30 or 1 s)")
    g = p.add_argument_group("heterogeneity (emulated)")
    g.add_argument("--slowdown", default=None, metavar="F0,F1,..",
                   help="per-worker slowdown factors (>= 1), e.g. 1,1,2,4")
    g.add_argument("--slowdown-schedule", default=None, metavar="T:F0,..;T2:..",
                   help="new factors from wall time T on")
    g.add_argument("--iter-time", type=float, default=None, metavar="S",
                   help="emulated device time of one iteration at factor 1")
    g.add_argument("--comm-delay", type=float, default=None, metavar="S",
                   help="extra latency added to every aggregation (booked as aggregation "
                        "time; default 0, or $MPSYNC_COMM_DELAY when set)")
    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, help="directory for metrics.json, plots, trace")
    g.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                   help="checkpoint every K rounds into OUT/checkpoints (ps: every K pushes of "
                        "each worker, which is then also when the workers agree to stop)")
    g.add_argument("--resume", default=None, metavar="DIR|FILE",
                   help="continue from a run's newest checkpoint (its --out DIR) or from one "
                        "checkpoint file")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--no-plots", action="store_true",
                   help="write metrics and trace only; plot later (mpsync.apps.report.plot_run)")
    g.add_argument("--workers", type=int, default=None, help=argparse.SUPPRESS)
    # Fault injection for the resume test: SIGKILL worker 0 right after this step.
    g.add_argument("--kill-at-step", type=int, default=None, help=argparse.SUPPRESS)
    # ... and SIGSTOP the last worker after this step (a silent worker, for the fault tests).
    g.add_argument("--stop-at-step", type=int, default=None, help=argparse.SUPPRESS)
    g = p.add_argument_group("launching (when not started under mpirun or srun)")
    add_launch_arguments(g, np_help="workers to start: mpsync starts mpirun with N workers "
                                    "and, with --server dedicated, the state server's rank "
                                    "(with --cluster: default one per node besides node1; "
                                    "under mpirun: checked against the ranks started)")
    add_cluster_arguments(g)
    g = p.add_argument_group("restarts (started from the login node, not under mpirun)")
    g.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="after a rank fails, start again from the newest checkpoint on the "
                        "hosts that remain, up to N times (default 0: a fault ends the job); "
                        "needs --checkpoint-every and --out")
    g.add_argument("--min-np", type=int, default=None,
                   help="fewest workers a restart may run with (default 1)")
    g.add_argument("--max-np", type=int, default=None,
                   help="most workers a restart may run with (default --np)")


def build_config(args) -> SyncConfig:
    """The SyncConfig the flags describe, over the ``MPSYNC_*`` environment (flag >
    environment > default, as ``mpsync.torch.init``: a setting in the environment is used,
    never silently dropped; a bad one is refused naming the variable).  Validated;
    ConfigError names the flag or the variable.  The settings the launcher itself reads
    (policy, backend, server, comm delay) are written back into ``args`` as resolved, so the
    ranks it starts are given them as flags."""
    # No topology: the policy's own (SyncConfig.validate asks the registry).
    flags = {"policy": args.policy, "topology": args.topology, "backend": args.backend,
             "server": args.server, "plugins": args.plugins, "ps_shards": args.ps_shards,
             "ps_optimizer": args.ps_optimizer, "staleness": args.staleness,
             "lookahead": args.lookahead, "zipline_variant": args.zipline_variant,
             "epsilon": args.epsilon, "deadline": args.deadline,
             "silent_timeout": args.silent_timeout, "comm_delay": args.comm_delay,
             "bucket_mb": args.bucket_mb}
    opts = {key: value for key, value in flags.items() if value is not None}
    if getattr(args, "no_auto_ps", None):
        opts["auto_ps"] = False
    if getattr(args, "no_overlap", None):
        opts["overlap"] = False
    if args.staleness_range is not None:
        low, high = parse_staleness_range(args.staleness_range)
        opts.update(staleness_low=low, staleness_high=high)
    if args.comm_delay is not None and not args.comm_delay >= 0:
        raise ConfigError(f"--comm-delay must be >= 0 seconds, got {args.comm_delay}")
    config = SyncConfig.from_options(env=os.environ, **opts)
    if not config.comm_delay >= 0:
        raise ConfigError(f"MPSYNC_COMM_DELAY must be >= 0 seconds, got {config.comm_delay}")
    args.policy, args.backend, args.server = config.policy, config.backend, config.server
    args.comm_delay = config.comm_delay
    return config


def check_transport(backend: str) -> None:
    """A gloo or NCCL backend this machine's torch cannot run (NCCL without CUDA) is refused
    before launch, naming it, instead of failing on every rank."""
    if backend in ("gloo", "nccl"):
        from mpsync.config import transport_unavailable

        reason = transport_unavailable(backend)
        if reason is not None:
            raise ConfigError(reason)


def validate(args, workers: int | None) -> SyncConfig:
    """Every check that needs no communicator (run before launch and on every rank)."""
    config = build_config(args)
    check_transport(config.backend)
    build_optimizer_choice(args)
    if (args.epochs is None) == (args.time_budget is None):
        raise ConfigError("give exactly one of --epochs N or --time-budget S")
    if args.epochs is not None and not args.epochs > 0:
        raise ConfigError(f"--epochs must be > 0, got {args.epochs}")
    if args.time_budget is not None and not args.time_budget > 0:
        raise ConfigError(f"--time-budget must be > 0 seconds, got {args.time_budget}")
    if args.target_acc is not None and not 0 < args.target_acc <= 1:
        raise ConfigError(f"--target-acc must be in (0, 1], got {args.target_acc}")
    if args.stop_at_target and args.target_acc is None:
        raise ConfigError("--stop-at-target needs --target-acc")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
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
    check_device_flag(args.device)
    if args.model not in MODELS:
        raise ConfigError(f"unknown --model {args.model!r}; choose from {', '.join(MODELS)}")
    if args.out:
        check_output_dir("--out", args.out)
    if args.resume and not os.path.exists(args.resume):
        raise ConfigError(f"--resume {args.resume}: no such file or directory; give the --out "
                          f"directory of the run to continue, or one of its checkpoint files")
    if workers is not None:
        if workers < 1:
            raise ConfigError(f"need at least 1 worker, got {workers}")
        Heterogeneity.from_flags(0, workers, args.slowdown, args.slowdown_schedule,
                                 args.iter_time, args.comm_delay)
    return config


def main(args) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if not launched_rank():
        try:
            build_config(args)   # the settings the launcher reads: flag, MPSYNC_* or default
            if args.max_restarts:
                from mpsync.apps.train_restarts import run_supervised

                return run_supervised(args, validate, add_arguments)
            if args.cluster is not None:
                return _run_on_cluster(args)
            return _launch_here(args)
        except Exception as e:  # noqa: BLE001 - one line for a user's mistake, else raised
            if not job_end.is_user_error(e):
                raise
            print_user_error("mpsync train", e)
            return 2
    # A rank: from here on, an error nothing catches ends the whole job at once (the abort
    # hook; mps.init puts its own in place, naming the worker, once it knows it).
    job_end.install_abort_hooks(None, job_end.rank_label(), prog="mpsync train")
    started = process_start_clock()
    if started is not None:
        STARTUP_CLOCK["process"] = started
    mark_startup("main")
    try:
        build_config(args)
        workers = _workers_launched(args)
        config = validate(args, workers)
        resume = None
        if args.resume and not _is_dedicated_server(args):
            from mpsync.apps.checkpoint import latest_good  # torch

            # Every worker reads and verifies the checkpoint before any communication, so a
            # bad one fails the whole job at once with the same message.  The dedicated
            # server's rank never uses it and does not read it: the read imports torch, one
            # process more doing so on the nodes of a restart (whose start-up is on the
            # job's clock), and the server's start does not wait for it.
            path, resume = latest_good(args.resume, warn=lambda msg: _warn_once(msg, args))
            if world_rank() == _first_worker(args):
                print(f"mpsync train: resuming from {path}: round {resume['round']}, "
                      f"step {resume['step']}" + (
                          f" (written by {resume['workers']} workers: data re-sharded over "
                          f"{workers})" if resume["workers"] != workers else ""), flush=True)
            resume = reshard(resume, workers)
            mark_startup("checkpoint_read")
    except Exception as e:  # noqa: BLE001 - one clear line, not a traceback, for bad input
        from mpsync.apps.checkpoint import CheckpointError

        if not isinstance(e, (ConfigError, CheckpointError)):
            raise
        if isinstance(e, CheckpointError) and args.server == "dedicated":
            return _refuse_beside_the_server(e)
        if world_rank() == 0:
            print_user_error("mpsync train", e)
            return 2
        # The check is the same on every rank, so rank 0's line and exit status fail the job.
        # The other ranks stop without an error of their own: Open MPI aborts the job at the
        # first non-zero exit and drops output still in flight, which lost rank 0's line.
        return 0
    return train(args, config, workers, resume)


def _is_dedicated_server(args) -> bool:
    return args.server == "dedicated" and world_rank() == 0


def _first_worker(args) -> int:
    """World rank of worker 0 (rank 0 is the dedicated server's)."""
    return 1 if args.server == "dedicated" else 0


def _refuse_beside_the_server(error: Exception) -> int:
    """A checkpoint the workers refuse while the dedicated server's rank, which does not read
    it, is already starting MPI and waiting for them there: every worker starts MPI too, and
    worker 0 says why in one line and aborts the job, the server with it (a worker that only
    exited would leave the server waiting, under a launcher that does not end a job at a
    non-zero exit).  The other workers return 0 (their own abort could cut worker 0's line)
    and wait in ``MPI_Finalize`` until the abort ends them."""
    from mpi4py import MPI

    if world_rank() == 1:
        print_user_error("mpsync train", error)
        job_end.end_job(2, MPI.COMM_WORLD)   # never returns
    return 0


def _workers_launched(args) -> int:
    """The workers among the ranks mpirun started, checked against ``--np``."""
    size = world_size()
    dedicated = args.server == "dedicated"
    workers = args.workers or (size - 1 if dedicated else size)
    if workers < 1:
        raise ConfigError(f"mpirun started {size} rank{'s' * (size != 1)}: rank 0 is the state "
                          f"server (--server dedicated), which leaves no worker; start one "
                          f"rank more than the workers (mpirun -np 5 for 4), use --server "
                          f"colocated, or let mpsync start them: mpsync train --np 4 ...")
    if args.np is not None and args.np != workers and not args.workers:
        raise ConfigError(f"--np {args.np}, but mpirun started {size} ranks = {workers} "
                          f"workers{' + the state server' if dedicated else ''}; start "
                          f"mpirun -np {args.np + dedicated}, or leave --np out under mpirun")
    return workers


def _launch_here(args) -> int:
    """``mpsync train --np N`` outside mpirun: start mpirun with this same training on N
    workers (and the server's rank) here, on ``-H``/``--hostfile`` hosts or in the scheduler's
    allocation, and wait; every flag is checked before any rank starts."""
    if args.np is None:
        raise ConfigError("--np N is needed to start the workers (e.g. mpsync train --np 4 "
                          "--time-budget 10), or start mpsync train under mpirun / srun")
    validate(args, args.np)
    if args.resume:
        check_resume_before_launch(args)
    # Every worker on this host unless -H/--hostfile/a scheduler places them elsewhere.
    here = None if (args.hosts or args.hostfile or scheduler_slots() is not None) else args.np
    check_device_before_launch(args.device, here)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    rest = argv_from_namespace(parser, args, drop=("cluster", "cluster_placement", "hosts",
                                                   "hostfile", "mpirun_args"))
    job = job_from_args(args, python_argv("mpsync.apps.train", *rest), args.np,
                        args.server == "dedicated", "mpsync train")
    return launch_and_wait(job)


def _run_on_cluster(args) -> int:
    """``mpsync train --cluster``: start this same training under ``mpirun`` on the cluster's
    nodes (``--np`` workers, default one per node besides node1; plus the dedicated server's
    rank) and wait for it; the exit code is mpirun's."""
    name = args.cluster or None
    state = vc.load_state(name)
    if state is None:
        print(f"mpsync train: error: cluster {name or vc.default_name()!r} is not up "
              f"(mpsync cluster up --nodes N)", file=sys.stderr)
        return 2
    dedicated = args.server == "dedicated"
    workers = args.np or max(1, len(state.nodes) - (1 if dedicated else 0))
    ranks = workers + (1 if dedicated else 0)
    validate(args, workers)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    rest = argv_from_namespace(parser, args, drop=("cluster", "cluster_placement", "np", "hosts",
                                                   "hostfile", "mpirun_args"))
    argv = launch_argv(ranks, python_argv("mpsync.apps.train", *rest), cluster=name or "",
                       placement=args.cluster_placement, forward_env=forwarded_env())
    print(f"mpsync train: {ranks} ranks on cluster {state.name}: {' '.join(argv)}",
          file=sys.stderr, flush=True)
    return subprocess.run(argv, env=clean_launch_env(os.environ)).returncode


def _warn_once(msg: str, args) -> None:
    """Once per job: on worker 0's rank (every worker reads the checkpoint)."""
    if world_rank() == _first_worker(args):
        print(f"mpsync train: {msg}", file=sys.stderr)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="mpsync train")
    add_arguments(parser)
    code = main(parser.parse_args())
    if code:
        job_end.end_job(code)   # every rank, now: MPI_Finalize would wait for the others
    sys.exit(code)
