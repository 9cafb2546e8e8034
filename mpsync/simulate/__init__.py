"""``mpsync simulate``: the state server's policies on a virtual clock, 16 to thousands of workers.

Model
-----
Workers run the cycle of ``mpsync.torch``'s strategies: compute one iteration (its time from a
speed model, ``_speeds``), report it to the server and wait for the answer (one query round
trip), then either go on locally (LOCAL) or aggregate (SYNC): on the ring, an allreduce that
starts when the last worker of the round has been told SYNC; on the parameter server, a push
and a pull through the shard servers, the pull held while the policy's staleness rule says
so.  Each policy's own worker steps come from the registry as the workers read them
(ElasticBSP's push every iteration on the PS, ESync's capability test and delayed ACK, OSP's
importance report with its epoch, loss and Eq. 5 bound: ``_events``).  The costs come from a
stated model (``_model``)::

    ring:  T = 2(n-1)/n * B / bandwidth + 2(n-1) * latency        per round
    PS:    S shard servers, a link each; a push costs every shard (B/S)/bandwidth + latency
           + its update (adding a delta, or with the server's optimizer a step per push or a
           merge per push and a step per round), a pull (B/S)/bandwidth +
           latency; each shard serves one at a time, in arrival order (n pushes queue: about
           n * B / (S * bandwidth)), none takes less than the worker's own link, B / bandwidth
    query: one round trip ``query`` per report; the state server's decisions are instantaneous

or, replaying a trace, from the costs the real run measured.  Compute, waiting for the server
and aggregating (including waiting for slower peers) add up to each worker's time; the wait
fraction is (wait + aggregate) / total, as ``mpsync train`` reports it.  What the training
reports (epochs, losses, layers: OSP's inputs) is a ``TrainingModel``.

Engines (the design)
--------------------
* ``exact`` (``_events``): a heap of events, one at a time; every decision is made by the
  server's own policy object (``server.policies``: ``make_policy``, ``on_step``,
  ``decide_held``, ``on_reset``, ``on_push``, ``may_pull``), called through one adapter
  (``_adapter.PolicyDriver``) with the serve loop's bookkeeping around it.  A few µs per
  event: the reference, and the engine for trace replays and small clusters.
* ``fast``: 4,096 workers x 10,000 iterations are 41 M reports; at a few µs of Python each
  that is minutes, so the fast engines batch what a policy's structure allows:
  - ring policies (``_fast_ring``): every worker is told SYNC for the same round, so a round
    is computed for all workers at once with numpy, one vector step per local iteration; the
    iterations per round come from the real kernels (ElasticBSP: ``sched.predict`` +
    ``sched.zipline`` on the table the server holds; ESync: Alg. 2's test evaluated for all
    reports of a step at once; BSP/OSP: one).
  - PS policies (``_fast_ps``): an event loop compiled with Numba (well under 1 µs per
    event); SSP's rule with an incrementally kept minimum, DSSP's non-trivial pushes through
    the real ``sched.dssp_on_push``.
  Both restate the policy objects' control flow around the kernels; the tests run them and the
  exact engine on the same seeded speeds and require the same iterations, rounds and virtual
  times (exactly with constant speeds; with jitter the random draws come in another order).
  ``engine="auto"`` takes the fast engine where there is one (esync and ebsp on the PS
  topology have none) and the exact one otherwise.

API: :func:`simulate` returns one summary row; :func:`run_events` runs the exact engine and
returns its :class:`Recorder` itself (per-worker time in each phase, iterations, rounds).
"""

from __future__ import annotations

import time

from mpsync.config import SyncConfig
from mpsync.simulate._events import run_events, worker_behaviour
from mpsync.simulate._model import CostModel, parse_rate
from mpsync.simulate._speeds import SpeedModel, parse_speeds, read_trace
from mpsync.simulate._stats import Recorder
from mpsync.simulate._training import TrainingModel

__all__ = ["simulate", "run_events", "Recorder", "CostModel", "SpeedModel", "TrainingModel",
           "parse_speeds", "parse_rate", "read_trace", "fast_model", "ENGINES", "FAST_MODELS",
           "worker_behaviour"]

ENGINES = ("auto", "exact", "fast")
# The registry's simulation models the fast engines implement, per topology; the others
# (ElasticBSP's PS superstep, ESync's PS rounds) run on the exact engine.
FAST_MODELS = {"ring": ("every_step", "overlap", "query_state", "planned"),
               "ps": ("no_wait", "staleness", "in_step", "dynamic_staleness")}


def fast_model(config: SyncConfig) -> str | None:
    """The fast engine's model of ``config.policy`` on its topology (the registry's
    ``simulation``), or None where only the exact engine can run it (a model the fast engines
    do not implement, or ESync's delayed ACK, whose aborts need the event engine)."""
    from mpsync import policies

    model = policies.get(config.policy).simulation_model(config.topology)
    if model not in FAST_MODELS.get(config.topology, ()) or \
            worker_behaviour(config)["delayed_ack"]:
        return None
    return model


def simulate(config: SyncConfig, speeds: SpeedModel, cost: CostModel, *,
             iterations: int | None = None, duration: float | None = None,
             engine: str = "auto", batch_size: int = 32,
             training: TrainingModel | None = None) -> dict:
    """Simulate ``config.policy`` on ``config.topology`` until ``workers * iterations``
    iterations are done in total (or the virtual clock reaches ``duration``); returns one row
    of results (``Recorder.row`` plus policy, topology, engine and the run time).
    ``training``: what the workers report besides timing (OSP's epochs and losses)."""
    config.validate()
    if (iterations is None) == (duration is None):
        raise ValueError("give exactly one of iterations or duration")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    replay = speeds.pause is not None or speeds.spread is not None
    fast_ok = fast_model(config) is not None and not replay
    if engine == "fast" and not fast_ok:
        raise ValueError(f"no fast engine for {config.policy} on {config.topology}"
                         f"{' with pauses or a measured spread' if replay else ''}; "
                         f"use engine='exact'")
    use_fast = fast_ok and engine != "exact"
    cost = cost.for_run(config, speeds.n)
    training = training or TrainingModel()
    t0, cpu0 = time.perf_counter(), time.process_time()
    if use_fast:
        rec = Recorder(speeds.n, ps=config.topology == "ps", batch_size=batch_size)
        if config.topology == "ps":
            from mpsync.simulate._fast_ps import run_ps
            run_ps(config, speeds, cost, rec, iterations=iterations, duration=duration)
        else:
            from mpsync.simulate._fast_ring import run_ring
            run_ring(config, speeds, cost, rec, iterations=iterations, duration=duration,
                     training=training)
    else:
        rec = run_events(config, speeds, cost, iterations=iterations, duration=duration,
                         batch_size=batch_size, training=training)
    row = {"policy": config.policy, "topology": config.topology,
           "engine": "fast" if use_fast else "exact", **rec.row(),
           # a shard's time serving pushes and pulls over the run's: near 1, the server is
           # the bottleneck (a measured cost is no queue: not known)
           "ps_optimizer": cost.ps_optimizer if config.topology == "ps" else None,
           "shard_busy_fraction": rec.agg_cost_s / rec.sim_time
           if config.topology == "ps" and cost.shared_link and rec.sim_time > 0 else None,
           "runtime_s": round(time.perf_counter() - t0, 3),
           # on a shared machine the wall time says more about the other jobs than about
           # the simulator: its own CPU time beside it
           "cpu_s": round(time.process_time() - cpu0, 3)}
    return row
