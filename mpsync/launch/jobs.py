"""``mpsync jobs``: the job scripts of the launch targets that have them (Slurm, PBS,
horovodrun; see :mod:`mpsync.launch.registry`), rendered for your settings.

    mpsync jobs list
    mpsync jobs render --scheduler slurm --nodes 2 --tasks-per-node 8 --policy esync > my.sbatch
    mpsync jobs sync [--check]     # (re)write jobs/ from the defaults; --check only compares

``render`` is a pure function of (scheduler, template, JobSettings): no environment, no clock,
no file system.  The files under ``jobs/`` are exactly what it renders for the default settings,
and a test keeps the two identical, so a user can copy a file from ``jobs/`` or render one and
get the same script.

Every script has the same three parts, the first two and the launch lines from its target's
module, the rest from :mod:`mpsync.launch._text`:

1. a scheduler header (``#SBATCH`` / ``#PBS`` lines; nothing for horovodrun) and a comment
   listing its ``${VAR:-default}`` settings;
2. a prologue that reads where it runs from the scheduler: job id, the directory of the job's
   log (the run folder goes beside it), the repository (for the default ``VENV``), the number
   of tasks and the hostfile;
3. a scheduler-neutral payload that checks the settings, builds the command as a bash array
   (never one formatted string) and starts it: ``mpirun`` over all the job's tasks for
   ``train`` (with a dedicated server, rank 0 serves and the rest train), ``horovodrun --mpi``
   for the horovodrun form, one process for ``compare`` (which starts its own ``mpirun`` per
   policy inside the allocation) and for the kernel benchmarks.

Settings given to ``render`` become the defaults after ``:-``; environment variables still
override them at submission time (``POLICY=esync sbatch train.sbatch``).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

from mpsync import policies as registry
from mpsync.config import ConfigError, SyncConfig, parse_float_list, print_user_error
from mpsync.launch import registry as targets
from mpsync.launch._text import PAYLOAD, RUN, doc, header, settings_block, variables
from mpsync.launch.settings import JobSettings, JobTemplateError
from mpsync.launch.supervisor import JOB_RESTARTS
from mpsync.launch.target import LaunchTarget

__all__ = ["JobSettings", "JobTemplateError", "schedulers", "render", "default_path",
           "sync_jobs_dir", "add_arguments", "main", "running_venv"]


def schedulers() -> tuple[str, ...]:
    """The launch targets that write job scripts, in registration order."""
    return tuple(t.name for t in targets.targets() if t.templates)


# Characters that would end or expand a ``${VAR:-default}`` word or a directive.
_UNSAFE = re.compile(r"[$`\\\"'}\n\r]")
_TIME = re.compile(r"^(\d+-)?\d{1,3}:\d{2}:\d{2}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def default_path(scheduler: str, template: str) -> str:
    """Path of the default script under ``jobs/``, e.g. ``slurm/train.sbatch``."""
    return _target(scheduler, template).templates[template]


def render(scheduler: str, template: str = "train", settings: JobSettings | None = None,
           script: str | None = None) -> str:
    """The job script of launch target ``scheduler`` for ``template`` with ``settings``; pure.
    ``script``: the name its usage comment gives it (None: its path under ``jobs/``)."""
    target = _target(scheduler, template)
    s = _validated((settings or JobSettings()).resolved(template), target, template)
    settings_vars = variables(target, template, s)
    parts = [
        header(target, template, s) + "\n" + doc(target, template, s, settings_vars, script),
        target.prologue.format(ranks=s.nodes * s.tasks_per_node),
        settings_block(settings_vars),
        PAYLOAD[template],
    ]
    if template == "train":
        parts.append(target.launch_text)
        if target.allocated:
            parts.append(JOB_RESTARTS)
        parts.append(RUN)
    return "\n\n".join(p.strip("\n") for p in parts) + "\n"


def sync_jobs_dir(jobs_dir: str | Path, *, check: bool = False) -> list[str]:
    """Write every default script under ``jobs_dir``; return the paths that differed.

    With ``check`` nothing is written (a CI check that jobs/ matches the renderer).
    """
    changed = []
    for (scheduler, template), rel in targets.templates().items():
        path = Path(jobs_dir) / rel
        text = render(scheduler, template)
        if not path.exists() or path.read_text() != text:
            changed.append(str(path))
            if not check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
        if not check:
            path.chmod(0o755)
    return changed


def running_venv() -> str | None:
    """The virtual environment this mpsync runs from (its absolute path), or None: the default
    VENV of a rendered script, so that it runs wherever it is saved."""
    prefix = Path(sys.prefix).resolve()
    if sys.prefix == sys.base_prefix or not (prefix / "bin" / "python").exists():
        return None
    return str(prefix)


# -- validation ------------------------------------------------------------------------------

def _target(scheduler: str, template: str) -> LaunchTarget:
    if scheduler not in schedulers():
        raise JobTemplateError(f"unknown scheduler {scheduler!r}; choose one of: "
                               f"{', '.join(schedulers())}")
    target = targets.get(scheduler)
    if template not in target.templates:
        raise JobTemplateError(f"no {template!r} template for {scheduler}; {scheduler} has: "
                               f"{', '.join(sorted(target.templates))}")
    return target


def _validated(s: JobSettings, target: LaunchTarget, template: str) -> JobSettings:
    for name in ("nodes", "tasks_per_node", "cpus_per_task", "epochs"):
        value = getattr(s, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise JobTemplateError(f"{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
    if isinstance(s.gpus_per_node, bool) or not isinstance(s.gpus_per_node, int) or s.gpus_per_node < 0:
        raise JobTemplateError(f"gpus-per-node must be an integer >= 0, got {s.gpus_per_node!r}")
    if not _TIME.match(s.time):
        raise JobTemplateError(f"time must look like HH:MM:SS or D-HH:MM:SS, got {s.time!r}")
    if not _NAME.match(s.job_name):
        raise JobTemplateError(f"job-name must be letters, digits, '.', '_' or '-', got {s.job_name!r}")
    for name in ("partition", "account", "hosts", "dataset", "slowdown", "target_acc", "policies",
                 "venv", "out_dir"):
        value = getattr(s, name)
        if _UNSAFE.search(value):
            raise JobTemplateError(f"{name.replace('_', '-')} must not contain quotes, '$', '`', "
                                   f"'\\', '}}' or newlines, got {value!r}")
    for name in ("partition", "account", "hosts"):
        if " " in getattr(s, name):
            raise JobTemplateError(f"{name} must not contain spaces, got {getattr(s, name)!r}")
    try:
        SyncConfig(policy=s.policy, topology=s.topology, backend=s.backend,
                   server=s.server).validate()
        if s.slowdown:
            parse_float_list("slowdown", s.slowdown)
        for p in s.policies.split(","):
            if p not in registry.names():
                raise ConfigError(f"policies: unknown policy {p!r}; choose from: "
                                  f"{', '.join(registry.names())}")
            if template == "compare" and s.topology:  # one topology for every compared policy
                SyncConfig(policy=p, topology=s.topology).validate()
    except ConfigError as e:
        raise JobTemplateError(str(e)) from None
    if s.target_acc:
        try:
            ok = 0.0 < float(s.target_acc) <= 1.0
        except ValueError:
            ok = False
        if not ok:
            raise JobTemplateError(f"target-acc must be a number in (0, 1], got {s.target_acc!r}")
    ranks = s.nodes * s.tasks_per_node
    if template in ("train", "compare") and s.server == "dedicated" and ranks < 2:
        raise JobTemplateError(f"a dedicated server needs at least 2 ranks (server + 1 worker); "
                               f"nodes x tasks-per-node = {ranks}")
    workers = ranks - (1 if s.server == "dedicated" else 0)
    if template in ("train", "compare") and s.slowdown and \
            len(parse_float_list("slowdown", s.slowdown)) != workers:
        raise JobTemplateError(
            f"slowdown {s.slowdown}: {len(s.slowdown.split(','))} factors for the job's "
            f"{workers} workers (nodes x tasks-per-node = {ranks}"
            f"{', one of them the server' if s.server == 'dedicated' else ''}); give one "
            f"factor per worker")
    target.check(template, s)
    return s


# -- command line ------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="jobs_command", metavar="ACTION", required=True)
    sub.add_parser("list", help="the available scheduler/template pairs")
    r = sub.add_parser("render", help="print a job script for your settings")
    r.add_argument("--scheduler", required=True, choices=schedulers(),
                   help="the launch target whose script to write")
    r.add_argument("--template", default="train", help="train | compare | bench-kernels (default train)")
    r.add_argument("-o", "--output", help="write to this file (executable) instead of stdout")
    d = JobSettings()
    alloc = r.add_argument_group("allocation")
    alloc.add_argument("--nodes", type=int, default=d.nodes)
    alloc.add_argument("--tasks-per-node", type=int, default=None,
                       help="MPI ranks per node (default: 5 for train/compare = 4 workers + "
                            "server; 1 for bench-kernels)")
    alloc.add_argument("--cpus-per-task", type=int, default=d.cpus_per_task)
    alloc.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node)
    alloc.add_argument("--time", default=None, help="wall time [D-]HH:MM:SS")
    alloc.add_argument("--job-name", default=None)
    alloc.add_argument("--partition", default="", help="Slurm partition / PBS queue")
    alloc.add_argument("--account", default="")
    alloc.add_argument("--hosts", default="", help="horovodrun: host1:K,host2:K")
    run = r.add_argument_group("run (defaults of the script's settings)")
    run.add_argument("--policy", default=d.policy)
    run.add_argument("--topology", default=d.topology)
    run.add_argument("--backend", default=d.backend)
    run.add_argument("--server", default=d.server)
    run.add_argument("--epochs", type=int, default=d.epochs)
    run.add_argument("--dataset", default=d.dataset)
    run.add_argument("--slowdown", default=d.slowdown)
    run.add_argument("--target-acc", default=d.target_acc)
    run.add_argument("--policies", default=d.policies, help="compare: policies to run")
    run.add_argument("--venv", default=d.venv,
                     help="the environment with mpsync (default: the one running this "
                          "command, so the script runs wherever it is saved)")
    run.add_argument("--out-dir", default=d.out_dir, help="default: beside the job's log")
    s = sub.add_parser("sync", help="rewrite jobs/ from the defaults (maintainers)")
    s.add_argument("--jobs-dir", default=str(Path(__file__).resolve().parents[2] / "jobs"))
    s.add_argument("--check", action="store_true", help="only report files that differ (exit 1)")


def main(args: argparse.Namespace) -> int:
    if args.jobs_command == "list":
        for (scheduler, template), rel in targets.templates().items():
            print(f"{scheduler:<11} {template:<14} jobs/{rel}")
        return 0
    if args.jobs_command == "sync":
        changed = sync_jobs_dir(args.jobs_dir, check=args.check)
        for path in changed:
            print(("differs: " if args.check else "wrote: ") + path)
        return 1 if (args.check and changed) else 0
    fields = {f.name for f in dataclasses.fields(JobSettings)}
    settings = JobSettings(**{k: v for k, v in vars(args).items() if k in fields})
    if not settings.venv:
        venv = running_venv()
        if venv is None:
            print("mpsync jobs render: note: mpsync is not running from a virtual environment, "
                  "so the script looks for <repository>/.venv, which it finds only when kept "
                  "under jobs/ of a clone; give --venv DIR to run it from anywhere",
                  file=sys.stderr)
        else:
            settings = dataclasses.replace(settings, venv=venv)
    try:
        text = render(args.scheduler, args.template, settings,
                      script=args.output or "THIS_SCRIPT")
    except JobTemplateError as e:
        print_user_error("mpsync jobs render", e)
        return 2
    if args.output:
        out = Path(args.output)
        out.write_text(text)
        out.chmod(0o755)
    else:
        sys.stdout.write(text)
    return 0
