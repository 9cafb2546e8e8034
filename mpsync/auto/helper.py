"""The ranking off the serving thread: a process of its own that the state server feeds.

``python -m mpsync.auto.helper`` reads one JSON request per line on stdin (measurements,
candidates, the run's settings) and writes one JSON line per request on stdout (the ranked
candidates, and the CPU seconds the simulations took).  The server (``serving``) writes a
request and reads the answer on a thread that waits on the pipe, which holds no GIL while it
waits, so no query waits for a simulation; the first request, sent at start-up, loads the
simulator's compiled kernels before the first real decision needs them.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

__all__ = ["Ranker", "rank_request", "main"]


def rank_request(request: dict) -> dict:
    """Answer one request (in the helper process; also the in-thread fallback)."""
    from mpsync.auto.measurements import Measurements
    from mpsync.auto.ranking import Candidate, rank_candidates
    from mpsync.config import SyncConfig

    t0, cpu0 = time.perf_counter(), time.process_time()
    m = Measurements.from_dict(request["measurements"])
    candidates = [Candidate.from_dict(c) for c in request["candidates"]]
    base = SyncConfig(**request.get("base", {}))
    ranked = rank_candidates(m, candidates, base=base)
    return {"id": request.get("id"), "ranked": [r.as_dict() for r in ranked],
            "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0}


def main() -> int:
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            answer = rank_request(json.loads(line))
        except Exception as e:  # an answer, never a dead helper: the server logs it
            answer = {"error": f"{type(e).__name__}: {e}"}
        try:
            sys.stdout.write(json.dumps(answer) + "\n")
            sys.stdout.flush()
        except BrokenPipeError:   # the server has ended: nobody is left to answer
            return 0
    return 0


# The MPI launcher's variables: a child that kept them would join the job's MPI universe when
# mpi4py is imported (the server modules the simulator drives import it) and fail there.
_LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "OPAL_", "ORTE_", "PMI_", "HYDRA_", "MPIR_")


def _helper_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    env["MPI4PY_RC_INITIALIZE"] = "0"   # it simulates; it never sends a message
    return env


class Ranker:
    """The server's side: ``submit`` a request, ``poll`` for its answer (None while it runs).

    A helper process where one can be started; otherwise (``mode`` "thread") the ranking runs
    on a thread of the server's process, whose GIL it shares with the serving loop."""

    def __init__(self):
        self.answers: queue.Queue = queue.Queue()
        self.mode = "process"
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mpsync.auto.helper"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True, bufsize=1, env=_helper_env())
        except OSError:
            self.proc, self.mode = None, "thread"
            return
        threading.Thread(target=self._read, name="mpsync-auto-ranker", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.answers.put(json.loads(line))
            except ValueError:
                self.answers.put({"error": f"unreadable answer: {line[:200]!r}"})
        self.answers.put({"error": "the ranking helper exited"})

    def submit(self, request: dict) -> None:
        if self.proc is not None:
            try:
                self.proc.stdin.write(json.dumps(request) + "\n")
                self.proc.stdin.flush()
                return
            except (OSError, ValueError):
                self.proc, self.mode = None, "thread"

        def run():
            try:
                self.answers.put(rank_request(request))
            except Exception as e:
                self.answers.put({"error": f"{type(e).__name__}: {e}"})

        threading.Thread(target=run, name="mpsync-auto-ranking", daemon=True).start()

    def poll(self) -> dict | None:
        try:
            return self.answers.get_nowait()
        except queue.Empty:
            return None

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()
            proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
