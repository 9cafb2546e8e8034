"""``auto``: mpsync measures the cluster, chooses the synchronization policy, and chooses
again when the cluster changes.

The decision is pure (no MPI, no torch): :class:`Measurements` in, candidates simulated with
the server's own rules on a virtual clock (``mpsync.simulate``) and weighed by a statistical
efficiency, a ranked list with reasons out (:func:`rank_candidates`), and a :class:`Decider`
that switches only for a clear predicted gain and re-decides only when the measurements
change.  The state server's side (``serving.AutoPolicy``, named in the policy registry) feeds
it from the reports it answers and runs the ranking in a process of its own; the workers'
side is ``mpsync.torch.strategies.switching``.

Offline advice::

    from mpsync.auto import Measurements, rank_candidates
    for r in rank_candidates(Measurements.from_metrics("runs/bsp/metrics.json")):
        print(r.candidate.label, r.predicted_time_to_target_s, r.reasons)
"""

from mpsync.auto.decider import Decider, DecisionRecord
from mpsync.auto.efficiency import efficiency
from mpsync.auto.measurements import DEFAULT_TARGET_SAMPLES, Measurements, Window
from mpsync.auto.ranking import (
    SWITCHABLE,
    Candidate,
    Ranked,
    default_candidates,
    predict,
    rank_candidates,
)

__all__ = ["Measurements", "Window", "Candidate", "Ranked", "rank_candidates", "predict",
           "default_candidates", "Decider", "DecisionRecord", "efficiency", "SWITCHABLE",
           "DEFAULT_TARGET_SAMPLES"]
