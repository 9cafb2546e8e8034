"""One typed configuration for a synchronization run, validated before anything is launched.

``SyncConfig`` is what ``mpsync.torch.init``, the state server's policies, ``mpsync train`` and
``mpsync compare`` share.  Validation needs no communicator, so impossible settings are rejected
on every rank (and before ``mpirun`` starts) with one line that names the setting.

Precedence: explicit arguments (CLI flags, ``init`` keywords) > environment (``MPSYNC_*``) >
defaults.  Environment variables are read here and nowhere else: ``MPSYNC_*`` for
:class:`SyncConfig`, and Horovod's own negotiation variables (``HOROVOD_FUSION_THRESHOLD``,
``HOROVOD_CYCLE_TIME``, ``HOROVOD_CACHE_CAPACITY``) for :class:`Negotiation`, so that a Horovod
job's settings mean the same under mpsync.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import tempfile
import traceback
from dataclasses import dataclass, field

from mpsync import policies
from mpsync.policies import PolicyChoice, PolicyError
from mpsync.zipline_variants import FASTEST_EXACT_VARIANT, ZIPLINE_VARIANTS

__all__ = [
    "ConfigError", "SyncConfig", "TOPOLOGIES", "BACKENDS", "SERVER_PLACEMENTS",
    "ZIPLINE_VARIANTS", "OSP_ICS_SIZES", "DEFAULTS", "parse_float_list", "parse_number",
    "parse_ps_shards", "parse_bool", "debug_enabled",
    "check_output_dir", "PS_OPTIMIZERS", "parse_staleness_range", "print_user_error",
    "OPTIMIZERS", "OptimizerChoice", "optimizer_choice", "PROCESS_GROUP_BACKENDS",
    "transport_unavailable", "Negotiation", "HOROVOD_FUSION_BYTES", "HOROVOD_CYCLE_MS",
    "HOROVOD_CACHE_CAPACITY",
]

# Which policies exist and where each may run: mpsync.policies (the registry).
TOPOLOGIES = policies.TOPOLOGIES
# The ring's transport: mpi4py, Horovod's CPU ops, or a torch.distributed process group of
# the workers (gloo on host tensors, NCCL on CUDA tensors; mpsync.torch.dataplane.process_group).
BACKENDS = ("mpi", "horovod", "gloo", "nccl")
SERVER_PLACEMENTS = ("dedicated", "colocated")
# The backends that are a torch.distributed process group (checked by transport_unavailable).
PROCESS_GROUP_BACKENDS = ("gloo", "nccl")
OSP_ICS_SIZES = ("measured", "fixed")
# Who runs the optimizer on the parameter server: each worker (pushing the delta of its
# step) or the shards (workers push gradients; mpsync.server.shard_optimizer).
PS_OPTIMIZERS = ("worker", "server")

ENV_PREFIX = "MPSYNC_"
DEFAULT_BUCKET_MB = 25.0

# The optimizers ``mpsync train`` builds (torch.optim.SGD, Adam, AdamW): the ones the
# parameter server's shards run too (mpsync.server.shard_optimizer.KINDS), so that a run with
# ps_optimizer='server' can choose any of them.
OPTIMIZERS = ("sgd", "adam", "adamw")


class ConfigError(ValueError):
    """An impossible or unknown setting; the message names the setting."""


@dataclass
class SyncConfig:
    """Every setting of a run, with its default.  These defaults are the only ones: the CLI,
    ``mpsync.torch.init``, the job renderer and the benchmarks read them from here (``DEFAULTS``)
    instead of restating them."""

    policy: str = policies.BASELINE
    # Empty: the policy's own default topology (its registry entry); filled in by validate().
    topology: str = ""
    # mpi4py's collectives need nothing beyond mpi4py, which the control plane needs anyway;
    # Horovod is an optional source build (0.28.1 needs a patch to compile against torch 2.x),
    # so it is chosen explicitly; so are gloo and NCCL (torch.distributed), which need a torch
    # built with them (NCCL: and CUDA), checked where the workers start.
    backend: str = "mpi"
    server: str = "dedicated"
    # SSP threshold s (SSP: a worker may run at most s iterations ahead of the slowest).
    staleness: int = 3
    # DSSP range [s_L, s_U] (DSSP paper Alg. 1): s_L is the guaranteed staleness, the controller
    # grants up to s_U - s_L extra iterations.
    staleness_low: int = 3
    staleness_high: int = 15
    # ElasticBSP: lookahead R (ZipLine paper §4) and the ZipLine variant used by the server.
    lookahead: int = 15
    zipline_variant: str = FASTEST_EXACT_VARIANT
    # ESync: global learning rate epsilon of Eq. 8, and slack epsilon of Alg. 2 (seconds).
    epsilon: float = 1.0
    esync_slack: float = 0.0
    esync_delayed_ack: bool = False
    # OSP: how U_max, the In-Computation Sync bound, is set: "measured" (Eq. 5 from the
    # measured aggregation rate and compute time, capped at osp_ics_max_fraction of the model,
    # Alg. 1 line 2) or "fixed" (osp_ics_max_fraction of the model); Alg. 1 schedules S(G^u)
    # within it either way.  OSP §4.1.2 caps the fraction at 0.8.
    osp_ics_size: str = "measured"
    osp_ics_max_fraction: float = 0.8
    # Reliability: a worker silent for this long is taken out of ZipLine/ESync decisions (PS) or
    # aborts the job (ring); every blocking wait has this deadline.  Both stay below 30 s so a
    # silent rank ends a default run within 30 s of the fault.  What a worker may
    # legitimately do while the others wait for it must fit in them: an evaluation or a
    # checkpoint write on worker 0, a first Numba compile of a kernel (a few seconds cold), one
    # aggregation.  Start-up (imports, data loading, the broadcasts of the initial model) has
    # ``startup_timeout`` instead.
    silent_timeout: float = 10.0
    deadline: float = 20.0
    # A thread on every worker of the torch API tells the state server every ``heartbeat_s``
    # seconds that its process and its link are up; a worker whose beats stop for
    # max(``suspect_after``, 4 x ``heartbeat_s``) is suspected at once (stopped, its node
    # down, its link cut), whatever it was doing: a slow step, an evaluation or a checkpoint
    # write still beats, so a straggler is never suspected.  0 turns the beats off (the
    # server then has ``silent_timeout`` alone).  mpsync.server.heartbeat says why these.
    heartbeat_s: float = 0.5
    suspect_after: float = 3.0
    # A worker still starting (imports, data loading, broadcasts before its first step) is not
    # silent until this long after the server started: tens of seconds on a loaded node.
    startup_timeout: float = 120.0
    # The dedicated server polls for a worker's report when it is due (its last event plus its
    # reported compute time) instead of sleeping through it: a query then costs ~0.2 ms instead
    # of ~2 ms at 5 ms iterations on a 2-core VM, for more server CPU (bench/server).
    server_wake_ahead: bool = True
    # The server answers the per-iteration messages (step, reset) from compiled code that calls
    # the MPI library directly (Open MPI), and the client's step is compiled too: a query round
    # trip 1.6-1.7x a raw ping-pong instead of 5-6x (bench/server).  Off: Python alone.
    server_fast_path: bool = True
    # Parameter server: shard servers holding the flat model, split by bytes ("auto": one
    # per node of the job, 2 on a single host; or a count >= 1).  Shards are data plane only;
    # the state server decides (mpsync.server.shards).
    ps_shards: int | str = "auto"
    # Parameter server: "worker" runs the training script's optimizer on every worker and
    # pushes the delta of its step (any torch optimizer; local steps); "server" pushes
    # gradients and the shards run SGD or Adam on one state for the job, per push or, under
    # BSP, once per round on the merged pushes (the DSSP paper's Alg. 1, MXNet's kvstore).
    # The default is measured in bench/psopt/README.md; the papers' way is a keyed departure.
    ps_optimizer: str = "worker"
    # Parameter server, workers on one node under ASP, SSP or DSSP: each worker adds its
    # pushes into the shards' weights and reads them itself through an RMA window on shared
    # memory (a compiled add under each shard's lock word, copying the sums out in the same
    # pass), with no message to the shard's thread
    # (mpsync.server.shard_window).  Off: every push and pull is a message.
    ps_one_sided: bool = True
    # Emulated network latency (seconds) added to every aggregation: each model/gradient
    # collective on the ring, each push+pull on the PS.  For experiments on one machine; 0 = off.
    comm_delay: float = 0.0
    # Emulated link rate (bytes per second) of the ring's aggregations: each allreduce takes at
    # least a ring allreduce's time over links of this rate (EmulatedLink).  For experiments on
    # one machine; 0 = off.
    comm_bandwidth: float = 0.0
    # The ring's gradient averaging (BSP): the gradients in buckets of at most this many MiB
    # (DDP's 25), each averaged from the moment backward has made its last gradient final,
    # while backward goes on (mpsync.torch.dataplane.buckets).
    bucket_mb: float = DEFAULT_BUCKET_MB
    # Off: the whole model is averaged at step(), after backward (one collective per dtype).
    overlap: bool = True
    # auto: a fixed plan of switches instead of its own decisions, "ROUND:POLICY,..." (after
    # aggregation round ROUND, run POLICY): replays a decision log, tests the switch itself.
    auto_plan: str = ""
    # auto: host the parameter server's shards beside the ring (idle threads until a switch),
    # so that auto can switch to ASP, SSP and DSSP on the PS and back; off: the ring only.
    auto_ps: bool = True
    # Modules that register policies of their own (comma-separated, ``MPSYNC_PLUGINS``),
    # imported on every rank by validate() before the policy name is looked up.
    plugins: str = ""
    extra: dict = field(default_factory=dict)
    # The policy resolved by validate(): what the server, the workers and the reports read
    # instead of looking the name up again.  Not a setting.
    choice: PolicyChoice | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if not self.topology and self.policy in policies.names():
            self.topology = policies.default_topology(self.policy)

    def validate(self) -> "SyncConfig":
        try:
            policies.load_plugins(self.plugins)
            spec = policies.get(self.policy)
            if not self.topology:
                self.topology = spec.default_topology
            _one_of("topology", self.topology, TOPOLOGIES)
            self.choice = policies.choose(self.policy, self.topology,
                                          {o: getattr(self, o) for o in spec.options})
        except PolicyError as e:
            raise ConfigError(str(e)) from None
        _one_of("backend", self.backend, BACKENDS)
        _one_of("server", self.server, SERVER_PLACEMENTS)
        _one_of("zipline_variant", self.zipline_variant, ZIPLINE_VARIANTS)
        _one_of("osp_ics_size", self.osp_ics_size, OSP_ICS_SIZES)
        _int_at_least("staleness", self.staleness, 0)
        _int_at_least("staleness_low", self.staleness_low, 0)
        _int_at_least("staleness_high", self.staleness_high, 0)
        if self.staleness_low > self.staleness_high:
            raise ConfigError(f"staleness range: s_L={self.staleness_low} > "
                              f"s_U={self.staleness_high}; give s_L <= s_U (e.g. "
                              f"--staleness-range 3,15)")
        _int_at_least("lookahead", self.lookahead, 1, what="lookahead R")
        if not self.epsilon > 0:
            raise ConfigError(f"epsilon (ESync global learning rate) must be > 0, got {self.epsilon}")
        if self.esync_slack < 0:
            raise ConfigError(f"esync_slack must be >= 0 seconds, got {self.esync_slack}")
        if not 0.0 <= self.osp_ics_max_fraction <= 0.8:
            raise ConfigError(f"osp_ics_max_fraction must be in [0, 0.8] (OSP §4.1.2), got "
                              f"{self.osp_ics_max_fraction}")
        if not self.silent_timeout > 0:
            raise ConfigError(f"silent_timeout must be > 0 seconds, got {self.silent_timeout}")
        if not (self.heartbeat_s >= 0 and math.isfinite(self.heartbeat_s)):
            raise ConfigError(f"heartbeat_s must be >= 0 seconds (0: no heartbeat), got "
                              f"{self.heartbeat_s}")
        if not (self.suspect_after > 0 and math.isfinite(self.suspect_after)):
            raise ConfigError(f"suspect_after must be > 0 seconds, got {self.suspect_after}")
        if not self.startup_timeout > 0:
            raise ConfigError(f"startup_timeout must be > 0 seconds, got {self.startup_timeout}")
        if not self.deadline > 0:
            raise ConfigError(f"deadline must be > 0 seconds, got {self.deadline}")
        self.ps_shards = parse_ps_shards(self.ps_shards)
        _check_ps_optimizer(self.ps_optimizer, self.topology, self.choice.spec)
        plan = parse_auto_plan(self.auto_plan)
        if not self.auto_ps and any(n in policies.AUTO_PS_SWITCHABLE for _, n in plan):
            raise ConfigError(f"auto_plan {self.auto_plan!r} switches to the parameter server, "
                              f"but auto_ps is off; set auto_ps=True (MPSYNC_AUTO_PS=1)")
        if not self.comm_delay >= 0:
            raise ConfigError(f"comm_delay must be >= 0 seconds, got {self.comm_delay}")
        if not self.comm_bandwidth >= 0:
            raise ConfigError(f"comm_bandwidth must be >= 0 bytes/s (0: off), got "
                              f"{self.comm_bandwidth}")
        if not (isinstance(self.bucket_mb, (int, float)) and not isinstance(self.bucket_mb, bool)
                and math.isfinite(self.bucket_mb) and self.bucket_mb > 0):
            raise ConfigError(f"bucket_mb (--bucket-mb, MPSYNC_BUCKET_MB) must be a number of "
                              f"MiB > 0 (the gradient bucket size; default "
                              f"{DEFAULT_BUCKET_MB:g}), got {self.bucket_mb!r}")
        return self

    def resolved(self) -> PolicyChoice:
        """The policy as validate() resolved it (validating now if it has not run)."""
        if self.choice is None:
            self.validate()
        return self.choice

    @classmethod
    def from_options(cls, env: dict | None = None, **options) -> "SyncConfig":
        """Build from keyword options over ``MPSYNC_*`` environment variables; unknown keys fail."""
        names = {f.name: f for f in dataclasses.fields(cls) if f.init and f.name != "extra"}
        values: dict = {}
        env = os.environ if env is None else env
        from_env: dict[str, str] = {}
        for name, f in names.items():
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is not None:
                values[name] = _coerce(name, f.type, raw)
                from_env[name] = raw
        for key, value in options.items():
            if key not in names:
                raise ConfigError(f"unknown option {key!r}; known: {', '.join(sorted(names))}")
            values[key] = value
            from_env.pop(key, None)
        try:
            return cls(**values).validate()
        except ConfigError as e:
            # A bad value that came from the environment: say which variable set it.
            culprits = [n for n in from_env if repr(values[n]) in str(e) or n in str(e)]
            if not culprits:
                raise
            where = ", ".join(f"{ENV_PREFIX}{n.upper()}={from_env[n]!r}" for n in culprits)
            raise ConfigError(f"{e} (set by {where} in the environment: fix or unset "
                              f"it)") from None

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "choice"}


def transport_unavailable(backend: str) -> str | None:
    """Why ``backend`` cannot run in this process (one line naming it), or None when it can.
    Only the process-group backends are checked here; ``mpi`` and ``horovod`` elsewhere."""
    import torch  # deferred: the configuration is read before anything heavy is imported
    import torch.distributed as dist

    if backend not in PROCESS_GROUP_BACKENDS:
        return None
    if not dist.is_available():
        return f"backend={backend!r}: this torch {torch.__version__} has no torch.distributed"
    if backend == "gloo" and not dist.is_gloo_available():
        return f"backend='gloo': this torch {torch.__version__} was built without gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            return ("backend='nccl' needs CUDA, and torch.cuda.is_available() is False on this "
                    "machine; use backend='gloo' (the same collectives on host tensors) or 'mpi'")
        if not dist.is_nccl_available():
            return (f"backend='nccl': this torch {torch.__version__} was built without NCCL; "
                    f"use backend='gloo' or 'mpi'")
    return None



def parse_auto_plan(text: str) -> list[tuple[int, str]]:
    """``"3:esync,9:bsp"`` -> [(3, "esync"), (9, "bsp")]: after round 3 ESync, after 9 BSP."""
    plan = []
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        rnd, sep, name = part.partition(":")
        known = policies.AUTO_SWITCHABLE + policies.AUTO_PS_SWITCHABLE
        if not sep or not rnd.strip().isdigit() or name.strip() not in known:
            raise ConfigError(f"auto_plan: {part!r} is not ROUND:POLICY with POLICY one of "
                              f"{', '.join(known)} (e.g. '5:esync,12:asp')")
        plan.append((int(rnd), name.strip()))
    if [r for r, _ in plan] != sorted({r for r, _ in plan}):
        raise ConfigError(f"auto_plan: rounds must increase, got {text!r}")
    return plan


def refuse_ps_plan(auto_plan: str, reason: str) -> None:
    """``auto`` goes on the ring only (``reason``: why this job cannot host the parameter
    server); a plan that names a PS policy cannot be followed, and is refused for that reason
    (not for an ``auto_ps`` the user never turned off)."""
    if any(name in policies.AUTO_PS_SWITCHABLE for _, name in parse_auto_plan(auto_plan)):
        raise ConfigError(f"auto_plan {auto_plan!r} switches to the parameter server, which "
                          f"this job cannot host: {reason}; plan ring policies only "
                          f"({', '.join(policies.AUTO_SWITCHABLE)})")


DEFAULTS = SyncConfig()


# Horovod 0.28.1's defaults for its negotiation (horovod/common/operations.cc, where the
# background thread starts: ``SetTensorFusionThresholdBytes(128 * 1024 * 1024)``,
# ``SetCycleTimeMs(1)``; horovod/common/global_state.h: ``cache_capacity = 1024``).
HOROVOD_FUSION_BYTES = 128 * 1024 * 1024
HOROVOD_CYCLE_MS = 1.0
HOROVOD_CACHE_CAPACITY = 1024


@dataclass(frozen=True)
class Negotiation:
    """How the script's collectives are negotiated (:mod:`mpsync.torch._negotiation`), from
    Horovod's own variables so that a Horovod job's settings mean the same here:

    * ``HOROVOD_FUSION_THRESHOLD`` (bytes): allreduces answered together share one buffer up
      to this size; 0 turns fusion off;
    * ``HOROVOD_CYCLE_TIME`` (milliseconds): the longest member 0 holds back a name that is
      ready while other names still wait, so that names becoming ready meanwhile share its
      buffer (a name answered alone is never held; 0: answer every burst of requests at once);
    * ``HOROVOD_CACHE_CAPACITY``: names whose negotiation is remembered (the response cache);
      0 turns the cache off.

    Horovod reads them with ``strtol`` / ``strtof``, which turn a typo into 0 (no fusion, no
    cache) without a word; here a value that is not a number >= 0 is refused, naming the
    variable and the value."""

    fusion_bytes: int = HOROVOD_FUSION_BYTES
    cycle_ms: float = HOROVOD_CYCLE_MS
    cache_capacity: int = HOROVOD_CACHE_CAPACITY

    @property
    def cycle_s(self) -> float:
        return self.cycle_ms / 1000.0

    @classmethod
    def from_env(cls, env=None) -> "Negotiation":
        env = os.environ if env is None else env
        fusion = _horovod_number(env, "HOROVOD_FUSION_THRESHOLD", int, "a whole number of bytes",
                                 cls.fusion_bytes, "0 turns fusion off; default 134217728, "
                                                   "128 MB")
        cycle = _horovod_number(env, "HOROVOD_CYCLE_TIME", float, "a number of milliseconds",
                                cls.cycle_ms, "0 never holds a ready name back; default 1")
        cache = _horovod_number(env, "HOROVOD_CACHE_CAPACITY", int, "a whole number of names",
                                cls.cache_capacity, "0 turns the response cache off; default "
                                                    "1024")
        return cls(fusion, cycle, cache)


def _horovod_number(env, var: str, kind: type, what: str, default, hint: str):
    raw = env.get(var)
    if raw is None:
        return default
    try:
        value = kind(raw.strip())
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{var}={raw!r} is not {what} >= 0 ({hint}); set one or unset it")
    return value


@dataclass(frozen=True)
class OptimizerChoice:
    """The training script's optimizer as ``mpsync train`` builds it on every worker (and,
    with ps_optimizer='server', as the shards run it: they read the same torch param groups).

    Which setting means something for which optimizer: ``momentum`` and ``nesterov`` are
    SGD's (Adam's running mean of the gradient is its beta1, torch's default 0.9, not a
    momentum); ``weight_decay`` is every one's (SGD and Adam add it to the gradient, AdamW
    decays the weights directly).  A setting given to an optimizer it means nothing to is
    refused rather than ignored.  ``None``: the optimizer's own default (momentum 0.9 for
    SGD, this project's long-standing default; weight decay torch's: 0 for SGD and Adam,
    0.01 for AdamW)."""

    kind: str = "sgd"
    lr: float = 0.05
    momentum: float | None = None
    nesterov: bool = False
    weight_decay: float | None = None

    def validate(self) -> "OptimizerChoice":
        if self.kind not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {self.kind!r} (--optimizer, "
                              f"MPSYNC_OPTIMIZER); choose one of: {', '.join(OPTIMIZERS)}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"--lr must be > 0, got {self.lr}")
        if self.kind != "sgd" and self.momentum is not None:
            raise ConfigError(f"--momentum is SGD's; {self.kind} keeps a running mean of the "
                              f"gradient (beta1 0.9) instead: drop --momentum or use "
                              f"--optimizer sgd")
        if self.kind != "sgd" and self.nesterov:
            raise ConfigError(f"--nesterov is SGD's (Nesterov momentum); {self.kind} has none: "
                              f"drop --nesterov or use --optimizer sgd")
        if self.momentum is not None and not (math.isfinite(self.momentum)
                                              and 0 <= self.momentum < 1):
            raise ConfigError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.nesterov and self.resolved_momentum == 0:
            raise ConfigError("--nesterov needs a momentum > 0 (--momentum 0 given)")
        if self.weight_decay is not None and not (math.isfinite(self.weight_decay)
                                                  and self.weight_decay >= 0):
            raise ConfigError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        return self

    @property
    def resolved_momentum(self) -> float | None:
        """SGD's momentum (0.9 unless given); None for Adam and AdamW."""
        if self.kind != "sgd":
            return None
        return 0.9 if self.momentum is None else float(self.momentum)

    @property
    def resolved_weight_decay(self) -> float:
        if self.weight_decay is not None:
            return float(self.weight_decay)
        return 1e-2 if self.kind == "adamw" else 0.0

    def torch_kwargs(self) -> dict:
        """The keyword arguments of the torch.optim class ``kind`` names (``torch_class``)."""
        kw = {"lr": float(self.lr), "weight_decay": self.resolved_weight_decay}
        if self.kind == "sgd":
            kw.update(momentum=self.resolved_momentum, nesterov=bool(self.nesterov))
        return kw

    @property
    def torch_class(self) -> str:
        """The name of the class in torch.optim."""
        return {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}[self.kind]

    def to_dict(self) -> dict:
        """What the run's metrics record: every setting as the optimizer ran it."""
        return {"optimizer": self.kind, "lr": float(self.lr),
                "momentum": self.resolved_momentum,
                "nesterov": bool(self.nesterov) if self.kind == "sgd" else None,
                "weight_decay": self.resolved_weight_decay}


