"""Rank candidate policies on measurements: each candidate simulated with the server's own
rules (``mpsync.simulate``) on the measured speeds and costs, its samples per second turned
into progress per second by a statistical efficiency (``efficiency``), and the candidates
ordered by their predicted time to the target.

Pure: no MPI, no torch, no clock besides the simulator's virtual one.  The live server calls
it in a process of its own (``serving``); ``mpsync advise`` and tests call it directly.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from mpsync import policies
from mpsync.config import SyncConfig
from mpsync.policies import AUTO_SWITCHABLE
from mpsync.auto.efficiency import efficiency
from mpsync.auto.measurements import Measurements

__all__ = ["Candidate", "Ranked", "default_candidates", "rank_candidates",
           "staleness_bound", "SWITCHABLE", "HORIZON_ITERATIONS", "TIE_TOLERANCE"]

# The policies a live ``auto`` run can switch between (the registry's, in the order their
# codes travel in a SYNC reply: 1 + index), on the ring, at a round every worker takes part in.
SWITCHABLE = AUTO_SWITCHABLE
# Iterations per worker each candidate is simulated for: enough for ElasticBSP's supersteps
# (2 monitoring reports + up to R) and ESync's rounds to repeat several times at 4-64 workers.
HORIZON_ITERATIONS = 120
# ... unless the workers completed fewer rounds each than this in it: the simulation then
# saw only the start-up, and runs again over a horizon ``_LONGER`` times as long, at most
# ``_LONGER_TIMES`` times.  Seen with ESync on a parameter server behind a slow link (16
# workers, a 100 MB model, 100 Mbit/s): the first round's pushes queue at the shards for tens
# of seconds while the workers that already pulled step locally, and the iteration budget
# ran out inside that round (0.6 rounds per worker, 1 to 275 iterations each): "1138
# samples/s, 1 local step per round", where the next rounds ran at 2084 samples/s with 244
# local steps per round.
_STEADY_ROUNDS = 2.0
_LONGER, _LONGER_TIMES = 4, 2
# Settings swept for the policies that have a main one (offline advice; the live run uses
# its configuration's).
_STALENESS = (1, 3, 8)
# Predictions this close to the best are a tie within the model (its residuals are 15%): among
# them the ring goes first (no switch to the PS for nothing), then SSP at the run's own bound
# (default 3: the one the comparisons measured), then other bounds, tightest first, then the
# unbounded (``_tie_order``).  At equal speeds ASP, SSP and DSSP on the PS predict the same;
# SSP kept more progress per sample than ASP in every comparison the model was fitted on (1.11-1.58
# of BSP's against 0.68-1.17), and its bound holds when a worker falls behind, where ASP's
# staleness grows unbounded.  SSP at bound 1 is not measured in a comparison; in single runs
# at equal speeds it diverged twice in five, bound 3 in none of five.
TIE_TOLERANCE = 0.01


@dataclass(frozen=True)
class Candidate:
    """A policy on a topology with the settings that differ from the configuration's;
    ``wire="fp16"``: the aggregation sends half the bytes (Compression.fp16)."""

    policy: str
    topology: str
    settings: tuple = ()
    wire: str = "fp32"

    @property
    def label(self) -> str:
        extra = [f"{k}={v}" for k, v in self.settings]
        if self.wire != "fp32":
            extra.append(self.wire)
        return f"{self.policy}/{self.topology}" + (f" ({', '.join(extra)})" if extra else "")

    def as_dict(self) -> dict:
        return {"policy": self.policy, "topology": self.topology,
                "settings": [list(kv) for kv in self.settings], "wire": self.wire}

    @classmethod
    def from_dict(cls, d: dict) -> "Candidate":
        return cls(d["policy"], d["topology"], tuple(tuple(kv) for kv in d.get("settings", ())),
                   d.get("wire", "fp32"))

    @property
    def switchable(self) -> bool:
        """Can a live ``auto`` job switch to it (a ring policy with the configuration's
        settings; with ``auto_ps``, a PS policy with its staleness bound of choice)?"""
        if (self.policy, self.topology) not in policies.AUTO_TARGETS or self.wire != "fp32":
            return False
        return self.topology == "ps" or not self.settings

    def config(self, base=None):
        from mpsync.config import SyncConfig

        values = {} if base is None else {k: getattr(base, k) for k in
                                          ("staleness", "staleness_low", "staleness_high",
                                           "lookahead", "zipline_variant", "epsilon",
                                           "esync_slack")}
        values.update(dict(self.settings))
        return SyncConfig(policy=self.policy, topology=self.topology, **values).validate()


@dataclass(frozen=True)
class Ranked:
    """One candidate's prediction: ``predicted_time_to_target_s`` = target samples / (samples
    per second x efficiency); ``reasons`` say what the simulation saw."""

    candidate: Candidate
    predicted_time_to_target_s: float
    samples_per_s: float
    efficiency: float
    wait_fraction: float
    reasons: tuple[str, ...]
    simulation_cpu_s: float

    @property
    def progress_per_s(self) -> float:
        return self.samples_per_s * self.efficiency

    def as_dict(self) -> dict:
        return {"candidate": self.candidate.label, **self.candidate.as_dict(),
                "predicted_time_to_target_s": round(self.predicted_time_to_target_s, 3),
                "samples_per_s": round(self.samples_per_s, 1),
                "efficiency": round(self.efficiency, 3),
                "wait_fraction": round(self.wait_fraction, 3), "reasons": list(self.reasons),
                "simulation_cpu_s": round(self.simulation_cpu_s, 3)}

    @classmethod
    def from_dict(cls, d: dict) -> "Ranked":
        return cls(Candidate.from_dict(d), d["predicted_time_to_target_s"], d["samples_per_s"],
                   d["efficiency"], d["wait_fraction"], tuple(d["reasons"]),
                   d["simulation_cpu_s"])


def default_candidates(topologies=("ring", "ps"), *, switchable_only: bool = False
                       ) -> list[Candidate]:
    """Every registered policy (but ``auto``) on each of its topologies in ``topologies``,
    with its main settings swept (a staleness bound; the fp16 wire where the ring aggregates every
    iteration or at barriers); only those a live ring run can switch to when asked."""
    out = []
    for spec in policies.specs():
        if spec.name == policies.AUTO:
            continue
        for topology in spec.topologies:
            if topology not in topologies:
                continue
            if spec.reads("staleness"):
                out += [Candidate(spec.name, topology, (("staleness", s),))
                        for s in _STALENESS]
                continue
            out.append(Candidate(spec.name, topology))
            if topology == "ring" and spec.name in SWITCHABLE:
                out.append(Candidate(spec.name, topology, wire="fp16"))
    if switchable_only:
        out = [c for c in out if c.switchable]
    return out


def _cost(m: Measurements, c: Candidate):
    from mpsync.simulate import CostModel

    half = c.wire == "fp16"
    fixed = m.aggregation_s
    if fixed is not None and half:
        # A measured aggregation is latency plus bytes over the link: fp16 halves the second.
        n = m.n
        transfer = 2 * (n - 1) / n * m.model_bytes / m.bandwidth
        fixed = max(fixed / 2, fixed - transfer / 2)
    return CostModel(model_bytes=m.model_bytes / (2 if half else 1), bandwidth=m.bandwidth,
                     latency=m.latency, query=m.query_s, fixed_aggregation=fixed,
                     ps_shards=max(1, int(m.ps_shards)))


def predict(m: Measurements, c: Candidate, *, base=None, seed: int = 0,
            horizon: int = HORIZON_ITERATIONS, engine: str = "auto") -> Ranked:
    """Simulate one candidate on ``m`` and predict its time to the target (``engine``: the
    simulator's; "exact" needs no compiled kernel when Numba's JIT is off, ``helper``)."""
    from mpsync.simulate import SpeedModel, simulate

    t0 = time.process_time()
    speeds = SpeedModel(list(m.compute_s), jitter=m.jitter, seed=seed)
    row = simulate(c.config(base), speeds, _cost(m, c), iterations=horizon,
                   batch_size=m.batch_size, engine=engine)
    for _ in range(_LONGER_TIMES):
        if (row.get("rounds") or 0) >= _STEADY_ROUNDS:
            break
        horizon *= _LONGER  # only the start-up was seen (``_STEADY_ROUNDS``)
        row = simulate(c.config(base), speeds, _cost(m, c), iterations=horizon,
                       batch_size=m.batch_size, engine=engine)
    rate = row.get("samples_per_s") or 0.0
    spec = policies.get(c.policy)
    eff, why = efficiency(row, c.topology == "ps" and not spec.ps_average, m.compute_s,
                          m.ps_gain, m.ps_gain_sd, m.ps_gain_bracket, m.ps_stride,
                          capped=m.ps_gain_capped)
    ttt = m.target_samples / (rate * eff) if rate > 0 else float("inf")
    reasons = (f"{rate:.0f} samples/s simulated ({row['engine']} engine, "
               f"{row['iterations']} iterations)",
               f"wait fraction {row['wait_fraction']:.2f}", why)
    return Ranked(c, ttt, rate, eff, row["wait_fraction"], reasons,
                  time.process_time() - t0)


def staleness_bound(c: Candidate, base=None) -> float:
    """How many updates old an update the candidate applies can be: 0 where every update is
    applied to the weights it was computed on (the ring; the PS under ``ps_average``), the
    bound where the policy reads one (SSP's staleness, DSSP's upper bound), else unbounded."""
    spec = policies.get(c.policy)
    if c.topology != "ps" or spec.ps_average:
        return 0.0
    config = c.config(base)
    for option in ("staleness_high", "staleness"):
        if spec.reads(option):
            return float(getattr(config, option))
    return float("inf")


def _tie_order(bound: float, own: float) -> tuple:
    """Bounded before unbounded; none (the ring) and the run's own bound before others;
    then the tighter bound."""
    return (math.isinf(bound), bound not in (0.0, own), bound)


def rank_candidates(measurements: Measurements, candidates=None, *, base=None,
                    horizon: int = HORIZON_ITERATIONS, engine: str = "auto") -> list[Ranked]:
    """Every candidate (None: :func:`default_candidates` on ``measurements.topologies``)
    predicted on ``measurements``, best (shortest predicted time to target) first, those within
    ``TIE_TOLERANCE`` of the best ordered by their ``staleness_bound`` first (``_tie_order``).
    ``base``:
    the run's configuration, whose settings the candidates keep unless they sweep them."""
    if candidates is None:
        candidates = default_candidates(measurements.topologies)
    ranked = [predict(measurements, c, base=base, horizon=horizon, engine=engine)
              for c in candidates]
    ranked.sort(key=lambda r: (r.predicted_time_to_target_s, r.candidate.label))
    if not ranked:
        return ranked
    tie = ranked[0].predicted_time_to_target_s * (1.0 + TIE_TOLERANCE)
    tied = [r for r in ranked if r.predicted_time_to_target_s <= tie]
    own = float(SyncConfig.staleness if base is None else base.staleness)
    tied.sort(key=lambda r: _tie_order(staleness_bound(r.candidate, base), own)
              + (r.predicted_time_to_target_s, r.candidate.label))
    return tied + ranked[len(tied):]
