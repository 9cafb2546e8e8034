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
* once per round (BSP, the synchronous kvstore): :meth:`ShardOptimizer.merge` adds each push
  of the round to a pending sum, and :meth:`ShardOptimizer.flush` runs one step on their mean
  before the round's weights are read.  Mean over the pushes merged: with equal mini-batches
  that is the gradient of the workers' batches concatenated, so a BSP round is one step of
  single-process training on that batch.

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
           "settings_from_group", "settings_of", "UnsupportedOptimizer"]

# The optimizers a shard can run, by the lower-cased name of the torch class they mirror.
KINDS = ("sgd", "adam", "adamw")


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
    that size in place.  Per push: :meth:`step`; per round: :meth:`merge` each push, then
    :meth:`flush` (module doc)."""

    def __init__(self, settings: OptimizerSettings, size: int, dtype=np.float64):
        self.settings = settings
        self.size = int(size)
        self.dtype = np.dtype(dtype)
        self.steps = 0                 # Adam's t (bias correction); SGD counts too
        self.merged = 0                # pushes in the pending sum
        self._pending: np.ndarray | None = None
        self._momentum: np.ndarray | None = None   # SGD's buffer / Adam's first moment
        self._second: np.ndarray | None = None     # Adam's second moment
        self._max_second: np.ndarray | None = None  # amsgrad
        self._g: np.ndarray | None = None          # scratch: the gradient as stepped
        self._t: np.ndarray | None = None          # scratch

    def configure(self, settings: OptimizerSettings) -> None:
        """New hyperparameters (a learning-rate schedule); the state stays.  Changing the kind
        would leave state of the wrong meaning: refused."""
        if settings.kind != self.settings.kind:
            raise UnsupportedOptimizer(f"server-side optimizer: cannot change from "
                                       f"{self.settings.kind} to {settings.kind} mid-run")
        self.settings = settings

    def _buffer(self, name: str) -> np.ndarray:
        buf = getattr(self, name)
        if buf is None:
            buf = np.zeros(self.size, dtype=self.dtype)
            setattr(self, name, buf)
        return buf

    def _check(self, array: np.ndarray, what: str) -> None:
        if array.shape != (self.size,):
            raise ValueError(f"{what} of {array.size} elements for a range of {self.size}")

    def merge(self, grad: np.ndarray) -> None:
        """Add one push to the round's pending sum (in the weights' dtype)."""
        self._check(grad, "gradient")
        pending = self._buffer("_pending")
        if self.merged == 0:
            np.copyto(pending, grad, casting="unsafe")
        else:
            pending += grad
        self.merged += 1

    def flush(self, weights: np.ndarray) -> bool:
        """One step on the mean of the pushes merged since the last flush; False (and the
        weights untouched) if none was."""
        if self.merged == 0:
            return False
        pending = self._pending
        if self.merged > 1:
            pending *= 1.0 / self.merged
        self.merged = 0
        self._step(weights, pending)
        return True

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
        if s.kind == "sgd":
            self._sgd(weights, g, s)
        else:
            self._adam(weights, g, s)

    def _sgd(self, w: np.ndarray, g: np.ndarray, s: OptimizerSettings) -> None:
        # torch.optim.SGD: g += wd·w; b = μ·b + (1-τ)·g (b = g the first time);
        # g = g + μ·b (Nesterov) or b; w -= lr·g.  Scratch buffers, no temporaries.
        t = self._buffer("_t")
        if s.weight_decay:
            np.multiply(w, s.weight_decay, out=t)
            g += t
        if s.momentum:
            first = self._momentum is None
            b = self._buffer("_momentum")
            if first:
                np.copyto(b, g)
            else:
                b *= s.momentum
                np.multiply(g, 1.0 - s.dampening, out=t)
                b += t
            if s.nesterov:
                np.multiply(b, s.momentum, out=t)
                g += t
            else:
                g = b
        np.multiply(g, s.lr, out=t)
        w -= t

    def _adam(self, w: np.ndarray, g: np.ndarray, s: OptimizerSettings) -> None:
        # torch.optim.Adam / AdamW: (AdamW: w *= 1 - lr·wd; Adam: g += wd·w);
        # m = β1·m + (1-β1)·g; v = β2·v + (1-β2)·g²; (amsgrad: v̂ = max(v̂, v));
        # w -= lr/(1-β1^t) · m / (sqrt(v)/sqrt(1-β2^t) + eps).  Scratch buffers only.
        t = self._buffer("_t")
        if s.weight_decay:
            if s.kind == "adamw":
                w *= 1.0 - s.lr * s.weight_decay
            else:
                np.multiply(w, s.weight_decay, out=t)
                g += t
        m, v = self._buffer("_momentum"), self._buffer("_second")
        m *= s.beta1
        np.multiply(g, 1.0 - s.beta1, out=t)
        m += t
        v *= s.beta2
        np.multiply(g, g, out=g)
        g *= 1.0 - s.beta2
        v += g
        if s.amsgrad:
            vmax = self._buffer("_max_second")
            np.maximum(vmax, v, out=vmax)
            v = vmax
        np.sqrt(v, out=t)
        t *= 1.0 / math.sqrt(1.0 - s.beta2 ** self.steps)
        t += s.eps
        np.divide(m, t, out=t)
        t *= s.lr / (1.0 - s.beta1 ** self.steps)
        w -= t

    def state_bytes(self) -> int:
        """Bytes of optimizer state held (the pending sum and scratch included)."""
        return sum(b.nbytes for b in (self._pending, self._momentum, self._second,
                                      self._max_second, self._g, self._t) if b is not None)


class ServerUpdates:
    """A shard's updates under ``ps_optimizer='server'``: the settings the workers send, and
    each pushed gradient stepped (``per_round`` False) or merged until the round's weights are
    read (``per_round``: :meth:`settle` before a pull is served).  The shard's weights array is
    passed in; the shard counts the versions.  Every method returns None or why it refused,
    in which case the weights are as they were."""

    def __init__(self, per_round: bool):
        self.per_round = bool(per_round)
        self.settings: OptimizerSettings | None = None
        self.optimizer: ShardOptimizer | None = None

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

    def take(self, weights: np.ndarray, grad: np.ndarray) -> str | None:
        if self.settings is None:
            return "a gradient before the optimizer's settings"
        if weights is None or grad.shape != weights.shape:
            return "push before ps_init or of the wrong length"
        if not np.all(np.isfinite(grad)):
            return "push with NaN or inf"
        if self.optimizer is None:
            self.optimizer = ShardOptimizer(self.settings, weights.size, weights.dtype)
        if self.per_round:
            self.optimizer.merge(grad)
        else:
            self.optimizer.step(weights, grad)
        return None

    @property
    def pending(self) -> bool:
        """Pushes merged and not yet stepped on (a round whose weights nobody read yet)."""
        return self.optimizer is not None and self.optimizer.merged > 0

    def settle(self, weights: np.ndarray) -> bool:
        """Before weights are read: the round's step on its merged pushes, if one is due."""
        return self.pending and self.optimizer.flush(weights)
