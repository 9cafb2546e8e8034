"""Statistical efficiency: how much of a sample's progress a policy keeps.

Throughput alone would always pick the policy that waits least (ASP, or local steps without
end).  ``auto`` multiplies each candidate's simulated samples per second by a statistical
efficiency in (0, 1], the progress per sample relative to BSP's (Pollux, OSDI 2021, calls the
product goodput), from two things the simulation of the candidate measures:

* staleness: an update computed on weights ``s`` updates old moves the model less usefully
  (DSSP §I.A on ASP's and SSP's stale reads).  Where the parameter server applies each update
  as it arrives (the registry's policies without ``ps_average``: ASP, SSP, DSSP, ElasticBSP
  within a superstep) worker w's update is ``s_w = sum_{v != w} r_v / r_w`` updates old, with
  ``r`` the iteration rates (1 / compute time): the average over updates is n - 1 whatever the
  speeds, but a slow worker's updates are the stalest.  Efficiency: the rate-weighted mean of
  ``1 / (1 + STALENESS_COST * s_w)``.  (The simulator's staleness figure is another thing:
  how far a worker ran ahead of the slowest, which grows with the run under ASP.)
* local steps: averaging the deltas of ``k`` local steps (ESync Eq. 6-8, local SGD between
  ElasticBSP barriers) drifts the replicas apart; ``1 / (1 + LOCAL_STEP_COST * (k - 1))`` with
  ``k`` the mean local steps per round of the simulation.

The two costs are fitted to progress *measured* per sample: the samples each run of mpsync's
own comparisons had trained on when worker 0's evaluation first reached the target
(digits, 4 workers; bench/compare with slowdown 1,1,2,4 and 50 ms iterations, the 4-node
1gbit comparison, equal speeds at 400 ms), relative to BSP's in the same comparison.  Per
sample, ASP kept 0.71 of BSP's progress (12,200 samples to 0.9 against 8,700: with the
stragglers' rates that is 0.16 per update of staleness); the local-step policies kept 0.89-1.26
(ElasticBSP with 5-11 local steps per round 0.89-0.93 with stragglers, 0.78 and 1.26 with equal
speeds; ESync with about 2.5 local steps 1.22): a least-squares fit of 1/efficiency - 1 on the
extra local steps gives 0.01 per step.  The runs' spread is 20-30%, so both figures are
uncertain by about that much; ``mpsync.auto.explain`` sets each comparison's measured samples
to target beside the efficiencies auto predicted, so every new comparison checks the fit.
They grow with the cluster (staleness with n, local steps with the speed spread and R),
which is where they decide.
"""

from __future__ import annotations

__all__ = ["STALENESS_COST", "LOCAL_STEP_COST", "efficiency", "staleness_efficiency"]

STALENESS_COST = 0.16
LOCAL_STEP_COST = 0.01
_FLOOR = 0.05


def staleness_efficiency(compute_s) -> tuple[float, float]:
    """(efficiency, mean staleness) of updates applied on arrival by workers of these
    compute times (module doc)."""
    rates = [1.0 / c for c in compute_s]
    total = sum(rates)
    eff = mean = 0.0
    for r in rates:
        s = (total - r) / r
        eff += r / total / (1.0 + STALENESS_COST * s)
        mean += r / total * s
    return eff, mean


def efficiency(row: dict, stale_reads: bool, compute_s) -> tuple[float, str]:
    """(efficiency in (0, 1], the reason in words) of one simulated candidate: ``row`` from
    ``mpsync.simulate.simulate``; ``stale_reads``: the parameter server applies updates as
    they arrive; ``compute_s``: the workers' iteration times."""
    eff, why = 1.0, []
    if stale_reads and len(compute_s) > 1:
        e, s = staleness_efficiency(compute_s)
        eff *= e
        why.append(f"updates {s:.1f} updates stale on average")
    local = (row.get("local_steps_per_round") or {}).get("mean") or 1.0
    if local > 1:
        eff /= 1.0 + LOCAL_STEP_COST * (local - 1.0)
        why.append(f"{local:.1f} local steps per round")
    eff = max(eff, _FLOOR)
    return eff, (f"efficiency {eff:.2f} ({', '.join(why)})" if why
                 else "efficiency 1.00 (every update on the current weights)")
