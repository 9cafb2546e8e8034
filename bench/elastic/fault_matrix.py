"""The fault matrix on the virtual cluster: inject one fault into ``mpsync train --cluster
--max-restarts 1`` and time what follows.

    mpsync cluster --name el up --nodes 5 --bandwidth 1gbit
    python bench/elastic/fault_matrix.py --cluster el --cells bsp:kill,ssp:stop,esync:link
    python bench/elastic/fault_matrix.py --cluster el --manual bsp    # a restart by hand
    python bench/elastic/fault_matrix.py --calm 10     # stragglers, no fault: no suspicion
    python bench/elastic/fault_matrix.py --cluster el --grow  # a host added to hvd.elastic

Faults (world rank 0 is the state server on node1; worker k is world rank k+1 on node k+2):

* ``kill``: SIGKILL worker 1;  ``stop``: SIGSTOP worker 1 (found by its missing heartbeats);
* ``link``: cut node3's cable at the switch (worker 1's node);
* ``server``: SIGKILL the state server's rank;
* ``shard``: SIGKILL worker 0, which hosts PS shard 0 (PS policies; one shard per node).

Each cell waits for a checkpoint at round >= ``--after-round``, then 2 s more, injects the
fault at ``t_fault`` and records: ``detect_s`` (t_fault to the supervisor's "job 0 failed"
line), ``named_s`` (to the first line that names the fault), ``resume_s`` (t_fault to the
resumed job's first step, ``resumed_at_clock`` in metrics.json), ``lost_s`` (t_fault minus
the time the checkpoint resumed from was written: training thrown away) and its round, and
whether the run reached ``--target-acc``.  ``--manual POLICY`` times a restart by hand:
``mpsync train --cluster --resume`` of a finished run's checkpoint on the same workers, from
launch to its first step.  One JSON line per cell is appended to ``--json`` (default
bench/elastic/fault_matrix.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FAULT_RANK = {"kill": 2, "stop": 2, "server": 0, "shard": 1}
# The first line that names the fault: the state server's suspicion, a worker's fault line,
# Open MPI's notice of a killed rank.
_NAMED = re.compile(r"silent for more than|mpsync: fault|noticed that process rank|"
                    r"MPI_ABORT was invoked|job failed")


def _pid_of_rank(tag: str, rank: int) -> int | None:
    want = {f"MPSYNC_FAULT_TAG={tag}".encode(), f"OMPI_COMM_WORLD_RANK={rank}".encode()}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if want <= set((d / "environ").read_bytes().split(b"\0")):
                    return int(d.name)
            except OSError:
                continue
    return None


def _train_argv(a, policy: str, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "mpsync.cli", "train", "--cluster", a.cluster, "--policy",
            policy, "--np", str(a.np), "--model", a.model, "--epochs", str(a.epochs),
            "--target-acc", str(a.target_acc), "--checkpoint-every", str(a.checkpoint_every),
            "--deadline", str(a.deadline), "--out", str(out), "--no-progress", "--no-plots",
            "--eval-every", "1", *extra]


def _env(tag: str) -> dict:
    env = dict(os.environ, MPSYNC_FAULT_TAG=tag, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def _newest_ckpt(out: Path):
    ckpts = sorted((out / "checkpoints").glob("ckpt-*.mpsck"))
    return (int(ckpts[-1].name[5:14]), ckpts[-1]) if ckpts else (-1, None)


def _inject(a, fault: str, tag: str) -> None:
    if fault == "link":
        subprocess.run([sys.executable, "-m", "mpsync.cli", "cluster", "--name", a.cluster,
                        "link", "--down", "node3"], check=True, env=_env(tag))
        return
    pid = _pid_of_rank(tag, FAULT_RANK[fault])
    if pid is None:
        raise RuntimeError(f"world rank {FAULT_RANK[fault]} not found")
    os.kill(pid, signal.SIGSTOP if fault == "stop" else signal.SIGKILL)


def cell(a, policy: str, fault: str) -> dict:
    out = Path(a.out) / f"{policy}-{fault}"
    subprocess.run(["rm", "-rf", str(out)])
    tag = uuid.uuid4().hex
    lines: list[tuple[float, str]] = []
    proc = subprocess.Popen(_train_argv(a, policy, out, "--max-restarts", "1", "--min-np",
                                        "2"), env=_env(tag), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    reader = threading.Thread(target=lambda: [lines.append((time.time(), ln))
                                              for ln in proc.stdout], daemon=True)
    reader.start()
    try:
        t_start = time.time()
        while _newest_ckpt(out)[0] < a.after_round:
            if proc.poll() is not None or time.time() - t_start > a.timeout / 2:
                raise RuntimeError(f"{policy}-{fault}: no checkpoint at round "
                                   f"{a.after_round}: " + "".join(ln for _, ln in lines[-30:]))
            time.sleep(0.1)
        time.sleep(2.0)
        t_fault = time.time()
        _inject(a, fault, tag)
        rc = proc.wait(timeout=a.timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if fault == "link":
            subprocess.run([sys.executable, "-m", "mpsync.cli", "cluster", "--name", a.cluster,
                            "link", "--up", "node3"], env=_env(tag))
            time.sleep(3.0)   # the next cell's first launch on node3 failed right after this
    reader.join(5)
    text = "".join(ln for _, ln in lines)
    (out / "launcher.log").write_text(
        "".join(f"{t - t_fault:+9.3f} {ln}" for t, ln in lines))
    detected = next((t for t, ln in lines if "job 0 failed" in ln), None)
    named = next((t for t, ln in lines if t >= t_fault and _NAMED.search(ln)), None)
    row = {"policy": policy, "fault": fault, "rc": rc, "deadline_s": a.deadline,
           "detect_s": None if detected is None else detected - t_fault,
           "named_s": None if named is None else named - t_fault}
    try:
        m = json.loads((out / "metrics.json").read_text())
    except (OSError, ValueError):
        row["tail"] = text[-3000:]
        return row
    restarts = m.get("restarts") or []
    if restarts:
        r = restarts[-1]
        ckpt = r.get("resumed_from") or {}
        row.update(failure=r["failure"], workers=[r["workers_before"], r["workers_after"]],
                   resumed_round=ckpt.get("round"),
                   resume_s=(m["resumed_at_clock"] - t_fault) if m.get("resumed_at_clock")
                   else None, restart_s=r.get("restart_s"))
        row["restart_parts"] = restart_parts(r, m.get("startup_clock") or {})
        path = ckpt.get("path")
        if path and os.path.exists(path):
            row["lost_s"] = t_fault - os.stat(path).st_mtime
    row.update(final_acc=m.get("final_acc"), reached_target=m.get("time_to_target_s")
               is not None, wall_s=m.get("wall_s"))
    return row


_PARTS = ("process", "main", "checkpoint_read", "torch_imported", "data_and_model", "init",
          "ready")


def restart_parts(restart: dict, clock: dict) -> dict:
    """Seconds of each part of a restart, from the failed job's end (the supervisor's
    ``detected_at``): ``supervisor`` (to its relaunch), ``launch`` (mpirun, the remote
    daemons, the resumed worker 0's exec), then worker 0's start-up part by part (its
    ``startup_clock`` in metrics.json, mpsync.apps.trainer)."""
    if not clock or "detected_at" not in restart:
        return {}
    parts, prev = {}, restart["detected_at"]
    stamps = [("supervisor", restart.get("restarted_at"))] + \
        [("launch" if k == "process" else k, clock.get(k)) for k in _PARTS]
    for name, at in stamps:
        if at is not None:
            parts[name] = round(at - prev, 3)
            prev = at
    return parts


def manual(a, policy: str) -> dict:
    """A restart by hand: resume a finished cell's checkpoint on np-1 workers."""
    src = Path(a.out) / f"{policy}-kill" / "restarts" / "restart-1"
    out = Path(a.out) / f"{policy}-manual"
    subprocess.run(["rm", "-rf", str(out)])
    argv = _train_argv(a, policy, out, "--resume", str(src))
    argv[argv.index("--np") + 1] = str(a.np - 1)
    t0 = time.time()
    done = subprocess.run(argv, env=_env(uuid.uuid4().hex), capture_output=True, text=True,
                          timeout=a.timeout)
    m = json.loads((out / "metrics.json").read_text()) if done.returncode == 0 else {}
    return {"policy": policy, "fault": "manual", "rc": done.returncode,
            "resume_s": (m["resumed_at_clock"] - t0) if m.get("resumed_at_clock") else None,
            "final_acc": m.get("final_acc"),
            "reached_target": m.get("time_to_target_s") is not None}


def grow(a, policy: str = "bsp") -> dict:
    """A host added by the discovery script to a running ``hvd.elastic`` job on real ranks:
    ``examples/train_digits_elastic.py`` under ``mpsync run --host-discovery-script`` on the
    virtual cluster, 2 workers (the state server's rank beside worker 0 on node1, worker 1 on
    node2); ``--grow-after`` seconds in, node3 is added to the script's answer.  Records
    ``detect_s`` (the host's appearance to the supervisor's "asked for a restart" line),
    ``resume_s`` (to the resumed job's worker 0 loading the newest commit, just before its
    first step), the workers before and after, and the test accuracy the script prints at
    its end."""
    out = Path(a.out) / f"grow-{policy}"
    subprocess.run(["rm", "-rf", str(out)])
    out.mkdir(parents=True)
    hosts_file, script, commits = out / "hosts", out / "discover.sh", out / "commits"
    addrs = [h.split(":")[0] for h in subprocess.run(
        [sys.executable, "-m", "mpsync.cli", "cluster", "--name", a.cluster, "hosts"],
        capture_output=True, text=True, check=True).stdout.strip().split(",")]
    base, added = [f"{addrs[0]}:1", f"{addrs[1]}:1"], f"{addrs[2]}:1"
    hosts_file.write_text("\n".join(base) + "\n")
    script.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    script.chmod(0o755)
    env = _env(uuid.uuid4().hex)
    for line in subprocess.run([sys.executable, "-m", "mpsync.cli", "cluster", "--name",
                                a.cluster, "env"], capture_output=True, text=True,
                               check=True).stdout.splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value
    argv = [sys.executable, "-m", "mpsync.cli", "run", "--np", "2", "--min-np", "2",
            "--max-np", "3", "--host-discovery-script", str(script), "--discovery-interval",
            "1", "--commit-dir", str(commits), sys.executable,
            str(REPO / "examples" / "train_digits_elastic.py"), "--epochs", str(a.grow_epochs),
            "--batches-per-commit", "5"]
    lines: list[tuple[float, str]] = []
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, cwd=str(out))
    reader = threading.Thread(target=lambda: [lines.append((time.time(), ln))
                                              for ln in proc.stdout], daemon=True)
    reader.start()
    try:
        time.sleep(a.grow_after)
        if proc.poll() is not None:
            raise RuntimeError("the job ended before the host was added: "
                               + "".join(ln for _, ln in lines[-30:]))
        t_add = time.time()
        hosts_file.write_text("\n".join([*base, added]) + "\n")
        rc = proc.wait(timeout=a.timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(5)
    (out / "launcher.log").write_text("".join(f"{t - t_add:+9.3f} {ln}" for t, ln in lines))
    asked = next((t for t, ln in lines if "asked for a restart" in ln), None)
    resumed = next((t for t, ln in lines if t > t_add and "resuming from commit" in ln), None)
    acc = [re.search(r"elastic, (\d+) workers: test accuracy ([\d.]+)", ln) for _, ln in lines]
    acc = [m for m in acc if m]
    return {"policy": policy, "fault": "host added", "rc": rc,
            "detect_s": None if asked is None else asked - t_add,
            "resume_s": None if resumed is None else resumed - t_add,
            "workers": [2, int(acc[-1].group(1)) if acc else None],
            "final_acc": float(acc[-1].group(2)) if acc else None,
            "reached_target": bool(acc) and float(acc[-1].group(2)) >= a.target_acc,
            "tail": None if acc else "".join(ln for _, ln in lines[-30:])}


CALM_POLICIES = ("bsp", "ssp", "esync", "ebsp", "asp")


def calm(a, i: int) -> dict:
    """Slow is not dead: the 1,1,2,4 straggler job (150 ms iterations at factor 1, so 600 ms
    on worker 3), worker 0 evaluating every second and a checkpoint every 5 rounds, no fault,
    on this host.  Records whether anyone was suspected or taken out, and each worker's longest
    gap between two beats (the suspicion bound is at least 3 s)."""
    policy = CALM_POLICIES[i % len(CALM_POLICIES)]
    out = Path(a.out) / f"calm-{i}-{policy}"
    subprocess.run(["rm", "-rf", str(out)])
    argv = [sys.executable, "-m", "mpsync.cli", "train", "--np", "4", "--policy", policy,
            "--slowdown", "1,1,2,4", "--iter-time", "0.15", "--time-budget", str(a.calm_budget),
            "--eval-every", "1", "--checkpoint-every", "5", "--out", str(out),
            "--no-progress", "--no-plots"]
    done = subprocess.run(argv, env=_env(uuid.uuid4().hex), capture_output=True, text=True,
                          timeout=a.timeout)
    text = done.stdout + done.stderr
    row = {"policy": policy, "fault": "none (1,1,2,4 stragglers)", "rc": done.returncode,
           "suspected": "silent for more than" in text}
    try:
        m = json.loads((out / "metrics.json").read_text())
    except (OSError, ValueError):
        row["tail"] = text[-3000:]
        return row
    workers = m["server"]["workers"]
    row.update(removed=[w for w, s in workers.items() if s.get("removed")],
               beat_gap_max_s={w: s.get("beat_gap_max_s") for w, s in workers.items()},
               evals=len(m.get("evals") or []), wall_s=m.get("wall_s"),
               checkpoints=len(list((out / "checkpoints").glob("ckpt-*.mpsck"))))
    return row


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cluster", default="el")
    p.add_argument("--cells", default="")
    p.add_argument("--manual", default="")
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--model", default="wide-mlp")
    p.add_argument("--epochs", type=float, default=4)
    p.add_argument("--target-acc", type=float, default=0.85)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--after-round", type=int, default=10)
    p.add_argument("--deadline", type=float, default=30)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--grow", action="store_true",
                   help="a host added by the discovery script to a running hvd.elastic job")
    p.add_argument("--grow-after", type=float, default=10)
    p.add_argument("--grow-epochs", type=int, default=150)
    p.add_argument("--calm", type=int, default=0,
                   help="runs of the straggler job without a fault (no one may be suspected)")
    p.add_argument("--calm-budget", type=float, default=20)
    p.add_argument("--out", default="/tmp/mpsync-fault-matrix")
    p.add_argument("--json", default=str(Path(__file__).with_name("fault_matrix.jsonl")))
    a = p.parse_args()
    jobs = [("cell", *c.split(":")) for c in a.cells.split(",") if c] + \
           [("manual", m) for m in a.manual.split(",") if m] + \
           [("calm", i) for i in range(a.calm)] + ([("grow",)] if a.grow else [])
    for kind, *what in jobs:
        try:
            row = {"cell": cell, "manual": manual, "calm": calm, "grow": grow}[kind](a, *what)
        except Exception as e:  # noqa: BLE001 - one cell's failure is a row, not the end
            row = {"kind": kind, "what": what, "error": str(e)[-2000:]}
        row["at"] = time.strftime("%Y-%m-%d %H:%M:%S")
        print(json.dumps(row), flush=True)
        with open(a.json, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
