"""Elastic runs of a user's script, as ``horovodrun --host-discovery-script``: start it, and
start it again after a lost worker or when the discovery script reports new hosts::

    python -m mpsync.launch.elastic_run --np 4 --min-np 2 --max-np 8 --max-restarts 3 \\
        --host-discovery-script ./discover.sh --commit-dir /shared/ckpt python train.py

The script uses :mod:`mpsync.torch.elastic` (``@hvd.elastic.run``, ``state.commit()``); the
launcher gives every rank the commit directory (``MPSYNC_ELASTIC_DIR``) and the hosts file its
discovery watcher rewrites (``MPSYNC_ELASTIC_HOSTS_FILE``), and restarts through
:func:`mpsync.launch.supervisor.supervise`.  Without a discovery script the hosts are ``-H``'s
(or this host); a failed host is left out of every later start, as horovodrun blacklists it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
from pathlib import Path

from mpsync.commits import ENV_COMMIT_DIR, ENV_HOSTS_FILE, ENV_HOSTS_VERSION
from mpsync.config import DEFAULTS, setting_from_env
from mpsync.launch.mpirun import clean_launch_env, forwarded_env, mpirun_argv
from mpsync.launch.supervisor import Attempt, Host, SupervisorError, discover_hosts, \
    parse_hosts, run_streaming, supervise, write_record

__all__ = ["add_elastic_arguments", "main", "HostsWatcher"]

def add_elastic_arguments(p) -> None:
    p.add_argument("--np", "-np", type=int, required=True, help="workers of the first start")
    p.add_argument("--min-np", type=int, default=None, help="fewest workers to run with")
    p.add_argument("--max-np", type=int, default=None, help="most workers to run with")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="restarts after a failure (default 3; new hosts do not count)")
    p.add_argument("-H", "--hosts", default=None, metavar="HOST:SLOTS,..",
                   help="hosts (default: this host with one slot per rank)")
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mpsync.launch.elastic_run")
    add_elastic_arguments(p)
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if not args.command:
        p.error("give the command to run, e.g. python train.py")
    min_np, max_np = args.min_np or 1, args.max_np or args.np
    if not 1 <= min_np <= args.np <= max_np:
        print(f"mpsync elastic: error: need 1 <= --min-np ({min_np}) <= --np ({args.np}) <= "
              f"--max-np ({max_np})", file=sys.stderr)
        return 2
    extra = 1 if (setting_from_env("server") or DEFAULTS.server) == "dedicated" else 0
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
            hosts = [Host("localhost", args.np + extra)]
    except SupervisorError as e:
        print(f"mpsync elastic: error: {e}", file=sys.stderr)
        return 2
    watcher = HostsWatcher(discover, commit_dir / "hosts.json", args.discovery_interval) \
        if discover else None
    local = len(hosts) == 1 and hosts[0].name == "localhost"

    def run(attempt: Attempt):
        env = dict(os.environ, **{ENV_COMMIT_DIR: str(commit_dir)})
        if watcher is not None:
            env[ENV_HOSTS_FILE] = str(watcher.path)
            env[ENV_HOSTS_VERSION] = str(watcher.started(attempt.hosts))
        ranks = attempt.np + extra
        where = [] if local else [f"{h['name']}:{h['slots']}" for h in attempt.hosts]
        argv = mpirun_argv(ranks, args.command, hosts=where, forward_env=forwarded_env(env))
        print(f"mpsync elastic: start {attempt.index}: {attempt.np} workers on "
              f"{', '.join(h['name'] for h in attempt.hosts)}", file=sys.stderr, flush=True)
        return run_streaming(argv, env=clean_launch_env(env))

    if watcher is not None:
        watcher.start()
    try:
        rc, _ = supervise(run, hosts, min_np=min_np, max_np=max_np,
                          max_restarts=args.max_restarts, extra_ranks=extra, discover=discover,
                          on_end=lambda _a, all_: write_record(commit_dir / "restarts.json",
                                                               all_))
    except SupervisorError as e:
        print(f"mpsync elastic: error: {e}", file=sys.stderr)
        return 1
    finally:
        if watcher is not None:
            watcher.stop()
    return rc


if __name__ == "__main__":
    sys.exit(main())
