"""Scheduling kernels: when should data-parallel workers synchronize?

Pure functions over numpy arrays, compiled with Numba; nothing here knows about ranks, tags,
tensors, mpi4py or torch. The state server (rank 0) calls them with its per-worker tables.

=====================  ===========================================================
``predict``            lookahead matrix 𝓜 from the latest pushes (ZipLine §4)
``zipline``            ElasticBSP barrier search, six variants (ZipLine §5)
``dssp_*``             DSSP server decisions (DSSP Alg. 1) and controller (Alg. 2)
``ssp_may_continue``   SSP staleness bound (DSSP §I.A)
``esync_*``            ESync State Server QUERY-STATE (ESync Alg. 2, §4.2)
``osp_*``              OSP importance ranking and ICS sizing (OSP §4.1, Alg. 1)
=====================  ===========================================================
"""

from mpsync.sched.dssp import (
    dssp_controller,
    dssp_controller_reference,
    dssp_fastest,
    dssp_is_fastest,
    dssp_allowance,
    dssp_on_push,
    dssp_on_push_given,
    dssp_slowest,
    ssp_may_continue,
    within_staleness,
)
from mpsync.sched.esync import (
    esync_delta,
    esync_query_state,
    esync_ready,
    esync_ready_delayed_ack,
    esync_ready_given_slowest,
    esync_ready_reference,
    esync_reset,
    esync_slowest,
)
from mpsync.sched.osp import (
    OSP_MAX_MODEL_FRACTION,
    osp_bitmap,
    osp_bitmap_reference,
    osp_ics_budget,
    osp_ics_size,
    osp_layer_importance,
    osp_rank,
)
from mpsync.sched.predict import predict, predict_reference, push_intervals
from mpsync.sched.zipline import (
    EXACT_VARIANTS,
    FASTEST_EXACT_VARIANT,
    ZIPLINE_VARIANTS,
    ZipLineResult,
    check_matrix,
    zipline,
)

__all__ = [
    "predict",
    "predict_reference",
    "push_intervals",
    "ZIPLINE_VARIANTS",
    "EXACT_VARIANTS",
    "FASTEST_EXACT_VARIANT",
    "ZipLineResult",
    "check_matrix",
    "zipline",
    "ssp_may_continue",
    "dssp_slowest",
    "dssp_fastest",
    "dssp_is_fastest",
    "dssp_controller",
    "dssp_controller_reference",
    "dssp_on_push",
    "dssp_on_push_given",
    "esync_slowest",
    "esync_ready",
    "esync_ready_given_slowest",
    "within_staleness",
    "dssp_allowance",
    "esync_ready_reference",
    "esync_query_state",
    "esync_reset",
    "esync_ready_delayed_ack",
    "esync_delta",
    "osp_layer_importance",
    "osp_rank",
    "osp_ics_budget",
    "osp_ics_size",
    "osp_bitmap",
    "osp_bitmap_reference",
    "OSP_MAX_MODEL_FRACTION",
]
