"""The ranking off the serving thread: processes of their own that the state server feeds.

``python -m mpsync.auto.helper`` reads one JSON request per line on stdin (measurements,
candidates, the run's settings, the simulator engine) and writes one JSON line per request on
stdout (the ranked candidates, and the CPU seconds the simulations took).  The server
(``serving``) writes a request and reads the answer on a thread that waits on the pipe, which
holds no GIL while it waits, so no query waits for a simulation.

No decision waits for a compiler.  The simulator's fast engines and the server rules the exact
engine drives are Numba kernels; in a fresh clone their on-disk cache is cold and compiling
them took 36 s (idle machine) to 66 s (loaded) before the first ranking could run, with the
job on BSP meanwhile.  The first helper therefore runs the exact engine with Numba's JIT off
(``NUMBA_DISABLE_JIT=1``: the same rules as plain Python, the same results): the ring's 3
candidates x 120 iterations x 4 workers take 0.03-0.05 s, 64 workers 0.8 s; the parameter
server's 5 (event loops in Python) 1.5 s at 4 workers, 4 s at 16, 68 s at 64.  Above
``PURE_UP_TO_WORKERS`` a second helper compiles the kernels from the job's start and takes over
once its first (warm-up) ranking has answered; until then the pure one answers.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

__all__ = ["Ranker", "rank_request", "main", "PURE_UP_TO_WORKERS"]

# Up to this many workers the uncompiled exact engine ranks the live candidates in seconds
# (see the module doc): no compiled helper is started at all.
PURE_UP_TO_WORKERS = 16
_COMPILE_WARM_UP = "compile-warm-up"


def rank_request(request: dict) -> dict:
    """Answer one request (in the helper process; also the in-thread fallback)."""
    from mpsync.auto.measurements import Measurements
    from mpsync.auto.ranking import Candidate, rank_candidates
    from mpsync.config import SyncConfig

    t0, cpu0 = time.perf_counter(), time.process_time()
    m = Measurements.from_dict(request["measurements"])
    candidates = [Candidate.from_dict(c) for c in request["candidates"]]
    base = SyncConfig(**request.get("base", {}))
    engine = request.get("engine", "auto")
    ranked = rank_candidates(m, candidates, base=base, engine=engine)
    return {"id": request.get("id"), "ranked": [r.as_dict() for r in ranked],
            "engine": engine, "wall_s": time.perf_counter() - t0,
            "cpu_s": time.process_time() - cpu0}


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


def _helper_env(compiled: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    env["MPI4PY_RC_INITIALIZE"] = "0"   # it simulates; it never sends a message
    if compiled:
        env.pop("NUMBA_DISABLE_JIT", None)
    else:
        env["NUMBA_DISABLE_JIT"] = "1"
    return env


class _Helper:
    """One helper process and the thread that reads its answers into ``answers``."""

    def __init__(self, compiled: bool, answers: queue.Queue, on_ready=None):
        self.engine = "auto" if compiled else "exact"
        self.answers, self.on_ready = answers, on_ready
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mpsync.auto.helper"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, bufsize=1, env=_helper_env(compiled))
        threading.Thread(target=self._read, name=f"mpsync-auto-{self.engine}", daemon=True
                         ).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                answer = json.loads(line)
            except ValueError:
                answer = {"error": f"unreadable answer: {line[:200]!r}"}
            if answer.get("id") == _COMPILE_WARM_UP:      # the compiled kernels are loaded
                if self.on_ready is not None:
                    self.on_ready(answer)
                continue
            self.answers.put(answer)
        if self.on_ready is None:       # only the helper that answers the server reports it
            self.answers.put({"error": "the ranking helper exited"})

    def submit(self, request: dict) -> None:
        self.proc.stdin.write(json.dumps(request | {"engine": self.engine}) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


class Ranker:
    """The server's side: ``submit`` a request, ``poll`` for its answer (None while it runs).

    The uncompiled helper answers from the start; for more than ``PURE_UP_TO_WORKERS``
    workers a compiled one warms up beside it and answers once ready (``mode`` says which
    answers now).  Where no process can be started (``mode`` "thread") the ranking runs on a
    thread of the server's process, whose GIL it shares with the serving loop."""

    def __init__(self, workers: int = 4, warm_up_request: dict | None = None):
        self.answers: queue.Queue = queue.Queue()
        self.pure = self.compiled = None
        self.compiled_ready = False
        self.compile_s: float | None = None
        self._started = time.perf_counter()
        try:
            self.pure = _Helper(False, self.answers)
            if workers > PURE_UP_TO_WORKERS and warm_up_request is not None:
                self.compiled = _Helper(True, self.answers, on_ready=self._compiled_ready)
                self.compiled.submit(warm_up_request | {"id": _COMPILE_WARM_UP})
        except OSError:
            self.close()
            self.pure = self.compiled = None

    def _compiled_ready(self, answer: dict) -> None:
        if "error" not in answer:
            self.compile_s = time.perf_counter() - self._started
            self.compiled_ready = True

    @property
    def mode(self) -> str:
        if self.compiled_ready and self.compiled is not None:
            return "process (compiled engines)"
        if self.pure is not None:
            return "process (exact engine, uncompiled)"
        return "thread"

    def submit(self, request: dict) -> None:
        helper = self.compiled if self.compiled_ready and self.compiled else self.pure
        if helper is not None:
            try:
                helper.submit(request)
                return
            except (OSError, ValueError):
                self.close()
                self.pure = self.compiled = None

        def run():
            try:
                self.answers.put(rank_request(request | {"engine": "exact"}))
            except Exception as e:
                self.answers.put({"error": f"{type(e).__name__}: {e}"})

        threading.Thread(target=run, name="mpsync-auto-ranking", daemon=True).start()

    def poll(self) -> dict | None:
        try:
            return self.answers.get_nowait()
        except queue.Empty:
            return None

    def close(self) -> None:
        for name in ("pure", "compiled"):
            helper = getattr(self, name)
            setattr(self, name, None)
            if helper is not None:
                helper.close()


if __name__ == "__main__":
    sys.exit(main())
