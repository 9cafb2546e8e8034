"""OSP sizing: which layers are synchronized in Routine Sync and which in In-Computation Sync
(OSP paper §4.1).

* §4.1.1, Eq. 4: the importance of layer l is I_l = Σ_j |g_j · P_j| over its parameters
  (first-order Taylor estimate of the loss change when the parameter is zeroed, Eq. 1-3).
* §4.1.2, Eq. 5: the ICS size bound U_max = b(1 + lr)·T_c / N, capped at 80 % of the model
  (Alg. 1 line 2).
* Alg. 1: S(G^u), the ICS size, is 0 in epoch 1 and (1 - loss_i / L)·U_max afterwards, where L
  is the loss of epoch 1.
* The Gradient Importance Bitmap (GIB, §3.2, §4.5): per layer, True = In-Computation Sync
  (unimportant, overlapped with the next iteration), False = Routine Sync.

Sizes and budgets are in one unit of the caller's choosing (bytes or elements) as long as
``layer_sizes``, ``model_size`` and the bandwidth agree.
"""

from __future__ import annotations

import numpy as np

from mpsync.sched._numba import jit

__all__ = [
    "osp_layer_importance",
    "osp_rank",
    "osp_ics_budget",
    "osp_ics_size",
    "osp_bitmap",
    "osp_bitmap_reference",
    "osp_layer_importance_reference",
    "osp_rank_reference",
    "osp_ics_budget_reference",
    "osp_ics_size_reference",
    "OSP_MAX_MODEL_FRACTION",
]

OSP_MAX_MODEL_FRACTION = 0.8  # Alg. 1 line 2: U_max never exceeds 80 % of the model


@jit
def osp_layer_importance(grads, params, layer_sizes):
    """I_l = Σ |g·p| per layer (Eq. 4). ``grads`` and ``params`` are the flattened model
    (float64[P], layers concatenated in order), ``layer_sizes`` int64[L] sums to P."""
    if grads.shape[0] != params.shape[0]:
        raise ValueError("grads and params differ in length")
    L = layer_sizes.shape[0]
    out = np.zeros(L, dtype=np.float64)
    j = 0
    for layer in range(L):
        size = layer_sizes[layer]
        if size < 0:
            raise ValueError("layer_sizes must be >= 0")
        if j + size > grads.shape[0]:
            raise ValueError("layer_sizes add up to more than the number of parameters")
        acc = 0.0
        for k in range(j, j + size):
            acc += abs(grads[k] * params[k])
        out[layer] = acc
        j += size
    if j != grads.shape[0]:
        raise ValueError("layer_sizes do not add up to the number of parameters")
    return out


@jit
def osp_rank(importance):
    """Layers from most to least important; equal importance: lower layer index first."""
    # A stable sort of -importance keeps index order among ties.
    return np.argsort(-importance, kind="mergesort")


@jit
def osp_ics_budget(bandwidth, loss_rate, t_compute, n_workers, model_size):
    """U_max = min(b(1 + lr)·T_c / N, 0.8·model size) (Eq. 5 and Alg. 1 lines 1-2).

    Eq. 5 derives the bound from T_c >= T_ICS = N·S(G^u) / (b(1 + lr)), with b the bandwidth
    (size units per second), lr the loss rate, T_c the computation time of one iteration and N
    the number of workers. It is implemented as printed: a higher loss rate *raises* the bound,
    which looks inverted (goodput would be b(1 - lr)); latency l, listed in §4.1.2, does not
    appear in the formula either. Both are the paper's choices, kept so results compare.
    """
    if not bandwidth >= 0.0 or not t_compute >= 0.0 or not model_size >= 0.0:
        raise ValueError("bandwidth, t_compute and model_size must be >= 0")
    if not (loss_rate >= 0.0 and loss_rate <= 1.0):
        raise ValueError("loss_rate must be in [0, 1]")
    if n_workers < 1:
        raise ValueError("n_workers must be >= 1")
    u = bandwidth * (1.0 + loss_rate) * t_compute / n_workers
    return min(u, OSP_MAX_MODEL_FRACTION * model_size)


