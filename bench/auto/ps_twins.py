"""What BSP and ESync on the parameter server would gain as ``auto`` candidates: each one's
predicted time to target over its ring twin's, on the ranking ``auto`` itself runs
(``rank_candidates``, the simulator's exact engine), over a grid of clusters.

Neither is a live candidate (``mpsync.auto.serving.live_candidates``; why: *Not candidates*
in this folder's README).  This prints where the model says that costs anything::

    python bench/auto/ps_twins.py                 # 4 and 8 workers: about 6 CPU s
    python bench/auto/ps_twins.py --workers 4,16,64   # 64 workers: about 2 CPU minutes

One line per cluster and policy: workers, link rate, model bytes, latency, whether the last
worker is a 4x straggler (the others at 50 ms per iteration), and the ratio (below 1: the PS
twin predicted faster).
"""

from __future__ import annotations

import argparse
import itertools
import time

from mpsync.auto import Measurements, rank_candidates
from mpsync.auto.ranking import Candidate

POLICIES = ("bsp", "esync")
RATES = (12.5e6, 125e6, 1.25e9)          # 100 Mbit/s, 1 Gbit/s, 10 Gbit/s, in bytes/s
MODEL_BYTES = (150e3, 40e6)              # the digits CNN, a model of the wide-MLP class
LATENCIES = (5e-6, 1e-4)                 # shared memory, a TCP hop
ITERATION_S = 0.05


def ratios(n: int):
    """Yield ``(policy, rate, model_bytes, latency, straggler, ps / ring)`` at ``n`` workers."""
    candidates = [Candidate(p, t) for p in POLICIES for t in ("ring", "ps")]
    for rate, size, latency, straggler in itertools.product(RATES, MODEL_BYTES, LATENCIES,
                                                            (False, True)):
        compute = tuple(ITERATION_S * (4 if straggler and i == n - 1 else 1) for i in range(n))
        m = Measurements(compute_s=compute, model_bytes=size, bandwidth=rate, latency=latency,
                         batch_size=32, ps_shards=n, target_samples=1408.0 * n,
                         topologies=("ring", "ps"))
        t = {r.candidate.label: r.predicted_time_to_target_s
             for r in rank_candidates(m, candidates, engine="exact")}
        for p in POLICIES:
            yield p, rate, size, latency, straggler, t[f"{p}/ps"] / t[f"{p}/ring"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="4,8", help="comma-separated worker counts")
    args = ap.parse_args(argv)
    for n in (int(w) for w in args.workers.split(",")):
        t0 = time.process_time()
        rows = list(ratios(n))
        for p, rate, size, latency, straggler, r in rows:
            print(f"{n:4d} {p:6s} {rate * 8 / 1e9:5.1f} Gbit/s {size / 1e6:6.2f} MB "
                  f"{latency * 1e6:5.0f} us {'straggler' if straggler else 'equal    '} {r:.3f}")
        for p in POLICIES:
            mine = [r[-1] for r in rows if r[0] == p]
            print(f"# {n} workers, {p}: ps / ring {min(mine):.3f}-{max(mine):.3f}")
        print(f"# {n} workers: {time.process_time() - t0:.1f} CPU s")


if __name__ == "__main__":
    main()
