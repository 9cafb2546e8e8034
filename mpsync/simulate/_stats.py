"""What a simulated run measured: per-worker time split, rounds, staleness, local steps."""

from __future__ import annotations

import numpy as np

__all__ = ["Recorder", "distribution"]

_PHASES = {"compute": 0, "wait": 1, "aggregate": 2, "other": 3}


def _grow(hist: np.ndarray, top: int) -> np.ndarray:
    if top < hist.size:
        return hist
    out = np.zeros(max(2 * hist.size, top + 1), dtype=np.int64)
    out[:hist.size] = hist
    return out


def distribution(hist: np.ndarray) -> dict | None:
    """Summary of an integer histogram (``hist[v]`` = how often value v occurred)."""
    total = int(hist.sum())
    if total == 0:
        return None
    values = np.flatnonzero(hist)
    cum = np.cumsum(hist[values])

    def q(p):
        return int(values[np.searchsorted(cum, p * total - 1e-9)])

    mean = float((values * hist[values]).sum() / total)
    return {"count": total, "mean": round(mean, 4), "p50": q(0.5), "p90": q(0.9),
            "p99": q(0.99), "max": int(values[-1]),
            "hist": {str(int(v)): int(hist[v]) for v in values[:64]}}


class Recorder:
    """Per-worker time in compute / waiting for the server / aggregating / other (a replayed
    run's time its counters did not book, ``SpeedModel.pause``), on the virtual clock; a worker
    is in exactly one phase at a time, so the four add up to the simulated time.  The
    fractions are over the first three, as ``mpsync train`` computes them."""

    def __init__(self, n: int, *, ps: bool, batch_size: int):
        self.n = n
        self.ps = ps
        self.batch_size = batch_size
        self.time = np.zeros((n, 4))
        self.phase_of = np.zeros(n, dtype=np.int64)
        self.phase_since = np.zeros(n)
        self.iters = np.zeros(n, dtype=np.int64)
        self.since_round = np.zeros(n, dtype=np.int64)
        self.rounds = np.zeros(n, dtype=np.int64)
        self.collectives = 0
        self.local_hist = np.zeros(64, dtype=np.int64)
        self.stale_hist = np.zeros(64, dtype=np.int64)
        self.agg_cost_s = 0.0          # worker-seconds spent in the transfer itself
        self.messages = 0
        self.syncs = 0
        self.locals = 0
        self.total_iterations = 0
        self.aborted = 0               # ESync §4.2: iterations discarded by a READY
        self.sim_time = 0.0
        self.policy_state: dict = {}

    # -- scalar updates (event engine) ------------------------------------------------------
    def phase(self, w: int, name: str, t: float) -> None:
        p = self.phase_of[w]
        self.time[w, p] += t - self.phase_since[w]
        self.phase_of[w] = _PHASES[name]
        self.phase_since[w] = t

    def pause(self, w: int, t: float, seconds: float) -> None:
        """``w`` is busy with unbooked work from ``t`` for ``seconds``, then computes."""
        self.phase(w, "other", t)
        self.phase(w, "compute", t + seconds)

    def iteration(self, w: int, compute: float) -> None:
        self.iters[w] += 1
        self.since_round[w] += 1
        self.total_iterations += 1

    def local(self, w: int) -> None:
        self.locals += 1

    def sync(self, w: int) -> None:
        self.syncs += 1

    def message(self, count: int = 1) -> None:
        self.messages += count

    def round(self, w: int) -> None:
        s = int(self.since_round[w])
        self.local_hist = _grow(self.local_hist, s)
        self.local_hist[s] += 1
        self.since_round[w] = 0
        self.rounds[w] += 1

    def staleness(self, gap: int) -> None:
        self.stale_hist = _grow(self.stale_hist, gap)
        self.stale_hist[gap] += 1

    def aggregation_cost(self, seconds: float, workers: int) -> None:
        self.agg_cost_s += seconds * workers
        if not self.ps:
            self.collectives += 1

    # -- vector updates (fast engines) ------------------------------------------------------
    def add_times(self, compute, wait, aggregate) -> None:
        self.time[:, 0] += compute
        self.time[:, 1] += wait
        self.time[:, 2] += aggregate

    def add_local_steps(self, steps: np.ndarray) -> None:
        steps = np.asarray(steps, dtype=np.int64)
        self.local_hist = _grow(self.local_hist, int(steps.max()))
        self.local_hist += np.bincount(steps, minlength=self.local_hist.size)

    def add_staleness(self, hist: np.ndarray) -> None:
        self.stale_hist = _grow(self.stale_hist, hist.size - 1)
        self.stale_hist[:hist.size] += hist

    def finish(self, t_end: float) -> None:
        """Close every worker's open phase at the end of the simulated time."""
        for w in range(self.n):
            overrun = self.phase_since[w] - t_end
            if overrun > 0:   # ended inside a pause booked ahead
                self.time[w, 3] -= overrun
            else:
                self.time[w, self.phase_of[w]] -= overrun
            self.phase_since[w] = t_end
        self.sim_time = t_end

    # -- the result ---------------------------------------------------------------------------
    def row(self) -> dict:
        t = self.time[:, :3]
        busy = float(t.sum())
        T = self.sim_time
        total = int(self.iters.sum())
        rounds = int(self.collectives) if not self.ps else float(self.rounds.mean())
        queries = self.syncs + self.locals
        return {
            "workers": self.n, "iterations": total, "sim_time_s": T,
            "iterations_per_s": total / T if T > 0 else None,
            "samples_per_s": total * self.batch_size / T if T > 0 else None,
            "wait_fraction": float(t[:, 1:].sum() / busy) if busy > 0 else 0.0,
            "server_wait_fraction": float(t[:, 1].sum() / busy) if busy > 0 else 0.0,
            "aggregation_fraction": self.agg_cost_s / busy if busy > 0 else 0.0,
            "rounds": rounds,
            "iterations_per_worker": {"min": int(self.iters.min()),
                                      "max": int(self.iters.max())},
            # each worker's own count: its rate over the run (how stale its updates are
            # where the PS applies them on arrival: mpsync.auto.efficiency)
            "iterations_each": [int(i) for i in self.iters],
            "staleness": distribution(self.stale_hist) if self.ps else None,
            "local_steps_per_round": distribution(self.local_hist),
            "decisions_per_s": queries / T if T > 0 else None,
            "messages_per_s": self.messages / T if T > 0 else None,
            "aborted_iterations": int(self.aborted),
        }