@jit
def osp_ics_size(epoch, loss, first_loss, u_max):
    """S(G^u) for epoch ``epoch`` (1-based) by Alg. 1: 0 in epoch 1 (lines 7-9), then
    (1 - loss_i / L)·U_max with L = ``first_loss``, the loss of epoch 1 (line 11).

    Departure [osp-clip-ics-size]: the result is clipped to [0, U_max]. Alg. 1 assumes the loss
    falls from L towards 0; a loss above L would give a negative size, a negative loss more than
    U_max.
    """
    if epoch < 1:
        raise ValueError("epoch is 1-based")
    if not u_max >= 0.0:
        raise ValueError("u_max must be >= 0")
    if epoch == 1:
        return 0.0
    if not first_loss > 0.0:
        raise ValueError("the epoch-1 loss L must be > 0")
    if not np.isfinite(loss):
        raise ValueError("loss is NaN or inf")
    s = (1.0 - loss / first_loss) * u_max
    return min(max(s, 0.0), u_max)


@jit
def osp_bitmap(importance, layer_sizes, budget):
    """The GIB: True for the layers synchronized in ICS, False for Routine Sync.

    The least important layers go to ICS, in increasing importance, as long as their total
    size stays within ``budget`` (= S(G^u)); the first layer that does not fit ends the list,
    so a layer in ICS is never more important than one in RS (equal importance: the higher
    layer index goes first, the reverse of :func:`osp_rank`). Budget 0 gives all-RS, i.e. BSP
    (§4.3).
    """
    L = importance.shape[0]
    if layer_sizes.shape[0] != L:
        raise ValueError("importance and layer_sizes differ in length")
    if not budget >= 0.0:
        raise ValueError("budget must be >= 0")
    for layer in range(L):
        if not np.isfinite(importance[layer]):
            raise ValueError("importance contains NaN or inf")
        if layer_sizes[layer] < 0:
            raise ValueError("layer_sizes must be >= 0")
    order = osp_rank(importance)
    ics = np.zeros(L, dtype=np.bool_)
    used = 0.0
    for j in range(L - 1, -1, -1):
        layer = order[j]
        size = layer_sizes[layer]
        if used + size > budget:
            break
        used += size
        ics[layer] = True
    return ics


def osp_bitmap_reference(importance, layer_sizes, budget) -> np.ndarray:
    """Plain-Python reference of :func:`osp_bitmap`."""
    L = len(importance)
    least_first = sorted(range(L), key=lambda i: (importance[i], -i))
    ics = [False] * L
    used = 0
    for layer in least_first:
        if used + layer_sizes[layer] > budget:
            break
        used += layer_sizes[layer]
        ics[layer] = True
    return np.array(ics, dtype=bool)


def osp_layer_importance_reference(grads, params, layer_sizes) -> np.ndarray:
    """Reference of :func:`osp_layer_importance`: Eq. 4, I_l = Σ_{j in l} |g_j·P_j|, one
    Python sum per layer over its slice of the flattened model (no validation)."""
    g = [float(x) for x in grads]
    w = [float(x) for x in params]
    out, start = [], 0
    for size in (int(x) for x in layer_sizes):
        out.append(sum(abs(g[j] * w[j]) for j in range(start, start + size)))
        start += size
    return np.array(out, dtype=np.float64)


def osp_rank_reference(importance) -> np.ndarray:
    """Reference of :func:`osp_rank` (§4.1.1): layers by decreasing I_l, lower index first."""
    imp = [float(x) for x in importance]
    return np.array(sorted(range(len(imp)), key=lambda i: (-imp[i], i)), dtype=np.int64)


def osp_ics_budget_reference(bandwidth, loss_rate, t_compute, n_workers, model_size) -> float:
    """Reference of :func:`osp_ics_budget`: U_max = b(1 + lr)·T_c / N (Eq. 5), then Alg. 1
    line 2, U_max = min(U_max, 0.8·ModelSize) (no validation)."""
    u_max = bandwidth * (1.0 + loss_rate) * t_compute / n_workers
    return min(u_max, 0.8 * model_size)


def osp_ics_size_reference(epoch: int, loss: float, first_loss: float, u_max: float) -> float:
    """Reference of :func:`osp_ics_size`, Alg. 1: S(G^u)_1 = 0, S(G^u)_i = (1 - loss_i/L)·U_max,
    with the same clipping to [0, U_max] (no validation)."""
    if epoch == 1:
        return 0.0
    s = (1.0 - loss / first_loss) * u_max
    return min(max(s, 0.0), u_max)
