"""The policy registry: everything mpsync knows about a synchronization policy, in one entry.

Every other module asks this registry instead of comparing policy names: the configuration
(which topologies a policy runs on, and its default one), the state server (which ``Policy``
class decides), the workers (which ``Strategy`` aggregates, and with what global step size),
the compiled serve path (which of its rule families applies), the job renderer and the
benchmarks.  Adding a policy is one :func:`register` call plus the module that holds its
classes; mpsync's own policies are registered at the bottom of this file.

Classes are named as ``"module:Class"`` strings and imported on first use, so importing this
module (and :mod:`mpsync.config`, which reads it) loads neither Numba nor torch nor mpi4py.

A policy defined outside mpsync is registered by importing its module in every rank before
the configuration is validated: list the module in ``MPSYNC_PLUGINS`` (comma-separated; the
``plugins`` setting of :class:`~mpsync.config.SyncConfig`), which :func:`load_plugins` imports.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Mapping

__all__ = ["PolicySpec", "PolicyChoice", "PolicyError", "TOPOLOGIES", "BASELINE", "AUTO", "AUTO_SWITCHABLE",
           "AUTO_MEASURING", "FAST_PATH_KINDS", "SIMULATION_MODELS", "AUTO_PS_SWITCHABLE", "AUTO_TARGETS",
           "auto_code", "auto_start_code", "auto_target", "hosts_shards", "register", "unregister", "get", "names",
           "specs", "choose", "baseline", "is_baseline", "default_topology", "load_plugins",
           "resolve", "policy_table", "fidelity_table"]

TOPOLOGIES = ("ring", "ps")
# What the other policies are measured against (``mpsync compare``'s speedup column).
BASELINE = "bsp"

# The policies ``auto`` runs and switches between on the ring, in the order of the codes its
# SYNC replies carry (1 + index): mpsync.auto, mpsync.torch.strategies.switching.  A plan of switches
# starts with the first (auto_start_code).
AUTO = "auto"
AUTO_SWITCHABLE = ("bsp", "esync", "ebsp")
# The ring policy auto runs from the first step, while it measures: between its barriers the
# fast workers step instead of waiting (mpsync.auto.serving).
AUTO_MEASURING = "ebsp"
# ... and on the parameter server its job hosts beside the ring (``auto_ps``): codes
# 1 + len(AUTO_SWITCHABLE) + index.
AUTO_PS_SWITCHABLE = ("asp", "ssp", "dssp")
# Added to the code of a switch from the PS to the ring that leaves a diverging run: the ring
# starts from the weights of a few seconds before (mpsync.auto.stability, mpsync.torch.strategies.switching).
AUTO_ROLLBACK = 64
# Every (policy, topology) a live ``auto`` run can run, indexed by code - 1.
AUTO_TARGETS = tuple((n, "ring") for n in AUTO_SWITCHABLE) + \
    tuple((n, "ps") for n in AUTO_PS_SWITCHABLE)

# Rule families the compiled serve path implements (server/_fastpath.py):
# "tables"      the step's reply follows from the shared tables alone (the base Policy.on_step);
# "planned"     a barrier planned per round (ElasticBSP's ZipLine plan);
# "query_state" a per-query readiness rule over the workers' records (ESync Alg. 2).
# None: the policy is served by the Python loop only.
FAST_PATH_KINDS = ("tables", "planned", "query_state")

# Models of ``mpsync simulate``'s fast engines (mpsync/simulate), for thousands of workers:
# on the ring "every_step" (aggregate at every iteration), "overlap" (every iteration, part of
# the model overlapped: OSP's ICS), "query_state" (ESync's readiness rule), "planned"
# (ZipLine barriers); on the PS "no_wait", "staleness" (bounded by ``staleness``), "in_step"
# (staleness 0), "dynamic_staleness" (DSSP's controller), and two that only the exact engine
# runs (it drives the policy object): "superstep" (a push and a pull every iteration, the
# SYNC'd one a barrier: ElasticBSP's §6.2.5) and "rounds" (local iterations, then a push in a
# synchronous round: ESync on the PS).
SIMULATION_MODELS = {"ring": ("every_step", "overlap", "query_state", "planned"),
                     "ps": ("no_wait", "staleness", "in_step", "dynamic_staleness", "superstep",
                            "rounds")}

# The strategy every policy uses on the parameter-server topology: push the local delta, pull
# the global weights under the policy's staleness rule.
_PS_STRATEGY = "mpsync.torch.strategies.ps:ParameterServer"


class PolicyError(ValueError):
    """An unknown policy, a malformed registration, or a topology the policy does not allow."""


@dataclass(frozen=True)
class PolicySpec:
    """One policy.  ``topologies`` lists the allowed topologies, the default first.

    ``server``: the state server's decision class, a ``mpsync.server.Policy`` subclass.
    ``strategies``: per topology, the worker's ``mpsync.torch.strategies.Strategy`` subclass.
    ``options``: the :class:`~mpsync.config.SyncConfig` fields this policy reads.  The
    strategies and the server look here rather than at the name: a policy with ``epsilon``
    scales the averaged model delta by it (ESync Eq. 8), one with ``esync_delayed_ack`` may
    report without waiting for the reply (ESync §4.2).
    ``ps_average``: on the PS, the server applies each worker's delta scaled by (global step
    size) / n, so a round in which every worker pushes once moves the model by the average
    of their deltas (BSP, ESync Eq. 7-8, as the ring's averaging collective does); without
    it each delta is applied as it is (Downpour style: ASP, SSP, DSSP, ElasticBSP's pushes
    within a superstep).  Only exact with a server rule that completes each round before
    anyone pulls (BSP's and ESync's).
    ``ps_server_optimizer``: on the PS the shards may run the optimizer on pushed gradients
    (``ps_optimizer='server'``): per push, or, with ``ps_average``, once per round on the
    round's merged pushes.  Only for a policy whose workers push every iteration (BSP, ASP,
    SSP, DSSP, ElasticBSP on the PS); one whose workers take local iterations between pushes
    (ESync) needs their own optimizer.
    ``ps_pull_ungated``: the server never holds a pull on the PS (ASP), so a worker pushes
    and pulls in one exchange per shard and collects the server's replies later.
    ``steps_unawaited``: the server's answer to every step is SYNC (ASP, SSP, DSSP: every
    iteration pushes, and what the rules decide they decide on the pull), so a worker
    reports its step without waiting for the reply and collects it after its next exchange
    (``SyncClient.step_unawaited``); under ASP the state server does not wake up for those
    reports either.  Never under ``auto``, whose replies may name the policy to switch to.
    ``ps_read_gap``: the option (one of ``options``) whose value bounds how many pushes a
    worker's granted pull may be ahead of the slowest worker's count (SSP's ``staleness``,
    DSSP's ``staleness_high``): a read then needs every worker's pushes only up to the
    reader's count less that value (:meth:`read_gap`; the server-side optimizer's inbox,
    ``mpsync.server.shard_window``).
    ``fidelity``: per topology, ``(implemented as written, departures)`` against the paper:
    the fidelity table of docs/fidelity.md (:func:`fidelity_table`).  Each departure carries
    its key in brackets, ``[dssp-allowance-left]``, and is followed, in parentheses, by the
    ``module:Class`` (or function) whose source states it as ``Departure [<key>]`` where the code
    makes it; "none" if there is none.  ``tests/test_policies.py`` checks that the table and
    the code state the same departures.
    """

    name: str
    description: str
    paper: str
    topologies: tuple[str, ...]
    server: str
    strategies: Mapping[str, str]
    fast_path: str | None = None
    options: tuple[str, ...] = ()
    ps_average: bool = False
    ps_server_optimizer: bool = False
    ps_pull_ungated: bool = False
    steps_unawaited: bool = False
    ps_read_gap: str = ""
    fidelity: Mapping[str, tuple[str, str]] = None
    simulation: Mapping[str, str] | None = None

    def simulation_model(self, topology: str) -> str | None:
        """The simulator's fast model of this policy on ``topology`` (``SIMULATION_MODELS``),
        or None: ``mpsync simulate`` then drives the policy's server class event by event."""
        return (self.simulation or {}).get(topology)

    def read_gap(self, config) -> int | None:
        """The most pushes a granted pull of this policy may be ahead of the slowest
        worker's count under ``config`` (``ps_read_gap``), or None: no such bound."""
        return int(getattr(config, self.ps_read_gap)) if self.ps_read_gap else None

    @property
    def default_topology(self) -> str:
        return self.topologies[0]

    def check_topology(self, topology: str) -> None:
        """Raise :class:`PolicyError` naming the policy if it cannot run on ``topology``."""
        if topology in self.topologies:
            return
        if topology not in TOPOLOGIES:
            raise PolicyError(f"unknown topology {topology!r}; choose one of: "
                              f"{', '.join(TOPOLOGIES)}")
        if topology == "ring" and "ps" in self.topologies:
            raise PolicyError(f"policy={self.name!r} needs a central copy of the weights and "
                              f"runs only on topology='ps' (got topology='ring')")
        raise PolicyError(f"policy={self.name!r} runs only on topology="
                          f"{' or '.join(repr(t) for t in self.topologies)} (got {topology!r})")

    def server_class(self) -> type:
        return resolve(self.server)

    def strategy_class(self, topology: str) -> type:
        self.check_topology(topology)
        return resolve(self.strategies[topology])

    def global_step(self, config) -> float:
        """ε of ESync Eq. 8 for a policy that reads ``epsilon``, else 1 (plain averaging)."""
        return float(config.epsilon) if "epsilon" in self.options else 1.0

    def ps_update_scale(self, config, n_workers: int) -> float:
        """The factor a parameter server applies each pushed update with: (global step) / n
        under ``ps_average``, else 1 (each update as it is)."""
        return self.global_step(config) / n_workers if self.ps_average else 1.0

    def reads(self, option: str) -> bool:
        return option in self.options

    @property
    def is_baseline(self) -> bool:
        """Whether the other policies are measured against this one."""
        return self.name == BASELINE