def optimizer_choice(kind: str | None, lr: float, momentum: float | None = None,
                     nesterov: bool = False, weight_decay: float | None = None,
                     env=None) -> OptimizerChoice:
    """The optimizer the flags describe, validated; no ``kind``: ``MPSYNC_OPTIMIZER``, else
    SGD.  A bad ``MPSYNC_OPTIMIZER`` is named as the variable that set it."""
    if kind is None:
        raw = (os.environ if env is None else env).get(ENV_PREFIX + "OPTIMIZER")
        if raw is not None and raw.strip().lower() not in OPTIMIZERS:
            raise ConfigError(f"{ENV_PREFIX}OPTIMIZER={raw!r} is not an optimizer; set it to "
                              f"one of {', '.join(OPTIMIZERS)} or unset it")
        kind = raw.strip().lower() if raw is not None else OptimizerChoice.kind
    return OptimizerChoice(kind=kind, lr=lr, momentum=momentum, nesterov=bool(nesterov),
                           weight_decay=weight_decay).validate()


def parse_float_list(name: str, text: str, length: int | None = None) -> list[float]:
    """Parse ``"1,1,2,4"``; the error names ``name``."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{name}: expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise ConfigError(f"{name}: empty list")
    if length is not None and len(values) != length:
        raise ConfigError(f"{name}: {len(values)} values for {length} workers ({text!r}); "
                          f"give one per worker")
    return values


def parse_ps_shards(value) -> int | str:
    """``ps_shards`` as ``"auto"`` or an int >= 1 (from an int, or text from the CLI or
    ``MPSYNC_PS_SHARDS``); anything else is a :class:`ConfigError` naming the setting."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return "auto"
        if text.lstrip("+-").isdigit():
            value = int(text)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"ps_shards (--ps-shards, MPSYNC_PS_SHARDS) must be 'auto' or an "
                          f"integer >= 1 (the number of parameter-server shards), got {value!r}")
    return value


