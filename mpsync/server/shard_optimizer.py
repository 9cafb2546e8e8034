"""The parameter server's own optimizer: SGD or Adam state for one contiguous range of the flat
model, applied on the shard that holds that range.  Pure numpy: no MPI, no torch.

Why on the server.  In the DSSP paper (Alg. 1: a worker pushes its gradient g, the server
"updates the server weights with g") and in the MXNet kvstore the SSP, DSSP and ElasticBSP
experiments ran on (``update_on_kvstore``), workers push gradients and the server runs the
optimizer: one optimizer state for the whole job.  A worker that runs its own optimizer and
pushes the delta of its step computes the same model only where the step is linear in the
gradient and stateless across workers: SGD (with momentum and weight decay) under BSP.  The mean
of per-worker Adam steps is not an Adam step on the mean gradient, and under ASP, SSP and DSSP
each worker's own momentum or moment estimates differ from the server's single state for any
optimizer that has state.

When the server applies it (``ShardOptimizer``):

* per push (ASP, SSP, DSSP, ElasticBSP within a superstep): :meth:`ShardOptimizer.step` with
  each worker's gradient as it arrives, as MXNet's asynchronous kvstore does;
* once per round (BSP, the synchronous kvstore): ``ServerUpdates`` keeps each push of the
  round, and :meth:`ShardOptimizer.step_on` runs one step on their mean before the round's
  weights are read: the sum over the n workers (``ServerUpdates.scale``),
  which with equal mini-batches is the gradient of the workers' batches concatenated, so a
  BSP round is one step of single-process training on that batch.

The arithmetic follows ``torch.optim.SGD`` and ``torch.optim.Adam`` / ``AdamW`` as documented
(their algorithm boxes), element-wise over the range, with the state in the weights' dtype;
the tests compare the two on the same numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Mapping

import numpy as np

__all__ = ["OptimizerSettings", "ShardOptimizer", "ServerUpdates", "KINDS",
           "settings_from_group", "settings_of", "UnsupportedOptimizer", "STATE_BUFFERS",
           "pack_state", "unpack_state", "step_pass", "step_settings", "STEP_SGD", "STEP_ADAM"]

# The optimizers a shard can run, by the lower-cased name of the torch class they mirror.
KINDS = ("sgd", "adam", "adamw")
# The state a checkpoint keeps, by name: SGD's momentum buffer or Adam's first moment, Adam's
# second moment, amsgrad's maximum of it (``ShardOptimizer`` attributes ``_<name>``).
STATE_BUFFERS = ("momentum", "second", "max_second")
# A packed state starts with 4 int64: the kind's index in KINDS (-1: no state), the steps
# taken, which of STATE_BUFFERS follow (bit i), and 0.
_STATE_HEADER = 4


class UnsupportedOptimizer(ValueError):
    """An optimizer, or an option of one, that the shards cannot run; the message names it
    and the way out (the workers' own optimizer)."""


@dataclass(frozen=True)
class OptimizerSettings:
    """The hyperparameters of one server-side optimizer (torch's names and defaults).

    Travels to the shards as :meth:`to_array` (a fixed-length float64 vector); a learning-rate
    schedule sends it again with the new values, and the shard keeps its state."""

    kind: str = "sgd"
    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    amsgrad: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise UnsupportedOptimizer(f"server-side optimizer {self.kind!r}: the shards run "
                                       f"{', '.join(KINDS)}")
        for name in ("lr", "momentum", "dampening", "weight_decay", "eps"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise UnsupportedOptimizer(f"server-side optimizer: {name} must be a finite "
                                           f"number >= 0, got {value!r}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UnsupportedOptimizer(f"server-side optimizer: {name} must be in [0, 1), "
                                           f"got {getattr(self, name)!r}")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise UnsupportedOptimizer("server-side optimizer: nesterov needs momentum > 0 and "
                                       "dampening 0 (as torch.optim.SGD)")

    def to_array(self) -> np.ndarray:
        values = [KINDS.index(self.kind)] + [float(getattr(self, f.name))
                                             for f in fields(self)[1:]]
        return np.array(values, dtype=np.float64)

    @classmethod
    def from_array(cls, array: np.ndarray) -> "OptimizerSettings":
        """The inverse of :meth:`to_array`; a malformed vector is an ``UnsupportedOptimizer``."""
        names = [f.name for f in fields(cls)]
        if array.shape != (len(names),) or not np.all(np.isfinite(array)):
            raise UnsupportedOptimizer(f"optimizer settings: expected {len(names)} finite "
                                       f"numbers, got {array.size}")
        code = int(array[0])
        if not 0 <= code < len(KINDS) or code != array[0]:
            raise UnsupportedOptimizer(f"optimizer settings: unknown kind code {array[0]!r}")
        values = {"kind": KINDS[code]}
        for f, v in zip(fields(cls)[1:], array[1:]):
            values[f.name] = bool(v) if f.type in ("bool", bool) else float(v)
        return cls(**values)


# Options of torch's SGD / Adam / AdamW that change the arithmetic and that the shards do not
# implement; a group with one of them set is refused rather than run differently.
_REFUSED_OPTIONS = ("maximize", "differentiable")
# What each kind reads from a torch param group (torch's option name -> ours).
_READS = {"sgd": {"lr": "lr", "momentum": "momentum", "dampening": "dampening",
                  "nesterov": "nesterov", "weight_decay": "weight_decay"},
          "adam": {"lr": "lr", "eps": "eps", "weight_decay": "weight_decay",
                   "amsgrad": "amsgrad"},
          }
_READS["adamw"] = _READS["adam"]


def settings_from_group(kind: str, group: Mapping) -> OptimizerSettings:
    """The settings of a torch optimizer of class ``kind`` (``type(opt).__name__.lower()``)
    from one of its ``param_groups``; an :class:`UnsupportedOptimizer` names what the shards
    cannot run."""
    kind = kind.lower()
    if kind not in KINDS:
        raise UnsupportedOptimizer(f"the server-side optimizer runs torch.optim.SGD, Adam or "
                                   f"AdamW on the shards, not {kind!r}; use "
                                   f"ps_optimizer='worker' to run it on the workers")
    if kind == "adam" and group.get("decoupled_weight_decay"):
        kind = "adamw"   # torch's Adam(decoupled_weight_decay=True) is AdamW
    for option in _REFUSED_OPTIONS:
        if group.get(option):
            raise UnsupportedOptimizer(f"the server-side {kind} does not implement "
                                       f"{option}=True; use ps_optimizer='worker'")
    lr = group.get("lr", OptimizerSettings.lr)
    if not isinstance(lr, (int, float)):      # a tensor learning rate (capturable Adam)
        lr = float(lr)
    values = {ours: group[theirs] for theirs, ours in _READS[kind].items() if theirs in group}
    values["lr"] = float(lr)
    if kind != "sgd" and "betas" in group:
        values["beta1"], values["beta2"] = (float(b) for b in group["betas"])
    if kind == "adamw" and "weight_decay" not in group:
        values["weight_decay"] = 1e-2   # torch.optim.AdamW's default
    return OptimizerSettings(kind=kind, **{k: (bool(v) if k in ("nesterov", "amsgrad")
                                               else float(v)) for k, v in values.items()})


def settings_of(kind: str, groups) -> OptimizerSettings:
    """The one set of settings of a torch optimizer's ``param_groups``: the shards hold the
    flat model as ranges that cut across groups, so every group must agree."""
    settings = [settings_from_group(kind, g) for g in groups]
    if any(s != settings[0] for s in settings[1:]):
        raise UnsupportedOptimizer(f"the server-side optimizer takes one set of "
                                   f"hyperparameters; this {kind} has param groups that differ "
                                   f"({len(settings)} groups); use ps_optimizer='worker'")
    return settings[0]


class ShardOptimizer:
    """One optimizer's state over ``size`` elements of ``dtype``, stepping a weights array of
    that size in place: :meth:`step` per push, :meth:`step_on` on a round's sum (module
    doc)."""

    def __init__(self, settings: OptimizerSettings, size: int, dtype=np.float64):
        self.settings = settings
        self.size = int(size)
        self.dtype = np.dtype(dtype)
        self.steps = 0                 # Adam's t (bias correction); SGD counts too
        self._momentum: np.ndarray | None = None   # SGD's buffer / Adam's first moment
        self._second: np.ndarray | None = None     # Adam's second moment
        self._max_second: np.ndarray | None = None  # amsgrad
        self._g: np.ndarray | None = None          # scratch: the gradient as stepped
        self._none: np.ndarray | None = None       # an argument ``step_pass`` does not read
        self._vector = step_settings(settings)

    def configure(self, settings: OptimizerSettings) -> None:
        """New hyperparameters (a learning-rate schedule); the state stays.  Changing the kind
        would leave state of the wrong meaning: refused."""
        if settings.kind != self.settings.kind:
            raise UnsupportedOptimizer(f"server-side optimizer: cannot change from "
                                       f"{self.settings.kind} to {settings.kind} mid-run")
        self.settings = settings
        self._vector = step_settings(settings)

    def _buffer(self, name: str) -> np.ndarray:
        buf = getattr(self, name)
        if buf is None:
            buf = np.zeros(self.size, dtype=self.dtype)
            setattr(self, name, buf)
        return buf

    def _check(self, array: np.ndarray, what: str) -> None:
        if array.shape != (self.size,):
            raise ValueError(f"{what} of {array.size} elements for a range of {self.size}")

    def step_on(self, weights: np.ndarray, grad: np.ndarray) -> None:
        """:meth:`step` with a gradient it may overwrite (a sum made for the step)."""
        self._check(grad, "gradient")
        self._step(weights, grad)

    def step(self, weights: np.ndarray, grad: np.ndarray) -> None:
        """One optimizer step of ``weights`` (in place) with ``grad`` (any float dtype; not
        modified)."""
        self._check(grad, "gradient")
        g = self._buffer("_g")
        np.copyto(g, grad, casting="unsafe")
        self._step(weights, g)

    def _step(self, weights: np.ndarray, g: np.ndarray) -> None:
        """The step with ``g``, which it may overwrite (a scratch or the pending sum)."""
        self._check(weights, "weights")
        self.steps += 1
        s = self.settings
        # torch.optim.SGD: g += wd·w; b = μ·b + (1-τ)·g (b = g the first time);
        # g = g + μ·b (Nesterov) or b; w -= lr·g.
        # torch.optim.Adam / AdamW: (AdamW: w *= 1 - lr·wd; Adam: g += wd·w);
        # m = β1·m + (1-β1)·g; v = β2·v + (1-β2)·g²; (amsgrad: v̂ = max(v̂, v));
        # w -= lr/(1-β1^t) · m / (sqrt(v)/sqrt(1-β2^t) + eps).  One compiled pass.
        first = bool(s.kind == "sgd" and s.momentum and self._momentum is None)
        code, vector, m, v, vmax = self._pass_arguments(weights)
        step_pass(code, weights, weights, g, m, v, vmax, vector, self.steps, first)

    def _pass_arguments(self, weights: np.ndarray):
        """``step_pass``'s kind, settings and state buffers (made here where missing; an
        argument the kind does not read is ``weights``, for its type alone)."""
        s = self.settings
        if s.kind == "sgd":
            m = self._buffer("_momentum") if s.momentum else weights
            return STEP_SGD, self._vector, m, weights, weights
        m, v = self._buffer("_momentum"), self._buffer("_second")
        return STEP_ADAM, self._vector, m, v, (self._buffer("_max_second") if s.amsgrad else v)

    def compiled_form(self):
        """``(kind, settings, m, v, vmax)`` for a compiled loop to take the next step as
        :meth:`step` would (``step_pass`` on the steps counted after this one), or None while
        that step would make state (SGD's first with momentum, Adam's first): those are
        :meth:`step`'s.  The buffers are this optimizer's own, stepped in place."""
        s = self.settings
        if s.kind == "sgd" and s.momentum and self._momentum is None:
            return None
        if s.kind != "sgd" and (self._second is None or (s.amsgrad and self._max_second is None)):
            return None
        if s.kind == "sgd":
            m = self._momentum if s.momentum else self._empty()
            return STEP_SGD, self._vector, m, self._empty(), self._empty()
        vmax = self._max_second if s.amsgrad else self._second
        return STEP_ADAM, self._vector, self._momentum, self._second, vmax

    def _empty(self) -> np.ndarray:
        if self._none is None:
            self._none = np.empty(0, self.dtype)
        return self._none

    def export(self) -> dict[str, np.ndarray]:
        """The state that outlives a checkpoint, by ``STATE_BUFFERS`` name (the buffers the
        optimizer has made so far; not copies)."""
        return {name: getattr(self, "_" + name) for name in STATE_BUFFERS
                if getattr(self, "_" + name) is not None}

    def load(self, steps: int, buffers: Mapping[str, np.ndarray]) -> None:
        """Continue from an exported state: ``steps`` taken, ``buffers`` copied in."""
        for name, array in buffers.items():
            if name not in STATE_BUFFERS:
                raise ValueError(f"unknown optimizer state {name!r}")
            self._check(array, name)
            np.copyto(self._buffer("_" + name), array, casting="unsafe")
        self.steps = int(steps)

    def state_bytes(self) -> int:
        """Bytes of optimizer state held (its scratch included)."""
        held = [self._momentum, self._second, self._max_second, self._g]
        return sum(b.nbytes for b in held if b is not None)


def pack_state(kind: str | None, steps: int, buffers: Mapping[str, np.ndarray], size: int,
               dtype) -> np.ndarray:
    """One range's optimizer state as bytes (how it travels between a shard and a worker):
    the header, then each buffer present in ``STATE_BUFFERS`` order, ``size`` elements of
    ``dtype`` each.  ``kind`` None: no state (the header alone)."""
    dtype = np.dtype(dtype)
    names = [n for n in STATE_BUFFERS if n in buffers] if kind is not None else []
    header = np.array([KINDS.index(kind) if kind is not None else -1, int(steps),
                       sum(1 << STATE_BUFFERS.index(n) for n in names), 0], dtype=np.int64)
    out = np.empty(header.nbytes + len(names) * size * dtype.itemsize, dtype=np.uint8)
    out[:header.nbytes] = header.view(np.uint8)
    for i, name in enumerate(names):
        start = header.nbytes + i * size * dtype.itemsize
        np.copyto(out[start:start + size * dtype.itemsize].view(dtype), buffers[name],
                  casting="unsafe")
    return out


def unpack_state(packed: np.ndarray, dtype, size: int | None = None):
    """The inverse of :func:`pack_state`: ``(kind or None, steps, {name: array})``, the arrays
    views of ``packed`` (``size`` None: as long as the bytes say; given, ``packed`` may be
    longer: a receive buffer's unused end); a ``ValueError`` says what does not fit."""
    dtype = np.dtype(dtype)
    packed = np.asarray(packed).view(np.uint8)
    if packed.nbytes < 8 * _STATE_HEADER:
        raise ValueError(f"optimizer state of {packed.nbytes} bytes, less than its header")
    code, steps, present, _ = (int(v) for v in packed[:8 * _STATE_HEADER].view(np.int64))
    if code == -1:
        return None, 0, {}
    if not 0 <= code < len(KINDS) or steps < 0 or present >> len(STATE_BUFFERS):
        raise ValueError(f"optimizer state with a malformed header ({code}, {steps}, "
                         f"{present})")
    names = [n for i, n in enumerate(STATE_BUFFERS) if present >> i & 1]
    given = size is not None
    if not given:
        body = packed.nbytes - 8 * _STATE_HEADER
        size = body // (len(names) * dtype.itemsize) if names else 0
    expected = 8 * _STATE_HEADER + len(names) * size * dtype.itemsize
    if packed.nbytes != expected and not (given and packed.nbytes > expected):
        raise ValueError(f"optimizer state of {packed.nbytes} bytes for a range of {size} "
                         f"{dtype} elements ({expected} expected)")
    body = packed[8 * _STATE_HEADER:expected].view(dtype)
    return KINDS[code], steps, {n: body[i * size:(i + 1) * size] for i, n in enumerate(names)}


class ServerUpdates:
    """A shard's updates under ``ps_optimizer='server'``: the settings the workers send, and
    each pushed gradient stepped (``per_round`` False) or kept until its round is stepped on
    (``per_round``: :meth:`settle` before a pull is served).  The shard's weights array is
    passed in; the shard counts the versions.  Every method returns None or why it refused,
    in which case the weights are as they were.

    Rounds (``per_round``, BSP).  The state server grants a pull of round R once every
    worker in the computation has pushed R times, and tells the puller R and the workers
    whose pushes round R leaves out (``ShardClient.pull``'s ``round_`` and ``excluded``:
    those that had not pushed R times when the round's first pull was granted -- taken out
    for silence, joined, gone).  Every shard steps on the same pushes: the first pull of
    round R that reaches a shard steps once on the pushes it holds of every worker but the
    left-out ones, and later pulls of R (and any pull of an older round) read the weights as
    they are.  A worker's pushes are kept apart (summed per worker) until a round takes
    them, so a round can leave one out whenever it came:

    * a push of a worker taken out for silence that reaches one shard before the others'
      pulls of the round and another after them stays out of that round on both, and goes
      into the next round that counts it (it was the window in which the shards of one
      parameter server stepped on different rounds: tests/test_ps_round_windows.py);
    * a worker pushes the next round only after its pull of this one returned from every
      shard, and every worker's push of a round is in on every shard before the state
      server counts it (the push is ACKed first), so a round's first pull finds every push
      it counts, and no push of a later round of a worker it counts.

    A pull with round 0 (a worker's first, before any push; a joined worker's last; a pull
    told no round) steps on nothing.  An empty push (an idle iteration: the worker waits in a
    collective of the script's own) and a worker's last push (``final``, sent to no shard)
    add nothing; the state server counts them.  The memory: a slice per worker whose push
    is waiting for its round (the pushes of one round, at most n slices).

    ``scale`` (per round): a round's step is on the sum of its pushes times ``scale``, the
    policy's ``PolicySpec.ps_update_scale`` (1/n for BSP), whoever pushed; None: the mean
    over the pushes merged.  As Horovod's join, where a joined rank adds zeros and an
    average divides by the size of the process set (the allreduce's postscale factor is
    1/size whoever joined): a worker that joined or idles contributes nothing and still
    counts, as on the ring (``Strategy._divisor``) and as with the workers' own optimizer
    (each delta scaled by 1/n on arrival), so the three agree after a join.

    The work: a push is received into the array that keeps it (``inbox``) and added into a
    running sum on arrival, so the round's first pull waits only for the step, as when the
    pushes were merged per round; only a round that leaves out a push already here sums its
    pushes again, in the workers' order (a fault's path)."""

    def __init__(self, per_round: bool, scale: float | None = None):
        self.per_round = bool(per_round)
        self.scale = None if scale is None else float(scale)
        self.settings: OptimizerSettings | None = None
        self.optimizer: ShardOptimizer | None = None
        self.kept: dict[int, list] = {}     # worker -> [its pushes summed, how many]
        self._spare: list[np.ndarray] = []  # kept sums a round took, for reuse
        self._inbox: np.ndarray | None = None   # where the next push may be received
        self._sum: np.ndarray | None = None    # every kept push, summed on arrival
        self.stepped = 0                    # the last round stepped on
        self._restored = None               # (kind, steps, buffers) for the first push

    def configure(self, wire: np.ndarray) -> str | None:
        """Settings as :meth:`OptimizerSettings.to_array` sent them (float64)."""
        try:
            settings = OptimizerSettings.from_array(np.asarray(wire, dtype=np.float64))
            if self.optimizer is not None:
                self.optimizer.configure(settings)
        except UnsupportedOptimizer as e:
            return str(e)
        self.settings = settings
        return None

    def take(self, weights: np.ndarray, grad: np.ndarray, worker: int) -> str | None:
        """Worker ``worker``'s pushed gradient for this range: stepped on, or kept for its
        round; an empty one adds nothing (class doc)."""
        if grad.size == 0:
            return None
        if self.settings is None:
            return "a gradient before the optimizer's settings"
        if weights is None or grad.shape != weights.shape:
            return "push before ps_init or of the wrong length"
        if not np.all(np.isfinite(grad)):
            return "push with NaN or inf"
        if self.optimizer is None:
            problem = self._start(weights)
            if problem:
                return problem
        if not self.per_round:
            self.optimizer.step(weights, grad)
            return None
        entry = self.kept.get(worker)
        inbox = self._inbox
        if entry is None and inbox is not None and grad.dtype == inbox.dtype \
                and grad.size == inbox.size and grad.ctypes.data == inbox.ctypes.data:
            self.kept[worker], self._inbox = [inbox, 1], None   # received into: kept as it is
        elif entry is None:
            kept = self._buffer(weights)
            np.copyto(kept, grad, casting="unsafe")
            self.kept[worker] = [kept, 1]
        else:   # a push a round left out, and the worker's next one: both in its next round
            entry[0] += grad
            entry[1] += 1
        # The sum of everything kept, added on arrival: a round that leaves no kept push out
        # (every round but those after a worker was taken out) steps on it as it is.
        if self._sum is None:
            self._sum = self._buffer(weights)
            np.copyto(self._sum, grad, casting="unsafe")
        else:
            self._sum += grad
        return None

    def _buffer(self, weights: np.ndarray) -> np.ndarray:
        spare = self._spare.pop() if self._spare else None
        if spare is None or spare.shape != weights.shape or spare.dtype != weights.dtype:
            spare = np.empty_like(weights)
        return spare

    def inbox(self, worker: int, weights: np.ndarray) -> np.ndarray | None:
        """Per round: an array (the weights' size and dtype) to receive ``worker``'s next
        push into, which :meth:`take` then keeps as it is instead of copying it, where the
        worker has no push kept; else None (receive it anywhere)."""
        if not self.per_round or self.optimizer is None or worker in self.kept:
            return None
        inbox = self._inbox
        if inbox is None or inbox.shape != weights.shape or inbox.dtype != weights.dtype:
            inbox = self._inbox = self._buffer(weights)
        return inbox

    def compiled_form(self):
        """The next push's step for a compiled loop (:meth:`ShardOptimizer.compiled_form`),
        or None where :meth:`take` must have it: once per round, before the settings, at the
        first push (which makes the optimizer) and while a step would make state."""
        if self.per_round or self.settings is None or self.optimizer is None:
            return None
        return self.optimizer.compiled_form()

    @property
    def pending(self) -> bool:
        """Pushes kept and not yet stepped on."""
        return bool(self.kept)

    def _taken(self, round_: int | None, excluded) -> list[int]:
        """The workers whose kept pushes :meth:`settle` steps on (class doc)."""
        if not self.per_round or self.optimizer is None:
            return []
        if round_ is None:
            return sorted(self.kept)
        if round_ <= self.stepped:
            return []
        out = set(int(x) for x in excluded)
        return sorted(w for w in self.kept if w not in out)

    def due(self, round_: int | None = 0, excluded=()) -> bool:
        """Would :meth:`settle` change the weights?"""
        return bool(self._taken(round_, excluded))

    def settle(self, weights: np.ndarray, round_: int | None = 0, excluded=()) -> int:
        """Before a pull of round ``round_`` reads the weights: at the round's first pull
        here, one step on the kept pushes of every worker but the ``excluded`` ones
        (``None``: on every push kept, when every worker's pushes are in: a checkpoint, the
        end); how many steps (0 or 1)."""
        taken = self._taken(round_, excluded)
        if round_ is not None and round_ > self.stepped:
            self.stepped = round_
        if not taken:
            return 0
        left = [w for w in self.kept if w not in taken]
        total = self._sum
        if left:
            # A round that leaves out a kept push (a worker taken out whose push came before
            # the round's first pull here): its sum again from the pushes it takes, in the
            # workers' order, and the sum of those it leaves for the next round.
            total = self._buffer(weights)
            np.copyto(total, self.kept[taken[0]][0])
            for w in taken[1:]:
                total += self.kept[w][0]
            np.copyto(self._sum, self.kept[left[0]][0])
            for w in left[1:]:
                self._sum += self.kept[w][0]
        else:
            self._sum = None
        count = 0
        for w in taken:
            kept, pushes = self.kept.pop(w)
            count += pushes
            self._spare.append(kept)
        factor = 1.0 / count if self.scale is None else self.scale
        if factor != 1.0:
            total *= factor
        self.optimizer.step_on(weights, total)
        self._spare.append(total)
        return 1

    def _start(self, weights: np.ndarray) -> str | None:
        """The optimizer, at the first push: from the restored state if there is one."""
        optimizer = ShardOptimizer(self.settings, weights.size, weights.dtype)
        if self._restored is not None:
            kind, steps, buffers = self._restored
            if kind != self.settings.kind:
                return (f"the optimizer state restored is {kind}'s, but the workers run "
                        f"{self.settings.kind}")
            try:
                optimizer.load(steps, buffers)
            except ValueError as e:
                return f"the optimizer state restored does not fit this range: {e}"
            self._restored = None
        self.optimizer = optimizer
        return None

    def save(self, weights: np.ndarray) -> np.ndarray:
        """The optimizer's state, packed (:func:`pack_state`), for a checkpoint taken when
        every worker's pushes are in: the pushes kept are stepped on first."""
        if self.optimizer is None:
            kind, steps, buffers = self._restored or (None, 0, {})
            return pack_state(kind, steps, buffers, weights.size, weights.dtype)
        self.settle(weights, None)
        return pack_state(self.settings.kind, self.optimizer.steps, self.optimizer.export(),
                          weights.size, weights.dtype)

    def restore(self, packed: np.ndarray, dtype) -> str | None:
        """A saved state (:meth:`save`, its arrays in ``dtype``) to continue from, before the
        first push (the weights may not be there yet; the sizes are checked at that push)."""
        if self.optimizer is not None:
            return "optimizer state after the first push (it must come before any)"
        try:
            kind, steps, buffers = unpack_state(packed, dtype)
        except ValueError as e:
            return str(e)
        self._restored = (None if kind is None else
                          (kind, steps, {n: a.copy() for n, a in buffers.items()}))
        return None


# -- the steps, compiled ----------------------------------------------------------------------
# One pass over the range per step where numpy made 6-12 (each operation a pass, through
# scratch buffers); element by element the same operations in the same order and dtype as
# those numpy calls were (the scalars rounded to the weights' dtype first, as numpy rounds a
# Python float against an array), so the result is the same to the bit
# (tests/test_shard_optimizer.py compares with torch.optim).  Without the interpreter's lock:
# the trainer on the shard's rank runs meanwhile.
import numba  # noqa: E402

import mpsync.sched._numba  # noqa: E402,F401  (mpsync's stamped cache for these kernels)

# error_model="numpy": a division by zero gives inf or NaN, as numpy's does, with no check per
# element (Python's model raises, and its check keeps the loop from being vectorized).
_kernel = numba.njit(cache=True, nogil=True, error_model="numpy")


# ``step_pass``'s kinds (a compiled loop's codes for them too: ``_shard_loop``).
STEP_SGD, STEP_ADAM = 1, 2


def step_settings(s: OptimizerSettings) -> np.ndarray:
    """``s`` as ``step_pass`` reads it, float64: SGD [wd, μ, 1-τ, lr, nesterov]; Adam and
    AdamW [lr, wd, β1, β2, eps, decay (0 none, 1 Adam's on the gradient, 2 AdamW's on the
    weights), amsgrad]."""
    if s.kind == "sgd":
        return np.array([s.weight_decay, s.momentum, 1.0 - s.dampening, s.lr, s.nesterov],
                        np.float64)
    decay = 0 if not s.weight_decay else (2 if s.kind == "adamw" else 1)
    return np.array([s.lr, s.weight_decay, s.beta1, s.beta2, s.eps, decay, s.amsgrad],
                    np.float64)


@_kernel
def step_pass(kind, w, out, g, m, v, vmax, settings, steps, first):
    """One optimizer step: ``out`` = the weights ``w`` stepped with the gradient ``g`` (``out``
    may be ``w``: in place), the state ``m``, ``v``, ``vmax`` updated in place; ``steps`` the
    steps taken with this one (Adam's t), ``first`` SGD's first step with momentum.  The
    scalars are computed in float64 as ``ShardOptimizer`` once did in Python, then rounded to
    the weights' dtype.  The same function serves ``ShardOptimizer`` and the shard's
    compiled loop, so the two step to the same bits.

    Out of place, the weights are copied to ``out`` and stepped there in place: a pass that
    read ``w`` and wrote ``out`` itself took 2.9x the time for Adam and 1.9x for SGD (1.1 M
    float32), most likely no longer vectorized with one more array that might overlap."""
    if out.ctypes.data != w.ctypes.data:
        out[:] = w
    w = out
    if kind == STEP_SGD:
        numbers = np.empty(4, w.dtype)
        for i in range(4):
            numbers[i] = settings[i]
        _sgd_pass(w, g, m, numbers, settings[0] != 0, settings[1] != 0, first,
                  settings[4] != 0)
        return
    lr, wd, beta1, beta2 = settings[0], settings[1], settings[2], settings[3]
    t = np.float64(steps)
    numbers = np.empty(9, w.dtype)
    numbers[0] = 1.0 - lr * wd
    numbers[1] = wd
    numbers[2] = beta1
    numbers[3] = 1.0 - beta1
    numbers[4] = beta2
    numbers[5] = 1.0 - beta2
    numbers[6] = 1.0 / math.sqrt(1.0 - beta2 ** t)
    numbers[7] = settings[4]
    numbers[8] = lr / (1.0 - beta1 ** t)
    _adam_pass(w, g, m, v, vmax, numbers, int(settings[5]), settings[6] != 0)


@_kernel
def _sgd_pass(w, g, b, numbers, decay, momentum, first, nesterov):
    """SGD on every element, in place: ``numbers`` = [wd, μ, 1-τ, lr] in ``w``'s dtype;
    ``b`` the momentum buffer (unused without momentum)."""
    wd, mu, keep, lr = numbers[0], numbers[1], numbers[2], numbers[3]
    for i in range(w.size):
        gi = g[i]
        if decay:
            gi = gi + w[i] * wd
        if momentum:
            if first:
                bi = gi
            else:
                bi = b[i] * mu + gi * keep
            b[i] = bi
            if nesterov:
                gi = gi + bi * mu
            else:
                gi = bi
        w[i] = w[i] - gi * lr


@_kernel
def _adam_pass(w, g, m, v, vmax, numbers, decay, amsgrad):
    """Adam or AdamW on every element, in place: ``numbers`` = [1 - lr·wd, wd, β1, 1-β1,
    β2, 1-β2, 1/sqrt(1-β2^t), eps, lr/(1-β1^t)] in ``w``'s dtype; ``decay`` 0 none, 1
    Adam's (on the gradient), 2 AdamW's (on the weights); ``vmax`` amsgrad's buffer."""
    shrink, wd, b1, k1, b2, k2 = numbers[0], numbers[1], numbers[2], numbers[3], numbers[4], \
        numbers[5]
    c2, eps, c1 = numbers[6], numbers[7], numbers[8]
    for i in range(w.size):
        gi = g[i]
        wi = w[i]
        if decay == 2:
            wi = wi * shrink
        elif decay == 1:
            gi = gi + wi * wd
        mi = m[i] * b1 + gi * k1
        m[i] = mi
        vi = v[i] * b2 + (gi * gi) * k2
        v[i] = vi
        if amsgrad:
            old = vmax[i]
            vi = old if (old >= vi or old != old) else vi   # np.maximum: NaN wins
            vmax[i] = vi
        w[i] = wi - (mi / (np.sqrt(vi) * c2 + eps)) * c1