@dataclass(frozen=True)
class PolicyChoice:
    """A policy resolved once for a run: its registry entry, the topology it runs on, the
    values of the settings it reads (``spec.options``) and the baseline it is measured
    against.  :meth:`mpsync.config.SyncConfig.validate` makes it; the server, the workers and
    the reports take it from the configuration instead of looking the name up again."""

    spec: PolicySpec
    topology: str
    parameters: Mapping[str, object]
    baseline: str = BASELINE

    @property
    def name(self) -> str:
        return self.spec.name

    def server_class(self) -> type:
        return self.spec.server_class()

    def strategy_class(self) -> type:
        return self.spec.strategy_class(self.topology)


_REGISTRY: dict[str, PolicySpec] = {}


def register(name: str, *, description: str, server: str, strategies: Mapping[str, str],
             paper: str = "", fast_path: str | None = None, options: tuple[str, ...] = (),
             ps_average: bool = False, ps_server_optimizer: bool = False,
             ps_pull_ungated: bool = False, steps_unawaited: bool = False,
             ps_read_gap: str = "", simulation: Mapping[str, str] | None = None,
             fidelity: Mapping[str, tuple[str, str]] | None = None,
             replace: bool = False) -> PolicySpec:
    """Add a policy; returns its entry.

    ``strategies`` maps each allowed topology to its worker strategy (``"module:Class"``); its
    first key is the default topology.  ``"ps": "default"`` stands for the parameter-server
    strategy all of mpsync's policies use there.  Registering a name twice is an error unless
    ``replace`` (a plugin module imported twice registers the same entry again: allowed).
    """
    if not name or not name.replace("_", "").replace("-", "").isalnum() or name != name.lower():
        raise PolicyError(f"policy name must be lower-case letters, digits, '-' or '_', "
                          f"got {name!r}")
    strategies = {t: (_PS_STRATEGY if ref == "default" and t == "ps" else ref)
                  for t, ref in strategies.items()}
    if not strategies:
        raise PolicyError(f"policy {name!r}: give at least one topology in strategies")
    for topology, ref in strategies.items():
        if topology not in TOPOLOGIES:
            raise PolicyError(f"policy {name!r}: unknown topology {topology!r}; choose from "
                              f"{', '.join(TOPOLOGIES)}")
        _check_ref(name, f"strategy for {topology}", ref)
    _check_ref(name, "server", server)
    if fast_path is not None and fast_path not in FAST_PATH_KINDS:
        raise PolicyError(f"policy {name!r}: fast_path must be None or one of "
                          f"{', '.join(FAST_PATH_KINDS)}, got {fast_path!r}")
    for topology, model in (simulation or {}).items():
        if model not in SIMULATION_MODELS.get(topology, ()):
            raise PolicyError(f"policy {name!r}: simulation model {model!r} on {topology!r}; "
                              f"choose from {', '.join(SIMULATION_MODELS.get(topology, ()))}")
    if ps_read_gap and ps_read_gap not in options:
        raise PolicyError(f"policy {name!r}: ps_read_gap {ps_read_gap!r} must be one of its "
                          f"options ({', '.join(options) or 'none given'})")
    spec = PolicySpec(name=name, description=description, paper=paper,
                      topologies=tuple(strategies), server=server, strategies=strategies,
                      fast_path=fast_path, options=tuple(options), ps_average=ps_average,
                      ps_server_optimizer=ps_server_optimizer, ps_pull_ungated=ps_pull_ungated,
                      steps_unawaited=steps_unawaited, ps_read_gap=ps_read_gap,
                      simulation=dict(simulation) if simulation else None,
                      fidelity=dict(fidelity or {}))
    old = _REGISTRY.get(name)
    if old is not None and old != spec and not replace:
        raise PolicyError(f"policy {name!r} is already registered (pass replace=True)")
    _REGISTRY[name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a policy (a test that registered one cleans up after itself)."""
    get(name)
    del _REGISTRY[name]


def get(name: str) -> PolicySpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise PolicyError(f"unknown policy {name!r}; choose one of: {', '.join(_REGISTRY)}"
                          f" (a policy of your own: MPSYNC_PLUGINS=your.module)") from None


def names() -> tuple[str, ...]:
    """Registered policy names, in registration order (mpsync's own first)."""
    return tuple(_REGISTRY)


def specs() -> tuple[PolicySpec, ...]:
    return tuple(_REGISTRY.values())


def choose(name: str, topology: str = "", parameters: Mapping[str, object] | None = None
           ) -> PolicyChoice:
    """Resolve ``name`` on ``topology`` (empty: the policy's own) with the values of the
    settings it reads; PolicyError names what does not fit."""
    spec = get(name)
    topology = topology or spec.default_topology
    spec.check_topology(topology)
    values = dict(parameters or {})
    missing = [o for o in spec.options if o not in values]
    if missing:
        raise PolicyError(f"policy {name!r} reads {', '.join(missing)}: give a value for each")
    return PolicyChoice(spec, topology, {o: values[o] for o in spec.options})


def baseline() -> PolicySpec:
    """The policy the others are measured against."""
    return get(BASELINE)


def is_baseline(name: str) -> bool:
    """Whether ``name`` is the baseline (a name not registered here is not)."""
    return name == BASELINE


def default_topology(name: str) -> str:
    return get(name).default_topology


def resolve(ref: str):
    """Import ``"module:attribute"`` and return the attribute."""
    module, _, attr = ref.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise PolicyError(f"cannot load {ref!r}: {e}") from e


def auto_code(name: str, topology: str) -> int:
    """The code a SYNC reply carries for ``auto`` to run ``name`` on ``topology`` next."""
    return 1 + AUTO_TARGETS.index((name, topology))


def auto_start_code(planned: bool) -> int:
    """The code ``auto`` runs from the first step, on the server and on every worker:
    ``AUTO_MEASURING`` on the ring; under a plan of switches (``auto_plan``, for tests and
    benchmarks) BSP, the policy a plan's rounds are written from."""
    return 1 if planned else auto_code(AUTO_MEASURING, "ring")


def auto_target(code: int) -> tuple[str, str]:
    """``(policy, topology)`` of an ``auto`` code (:func:`auto_code`)."""
    return AUTO_TARGETS[code - 1]


def hosts_shards(config) -> bool:
    """Does this job run the parameter server's shards: on the PS topology, and under
    ``auto`` with ``auto_ps`` (idle while the ring runs, loaded at a switch to the PS)."""
    return config.topology == "ps" or (config.policy == AUTO and bool(config.auto_ps))


def load_plugins(modules: str | None) -> None:
    """Import each module of a comma-separated list (each registers its policies)."""
    for module in (m.strip() for m in (modules or "").split(",")):
        if not module:
            continue
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise PolicyError(f"plugins: cannot import {module!r} ({e}); is it on PYTHONPATH "
                              f"of every rank?") from e


def policy_table() -> str:
    """The policy table of docs/policies.md (Markdown), generated from the registry."""
    rows = ["| policy | topology | when workers synchronize | paper |", "|---|---|---|---|"]
    for s in specs():
        rows.append(f"| `{s.name}` | {', '.join(s.topologies)} | {s.description} | {s.paper} |")
    return "\n".join(rows)


def fidelity_table() -> str:
    """The fidelity table of docs/fidelity.md (Markdown): per policy and topology, the paper's
    section, what is implemented as written, and each departure with where the code states it."""
    rows = ["| policy | topology | paper | implemented as written | departures (where stated) |",
            "|---|---|---|---|---|"]
    for s in specs():
        for topology, (as_written, departures) in (s.fidelity or {}).items():
            rows.append(f"| `{s.name}` | {topology} | {s.paper} | {as_written} | "
                        f"{departures} |")
    return "\n".join(rows)


def _check_ref(name: str, what: str, ref) -> None:
    module, sep, attr = str(ref).partition(":")
    if not (isinstance(ref, str) and sep and module and attr):
        raise PolicyError(f"policy {name!r}: {what} must be 'module:Class', got {ref!r}")


# -- mpsync's policies ------------------------------------------------------------------------
_SERVER = "mpsync.server.policies:"
_STEP_SERVER = "mpsync.server.step_policies:"
_STRATEGY = "mpsync.torch.strategies:"
# The papers' parameter server runs the optimizer on pushed gradients (ps_optimizer='server');
# mpsync's default pushes the delta of each worker's own optimizer step.
_PS_WORKER_OPTIMIZER = ("with ps_optimizer='worker' (the default) each worker runs its own "
                        "optimizer and pushes the delta of its step, not the gradient for "
                        "the server's optimizer (ps_optimizer='server', as written): the same "
                        "model for SGD under BSP only [ps-worker-optimizer] "
                        "(mpsync.torch.strategies.ps:ParameterServer)")

# With the shards' optimizer on one node, pushes go through an inbox (shard_window).
_PS_SERVER_INBOX = ("; with ps_optimizer='server' on one node a shard steps once on the "
                    "gradients pushed since its last step, not once per push "
                    "[ps-server-inbox] (mpsync.server.shard_window:ShardInbox)")
_PS_SERVER_INBOX_BOUNDED = ("; with ps_optimizer='server' on one node a shard steps once on "
                            "the gradients pushed since its last step, not once per push, and "
                            "a read holds every worker's pushes up to the bound, not every "
                            "push the state server counted [ps-server-inbox] "
                            "(mpsync.server.shard_window:ShardInbox)")
register(
    "bsp", description="every iteration (Horovod's behaviour; the baseline)", paper="DSSP §I.A",
    server=_SERVER + "BSP",
    strategies={"ring": _STRATEGY + "GradientAveraging", "ps": "default"},
    fast_path="tables", ps_average=True, ps_server_optimizer=True,
    simulation={"ring": "every_step", "ps": "in_step"},
    fidelity={"ring": ("gradients averaged every iteration (one fused allreduce)", "none"),
              "ps": ("every worker pushes every iteration; a pull waits until every worker "
                     "pushed as often, the next step until every worker pulled; the server "
                     "averages the round's deltas, or (ps_optimizer='server') takes one "
                     "optimizer step on the mean of the round's gradients",
                     _PS_WORKER_OPTIMIZER)})
register(
    "asp", description="never wait: push updates, pull whatever is current", paper="DSSP §I.A",
    server=_SERVER + "ASP", strategies={"ps": "default"}, fast_path="tables",
    ps_server_optimizer=True, ps_pull_ungated=True, steps_unawaited=True,
    simulation={"ps": "no_wait"},
    fidelity={"ps": ("push every iteration, applied on arrival; pull whatever is current",
                     _PS_WORKER_OPTIMIZER + _PS_SERVER_INBOX)})
register(
    "ssp", description="a worker may run at most `--staleness s` iterations ahead of the slowest",
    paper="DSSP §I.A", server=_SERVER + "SSP", strategies={"ps": "default"},
    fast_path="tables", options=("staleness",), ps_server_optimizer=True, steps_unawaited=True,
    ps_read_gap="staleness", simulation={"ps": "staleness"},
    fidelity={"ps": ("a pull waits while the worker is more than s pushes ahead of the "
                     "slowest", _PS_WORKER_OPTIMIZER + _PS_SERVER_INBOX_BOUNDED)})
register(
    "dssp", description="SSP whose bound moves within `[s_L, s_U]`, set per push by a controller",
    paper="DSSP Alg. 1-2", server=_SERVER + "DSSP", strategies={"ps": "default"},
    fast_path="tables", options=("staleness_low", "staleness_high"), ps_server_optimizer=True,
    steps_unawaited=True, ps_read_gap="staleness_high",
    simulation={"ps": "dynamic_staleness"},
    fidelity={"ps": ("Alg. 1 server and Alg. 2 synchronization controller on every push",
                     "the controller is given the allowance left, not the full r_max, so the "
                     "gap never exceeds s_U [dssp-allowance-left] (mpsync.server.policies:DSSP); "
                     "Alg. 2 is given Alg. 1's slowest worker (fewest pushes), not the one its "
                     "line 3 finds from the timestamps [dssp-slowest-by-pushes]; the OK sent "
                     "with a grant of r* is the first of the r* extra iterations (r_p = r* - 1) "
                     "[dssp-first-extra-ok] (mpsync.sched.dssp:dssp_on_push); "
                     + _PS_WORKER_OPTIMIZER + _PS_SERVER_INBOX_BOUNDED)})
_POL = "mpsync.server.step_policies:"
_STR = "mpsync.torch.strategies:"
# ZipLine's search departs from the paper's text only in ways that keep its barrier.
_ZIPLINE_SEARCH = ("ZipLine's search, with the paper's barrier: Ω sorted by keys for larger "
                   "matrices [zipline-omega-sort], z canonical [zipline-canonical-z] "
                   "(mpsync.sched.zipline_omega:omega); ZipLineOptBS's dead marks "
                   "[zipline-optbs-dead-marks] and a finger in place of the binary search "
                   "[zipline-optbs-finger] (mpsync.sched.zipline_scans:scan_optbs); "
                   "GridScan's \"close to\" read as the earliest element not before "
                   "[zipline-gridscan-close-to] (mpsync.sched.zipline_scans:scan_grid)")
_EBSP_INTERVALS = (f"intervals from step reports, not push timestamps [ebsp-report-intervals] "
                   f"({_POL}ElasticBSP)")
_ESYNC = (f"t_e stamped by the server on receipt, not the device's clock [esync-server-clock]; "
          f"READY only once every device (not only the slowest) pulled the last round "
          f"[esync-ready-after-every-pull]; the capability test reply is held until every "
          f"capability is known [esync-held-capability-test] ({_POL}ESync); the test batch is "
          f"the first training batch [esync-test-batch], and the §4.2 abort is checked between "
          f"backward and the optimizer step [esync-abort-between-steps] "
          f"({_STR}LocalStepsThenAggregate)")
register(
    "ebsp", description="ElasticBSP: supersteps ending at a barrier that the server places "
                        "with ZipLine from `R` predicted iterations per worker, after a "
                        "monitoring phase; within a superstep the PS gets a push every "
                        "iteration (ASP), the ring runs local SGD (an adaptation)",
    paper="ZipLine §3, Fig. 5, §5, §6.2.5", server=_STEP_SERVER + "ElasticBSP",
    strategies={"ring": _STRATEGY + "DeltaAveraging", "ps": "mpsync.torch.strategies.ps:ElasticSuperstep"},
    fast_path="planned", options=("lookahead", "zipline_variant"), ps_server_optimizer=True,
    simulation={"ring": "planned", "ps": "superstep"},
    fidelity={
        "ps": ("superstep of Fig. 5 after every barrier: monitoring (2 reports per worker), "
               "prediction (R iterations), ZipLine barrier (Alg. 2, ties to the earliest); "
               "a push and an ungated pull every iteration within it (§6.2.5 ASP-like "
               "mode); at the barrier every pull waits for every barrier push (BSP); after a "
               "worker joins, the plans cover the workers still running",
               f"{_EBSP_INTERVALS}; {_ZIPLINE_SEARCH}; {_PS_WORKER_OPTIMIZER}"),
        "ring": ("the same monitoring, prediction and ZipLine barriers as on the PS",
                 f"ElasticBSP barriers with local SGD between them: no server copy of the "
                 f"weights to push to, so iterations within a superstep stay local and the "
                 f"model deltas are averaged at the barrier [ebsp-ring-local-sgd] "
                 f"({_STR}DeltaAveraging); {_EBSP_INTERVALS}; {_ZIPLINE_SEARCH}"),
    })
register(
    "esync", description="fast workers run extra local iterations until the slowest is ready; "
                         "model deltas averaged in synchronous rounds",
    paper="ESync Alg. 1-2, Eq. 6-8, §4.2", server=_STEP_SERVER + "ESync",
    strategies={"ring": _STRATEGY + "DeltaAveraging", "ps": "default"},
    fast_path="query_state", options=("epsilon", "esync_slack", "esync_delayed_ack"),
    ps_average=True, simulation={"ring": "query_state", "ps": "rounds"},
    fidelity={
        "ring": ("Alg. 1 (capability test, local steps, Eq. 6-8 delta averaging, restart from "
                 "w_{t+1}), Alg. 2 QUERY-STATE, §4.2 delayed ACK with the abort of iteration "
                 "k+δ",
                 _ESYNC),
        "ps": ("as on the ring: synchronous rounds (every Δ in before any pull of w_{t+1}), "
               "so PS and ring compute the same model",
               f"as on the ring: {_ESYNC}"),
    })
register(
    "osp", description="important layers sync at once, the rest overlapped with the next "
                       "iteration, with local-gradient correction",
    paper="OSP §3-4, Alg. 1, Eq. 4-7", server=_STEP_SERVER + "OSP",
    strategies={"ring": "mpsync.torch.strategies.two_stage:TwoStageSync"}, fast_path="tables",
    options=("osp_ics_size", "osp_ics_max_fraction"), simulation={"ring": "overlap"},
    fidelity={
        "ring": ("RS + ICS (§3.1), PGP importance per layer (Eq. 4) with a one-iteration lag, "
                 "reported during the computation (§3.2, §4.5), U_max = b·T_c/N from measured "
                 "rates (Eq. 5) capped at 0.8 (Alg. 1 line 2), S(G^u) = 0 in epoch 1 then (1 - loss_i/L)·U_max "
                 "(Alg. 1), LGP correction (Eq. 6-7)",
                 f"ring allreduce instead of a PS [osp-ring]; lr of Eq. 5 not measured (0) "
                 f"[osp-no-loss-rate]; loss_i is the running mean of epoch i "
                 f"[osp-running-mean-loss], reported one iteration ahead [osp-loss-one-ahead] "
                 f"({_POL}OSP); S(G^u) clipped to [0, U_max] "
                 f"[osp-clip-ics-size] (mpsync.sched.osp:osp_ics_size); the importance of ICS "
                 f"layers is of the local gradient, LGP's estimate [osp-ics-local-importance]; "
                 f"Eq. 7 is exact for SGD (its momentum buffer corrected too), not for other "
                 f"optimizers [osp-lgp-plain-sgd] "
                 f"(mpsync.torch.strategies.two_stage:TwoStageSync)"),
    })
register(
    AUTO, description="measures the cluster under ElasticBSP, simulates every candidate with "
                      "the server's rules, runs the one predicted to reach the target first "
                      "(BSP, ESync, ElasticBSP on the ring; ASP, SSP, DSSP on the parameter "
                      "server its job hosts) and decides again when the cluster changes",
    paper="its candidates' papers", server="mpsync.auto.serving:AutoPolicy",
    strategies={"ring": "mpsync.torch.strategies.switching:Switching"},
    options=("lookahead", "zipline_variant", "epsilon", "esync_slack", "staleness",
             "staleness_low", "staleness_high", "auto_plan", "auto_ps"))