def parse_staleness_range(text: str, flag: str = "--staleness-range") -> tuple[int, int]:
    """``"sL,sU"`` -> (sL, sU), two integers; the range itself is checked by validate()."""
    try:
        low, high = (int(x) for x in str(text).split(","))
    except ValueError:
        raise ConfigError(f"{flag}: expected sL,sU integers (e.g. 3,15), got {text!r}") from None
    return low, high


def parse_number(name: str, text: str, kind: type = float, *, at_least: float | None = None):
    """``kind(text)`` (int or float), at least ``at_least``; the error names ``name``."""
    what = "an integer" if kind is int else "a number"
    try:
        value = kind(text)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: {text!r} is not {what}") from None
    if at_least is not None and not value >= at_least:
        raise ConfigError(f"{name} must be >= {at_least:g}, got {value:g}")
    return value


def _check_ps_optimizer(value, topology: str, spec) -> None:
    if value not in PS_OPTIMIZERS:
        raise ConfigError(f"ps_optimizer (--ps-optimizer, MPSYNC_PS_OPTIMIZER) must be one of "
                          f"{', '.join(PS_OPTIMIZERS)}, got {value!r}")
    if value != "server":
        return
    if spec.name == policies.AUTO:
        raise ConfigError("ps_optimizer='server' (--ps-optimizer, MPSYNC_PS_OPTIMIZER) cannot "
                          "run under policy='auto': its workers move between the ring and the "
                          "parameter server each with its own optimizer state; use "
                          "ps_optimizer='worker' (the default)")
    if topology != "ps":
        raise ConfigError(f"ps_optimizer='server' runs the optimizer on the parameter server's "
                          f"shards and needs topology='ps' (got {topology!r}); use "
                          f"ps_optimizer='worker'")
    if not spec.ps_server_optimizer:
        raise ConfigError(f"ps_optimizer='server': policy={spec.name!r} does not push a "
                          f"gradient every iteration (its workers run local iterations with "
                          f"their own optimizer between pushes); use ps_optimizer='worker'")


