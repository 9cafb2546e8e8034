"""``mpsync train --max-restarts N``: a training job that heals itself.

Started outside ``mpirun`` (from a login node, or inside a Slurm/PBS allocation), it starts the
job through the launch registry -- the same command line ``mpsync train --np N`` /
``--cluster`` runs -- under :func:`mpsync.launch.supervisor.supervise`.  When a rank fails the
job ends (Open MPI 4.1 has no fault tolerance); the supervisor starts it again on the hosts
that remain (on one host: one worker fewer; ``--min-np``/``--max-np`` bound the count) with
``--resume`` pointing at the newest checkpoint that passes verification, so:

* the data are re-sharded over the new worker count and each worker's position moved to the
  same fraction of its epoch (:func:`mpsync.apps.train_checkpoints.reshard`);
* the policy's state is rebuilt as on any resume (module doc of ``mpsync.apps.train``): the
  model or the PS shards from the checkpoint, SSP/DSSP clocks at zero with no gaps, the
  ElasticBSP plan and ESync's times re-learned within a round;
* the checkpoint each restart resumed from is kept (hard-linked) under ``OUT/restarts/``, and
  ``OUT/restarts.json`` records every start: workers, hosts, exit, the failed rank, its host
  and cause, and the checkpoint resumed from; when the run ends, ``metrics.json`` gets the
  same record under ``"restarts"`` with each restart's cost (the failed job's end to the
  resumed job's first step) and the rounds it rolled back.  The evaluations, wall clock and
  counters continue across restarts (they travel in the checkpoints).

A run that never wrote a checkpoint restarts from the beginning.  Exit code 2 (bad input) is
never retried.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from dataclasses import replace
from pathlib import Path

from mpsync.apps.checkpoint import HEADER_FIELDS, CheckpointError, checkpoint_header, \
    latest_good
from mpsync.config import ConfigError
from mpsync.launch.cluster import argv_from_namespace
from mpsync.launch.mpirun import python_argv
from mpsync.launch.runner import build_job
from mpsync.launch.supervisor import LOCAL, Attempt, Host, SupervisorError, allocation_hosts, \
    hosts_text, parse_hosts, run_watched, supervise, write_record

__all__ = ["run_supervised", "restart_costs", "restart_point"]

# Flags the supervisor decides itself on every start (or that only make sense once).
_SUPERVISOR_FLAGS = ("cluster", "cluster_placement", "np", "max_restarts", "min_np", "max_np",
                     "resume", "workers", "hosts", "hostfile", "mpirun_args")


def run_supervised(args, validate, add_arguments) -> int:
    """Supervise ``mpsync train``'s jobs; ``validate(args, workers)`` and
    ``add_arguments(parser)`` are train's own (its checks, and its flags to rebuild argv)."""
    dedicated = args.server == "dedicated"
    np = args.np
    try:
        if np is None:
            raise ConfigError("--max-restarts needs --np N (the workers of the first start)")
        if args.hostfile:
            raise ConfigError("--max-restarts takes its hosts from -H HOST:SLOTS,.. (or this "
                              "host), not --hostfile")
        if args.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {args.max_restarts}")
        if not args.checkpoint_every or not args.out:
            raise ConfigError("--max-restarts needs --checkpoint-every K and --out DIR (a "
                              "restart resumes from the newest checkpoint in DIR)")
        cluster_state = _cluster(args) if args.cluster is not None else None
        min_np, max_np = args.min_np or 1, args.max_np or np
        if not 1 <= min_np <= np <= max_np:
            raise ConfigError(f"need 1 <= --min-np ({min_np}) <= --np ({np}) <= --max-np "
                              f"({max_np})")
        validate(args, np)
    except ConfigError as e:
        print(f"mpsync train: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parser = argparse.ArgumentParser()
    add_arguments(parser)

    if cluster_state is not None:
        hosts = _cluster_hosts(cluster_state, np, dedicated)
    elif args.hosts:
        hosts = parse_hosts(args.hosts)
    else:
        hosts = _allocation_workers(dedicated) or [Host(LOCAL, np)]
    mpirun_args = shlex.split(args.mpirun_args or "")

    def run(attempt: Attempt):
        drop = _SUPERVISOR_FLAGS + (("kill_at_step",) if attempt.index else ())
        rest = argv_from_namespace(parser, args, drop=drop)
        resume = args.resume if attempt.index == 0 else restart_point(out, attempt.index)
        if resume:
            rest += ["--resume", str(resume)]
            if attempt.index:
                attempt.extra["resumed_from"] = _describe_checkpoint(resume)
        command = python_argv("mpsync.apps.train", *rest, "--np", str(attempt.np))
        if cluster_state is not None:
            end = run_watched(_cluster_job(cluster_state, command, attempt, dedicated,
                                           mpirun_args))
            # Open MPI names a node by the address in the hostfile; the hosts go by name.
            names = {n.address: n.name for n in cluster_state.nodes}
            if end.failure is not None and end.failure.host in names:
                end.failure = replace(end.failure, host=names[end.failure.host])
            return end
        # The same launcher as `mpsync train --np N`: placement, environment, failure report.
        job = build_job(python_argv("mpsync.apps.train", *rest, "--np", str(attempt.np)),
                        attempt.np, dedicated_server=dedicated,
                        hosts=hosts_text(attempt.hosts), mpirun_args=mpirun_args,
                        name="mpsync train")
        return run_watched(job)

    try:
        rc, attempts = supervise(
            run, hosts, min_np=min_np, max_np=max_np, max_restarts=args.max_restarts,
            on_end=lambda _a, all_: write_record(out / "restarts.json", all_))
    except SupervisorError as e:
        print(f"mpsync train: error: {e}", file=sys.stderr)
        return 1
    if rc == 0 and len(attempts) > 1:
        _add_to_metrics(out / "metrics.json", attempts)
        if not args.no_plots:   # again, with the restarts marked
            from mpsync.apps.report import plot_run

            plot_run(out)
    return rc


def _allocation_workers(dedicated: bool) -> list[Host] | None:
    """Inside Slurm/PBS: the allocation's hosts, as worker slots (the dedicated server's task
    is the first host's first, as the launcher places it), so that a restart leaves a lost
    node out.  None outside an allocation or with one host (the launcher's own placement)."""
    hosts = allocation_hosts()
    if not hosts or len(hosts) < 2:
        return None
    if dedicated:
        hosts[0] = Host(hosts[0].name, hosts[0].slots - 1)
    return [h for h in hosts if h.slots > 0]


def _cluster(args):
    from mpsync import cluster as vc

    state = vc.load_state(args.cluster or None)
    if state is None:
        raise ConfigError(f"cluster {args.cluster or vc.default_name()!r} is not up (mpsync "
                          f"cluster up --nodes N)")
    return state


def _cluster_hosts(state, np: int, dedicated: bool) -> list[Host]:
    """The worker nodes of the virtual cluster (node1 is the dedicated server's, as in
    ``--cluster-placement server-alone``), each with the slots that spread ``np`` workers
    evenly: losing a node loses its workers."""
    nodes = state.nodes[1:] if dedicated and len(state.nodes) > 1 else state.nodes
    per = -(-np // len(nodes))
    return [Host(n.name, per) for n in nodes]


def _cluster_job(state, command: list[str], attempt: Attempt, dedicated: bool, mpirun_args):
    """A job on the cluster's nodes that remain: the server's rank on node1, the workers
    round-robin over ``attempt.hosts`` (a sequential hostfile), Open MPI set up as for
    ``mpsync train --cluster``."""
    from mpsync import transport
    from mpsync.cluster.layout import hostfile_text, mpirun_options
    from mpsync.launch.hosts import Placement
    from mpsync.launch.mpirun import forwarded_env, mpirun_argv
    from mpsync.launch.runner import Job, mpsync_roles

    address = {n.name: n.address for n in state.nodes}
    slots = [h["name"] for h in attempt.hosts for _ in range(h["slots"])]
    order = sorted(range(len(slots)), key=lambda i: (slots[:i].count(slots[i]), i))
    workers = [address[slots[i]] for i in order][:attempt.np]
    ranks = ([state.nodes[0].address] if dedicated else []) + workers
    path = Path(state.state_dir) / f"hostfile-restart-{os.getpid()}-{attempt.index}"
    path.write_text(hostfile_text(state, ranks))
    extra = mpirun_options(state, hostfile=str(path), sequential=True, standalone=False,
                           transport=transport.mca_argv(None)) + list(mpirun_args)
    argv = mpirun_argv(len(ranks), command, forward_env=forwarded_env(), extra=extra)
    names = {v: k for k, v in address.items()}
    where = Placement(len(ranks), tuple((names[a], 1) for a in ranks), False,
                      f"on cluster {state.name}: {', '.join(names[a] for a in ranks)}")
    return Job(argv, where, mpsync_roles(dedicated), "mpsync train")


def _keep_newest(out: Path, index: int) -> Path | None:
    """A directory holding the newest good checkpoint (hard-linked under OUT/restarts/, so
    that pruning by the resumed run never removes what a restart started from); None when
    there is none (start from the beginning).  Checked without loading it (the ranks load
    and check it again): the supervisor never imports torch, which on a restart would be a
    second or more on the job's clock, on cores the resumed ranks start on."""
    try:
        path, _ = latest_good(out, warn=lambda m: print(f"mpsync train: {m}", file=sys.stderr),
                              read=checkpoint_header)
    except CheckpointError:
        return None
    keep = out / "restarts" / f"restart-{index}"
    keep.mkdir(parents=True, exist_ok=True)
    link = keep / path.name
    link.unlink(missing_ok=True)
    try:
        os.link(path, link)
    except OSError:
        shutil.copy2(path, link)
    return keep


def restart_point(out: Path, index: int) -> Path | None:
    """Where restart ``index`` starts from: the newest good checkpoint (:func:`_keep_newest`),
    or, with none written yet, the beginning; said then, in one line, since every step the
    failed jobs took is lost (the supervisor's own line says only "restart N of M")."""
    keep = _keep_newest(out, index)
    if keep is None:
        print(f"mpsync train: restart {index}: no checkpoint was written in {out} before the "
              f"failure (the first comes after --checkpoint-every rounds): starting over from "
              f"step 0; all progress so far is lost", file=sys.stderr, flush=True)
    return keep


def _describe_checkpoint(path) -> dict:
    """Where a restart resumes: the checkpoint's round, step, wall time and workers, from its
    header (loaded only when an older writer left them out of it)."""
    path, header = latest_good(path, read=checkpoint_header)
    if not all(k in header for k in HEADER_FIELDS):
        path, header = latest_good(path)
    return {"path": str(path), "round": header["round"], "step": header["step"],
            "wall_s": header["wall_s"], "workers": header["workers"]}


def restart_costs(attempts: list[dict], resumed_at_clock: float | None) -> list[dict]:
    """One entry per restart: what failed, on how many workers the job went on, the
    checkpoint it resumed from, and (for the last restart, whose run wrote the metrics) the
    seconds from the failed job's end to the resumed job's first step."""
    costs = []
    for before, after in zip(attempts, attempts[1:]):
        entry = {"after_job": before["index"], "failure": before["failure"],
                 "returncode": before["returncode"], "workers_before": before["np"],
                 "workers_after": after["np"], "detected_at": before["ended_at"],
                 "restarted_at": after["started_at"],
                 "resumed_from": after["extra"].get("resumed_from")}
        if after is attempts[-1] and resumed_at_clock is not None:
            entry["restart_s"] = resumed_at_clock - before["ended_at"]
        costs.append(entry)
    return costs


def _add_to_metrics(path: Path, attempts: list[Attempt]) -> None:
    from dataclasses import asdict

    try:
        metrics = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    records = [asdict(a) for a in attempts]
    metrics["restarts"] = restart_costs(records, metrics.get("resumed_at_clock"))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(metrics, indent=1))
    os.replace(tmp, path)
