"""``mpsync run --max-restarts N``: elastic runs of a user's script, as ``horovodrun
--host-discovery-script``: start it, and start it again after a lost worker or when the
discovery script reports new hosts::

    mpsync run --np 4 --min-np 2 --max-np 8 --max-restarts 3 \\
        --host-discovery-script ./discover.sh --commit-dir ckpt python train.py

The script uses :mod:`mpsync.torch.elastic` (``@hvd.elastic.run``, ``state.commit()``); each
rank gets the commit directory (``MPSYNC_ELASTIC_DIR``) and the hosts file that the discovery
watcher rewrites (``MPSYNC_ELASTIC_HOSTS_FILE``).  Every start goes through the launcher of
``mpsync run --np N`` (:func:`mpsync.launch.runner.run_job`) under
:func:`mpsync.launch.supervisor.supervise`.  Without a discovery script the hosts are ``-H``'s
(or this host); a failed host is left out of every later start, as horovodrun blacklists it.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile
import threading
from pathlib import Path

from mpsync.commits import ENV_COMMIT_DIR, ENV_HOSTS_FILE, ENV_HOSTS_VERSION
from mpsync.config import ConfigError
from mpsync.launch.runner import build_job
from mpsync.launch.supervisor import LOCAL, Attempt, Host, SupervisorError, discover_hosts, \
    hosts_text, parse_hosts, run_watched, supervise, write_record

__all__ = ["add_elastic_arguments", "wants_elastic", "run_elastic", "HostsWatcher"]

def add_elastic_arguments(p) -> None:
    """The flags of an elastic run (``mpsync run``'s; ``--np`` and ``-H`` are its own)."""
    p.add_argument("--min-np", type=int, default=None, help="fewest workers to run with")
    p.add_argument("--max-np", type=int, default=None, help="most workers to run with")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restarts after a failure (default 0: a fault ends the job; new "
                        "hosts from the discovery script do not count)")
    p.add_argument("--host-discovery-script", default=None, metavar="SCRIPT",
                   help="prints the available hosts, one host[:slots] per line; asked at "
                        "every start and every --discovery-interval seconds")
    p.add_argument("--slots-per-host", type=int, default=1,
                   help="slots of a discovered host that names none")
    p.add_argument("--discovery-interval", type=float, default=5.0, metavar="S")
    p.add_argument("--commit-dir", default=None, metavar="DIR",
                   help="where commits go (shared disk, or node-local on the first host); "
                        "default: a new directory under the system's temporary directory")


class HostsWatcher:
    """Asks the discovery script every ``interval`` seconds; when a host appears that the
    running job does not have, writes a new version to the hosts file, which the job's next
    ``state.commit()`` reads (and then ends to be restarted with it)."""

    def __init__(self, discover, path: Path, interval: float):
        self.discover, self.path, self.interval = discover, path, interval
        self.version = 0
        self.running: set = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="hosts-watcher")
        self._write([])

    def started(self, hosts) -> int:
        self.running = {h["name"] for h in hosts}
        return self.version

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                hosts = self.discover()
            except SupervisorError as e:
                print(f"mpsync elastic: {e}", file=sys.stderr, flush=True)
                continue
            if {h.name for h in hosts} - self.running:
                self.version += 1
                self._write(hosts)

    def _write(self, hosts) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": self.version,
                                   "hosts": [f"{h.name}:{h.slots}" for h in hosts]}))
        os.replace(tmp, self.path)


def wants_elastic(args) -> bool:
    return bool(args.max_restarts or args.host_discovery_script or args.min_np or args.max_np)


def run_elastic(args, command: list[str], dedicated: bool) -> int:
    """Run ``command`` elastically as ``args`` say (``mpsync run``'s parsed flags)."""
    min_np, max_np = args.min_np or 1, args.max_np or args.np
    if not 1 <= min_np <= args.np <= max_np:
        raise ConfigError(f"need 1 <= --min-np ({min_np}) <= --np ({args.np}) <= --max-np "
                          f"({max_np})")
    if args.hostfile:
        raise ConfigError("an elastic run takes its hosts from -H or "
                          "--host-discovery-script, not --hostfile")
    commit_dir = Path(args.commit_dir or tempfile.mkdtemp(prefix="mpsync-elastic-"))
    commit_dir.mkdir(parents=True, exist_ok=True)
    discover = None
    try:
        if args.host_discovery_script:
            def discover():
                return discover_hosts(args.host_discovery_script, args.slots_per_host)
            hosts = discover()
        elif args.hosts:
            hosts = parse_hosts(args.hosts)
        else:
            hosts = [Host(LOCAL, args.np)]
    except SupervisorError as e:
        raise ConfigError(str(e)) from None
    watcher = HostsWatcher(discover, commit_dir / "hosts.json", args.discovery_interval) \
        if discover else None
    mpirun_args = shlex.split(args.mpirun_args or "")

    def run(attempt: Attempt):
        os.environ[ENV_COMMIT_DIR] = str(commit_dir)
        if watcher is not None:
            os.environ[ENV_HOSTS_FILE] = str(watcher.path)
            os.environ[ENV_HOSTS_VERSION] = str(watcher.started(attempt.hosts))
        job = build_job(command, attempt.np, dedicated_server=dedicated,
                        hosts=hosts_text(attempt.hosts), mpirun_args=mpirun_args,
                        name="mpsync run")
        print(f"mpsync run: start {attempt.index}: {job.describe()}", file=sys.stderr,
              flush=True)
        return run_watched(job, timeout=args.timeout)

    if watcher is not None:
        watcher.start()
    try:
        rc, _ = supervise(run, hosts, min_np=min_np, max_np=max_np,
                          max_restarts=args.max_restarts, discover=discover,
                          on_end=lambda _a, all_: write_record(commit_dir / "restarts.json",
                                                               all_))
    except SupervisorError as e:
        print(f"mpsync run: error: {e}", file=sys.stderr)
        return 1
    finally:
        if watcher is not None:
            watcher.stop()
    return rc