def _one_of(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"unknown {name} {value!r}; choose one of: {', '.join(allowed)}")


def _int_at_least(name: str, value, low: int, what: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{what or name} must be an integer >= {low}, got {value!r}")


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_bool(name: str, text: str) -> bool:
    """``text`` as a boolean, strictly: one of 1/0, true/false, yes/no, on/off (any case);
    anything else is a ConfigError naming ``name`` (a typo must not silently mean false)."""
    value = str(text).strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={text!r} is not a boolean; set it to 1 or 0 (true/false, "
                      f"yes/no, on/off), or unset it")


def debug_enabled(environ=None) -> bool:
    """``MPSYNC_DEBUG``: show every traceback.  Read leniently (any other text is off): it is
    what decides how the error about a bad setting is shown."""
    value = (os.environ if environ is None else environ).get(ENV_PREFIX + "DEBUG", "")
    return value.strip().lower() in _TRUE


def print_user_error(prog: str, exc: BaseException) -> None:
    """``PROG: error: <exc>`` on stderr, one line; its traceback before it with
    ``MPSYNC_DEBUG=1`` (``mpsync --debug``)."""
    if debug_enabled():
        traceback.print_exception(exc)
    print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)


def check_output_dir(flag: str, path: str) -> None:
    """``path`` is, or can be made as, a directory we can write in (a file is written and
    removed in it, or in its nearest existing parent; nothing is left behind).  Checked before
    any rank starts, so a bad ``--out`` is one line instead of a traceback after the run."""
    here = os.path.abspath(path)
    while not os.path.exists(here):
        parent = os.path.dirname(here)
        if parent == here:
            break
        here = parent
    if not os.path.isdir(here):
        raise ConfigError(f"{flag} {path}: {here} is a file, not a directory; give a directory "
                          f"path (it is created if missing)")
    try:   # root passes every access() check: only writing tells (a read-only mount, /proc)
        with tempfile.TemporaryFile(dir=here):
            pass
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot write there ({e.strerror}); give a "
                          f"directory you can write to") from None


def _coerce(name: str, type_, raw: str):
    t = type_ if isinstance(type_, str) else getattr(type_, "__name__", str(type_))
    var = f"{ENV_PREFIX}{name.upper()}"
    if t == "bool":
        return parse_bool(var, raw)
    kind = {"int": int, "float": float}.get(t)
    if kind is None:
        return raw
    try:
        value = kind(raw)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ConfigError(f"{var}={raw!r} is not {what}; set it to {what} (default "
                          f"{getattr(DEFAULTS, name)!r}) or unset it") from None
    if kind is float and not math.isfinite(value):
        raise ConfigError(f"{var}={raw!r} is not a finite number; set a number or unset it")
    return value
