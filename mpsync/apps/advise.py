"""``mpsync advise``: which policy to run, decided before a long job.

The ranking ``--policy auto`` makes while a job runs, made offline: from a finished run's
``metrics.json`` (each worker's compute per iteration, the aggregation it measured, the samples
it took to reach its target) or from stated speeds, link rate and model, every candidate
``mpsync train`` can run (each registered policy on each topology, with SSP's staleness bound
swept: :func:`runnable_candidates`) is simulated with the state server's own rules and weighed
by its statistical efficiency (``mpsync.auto.rank_candidates``); the candidates are printed
best first with their predicted time to the target, why, and the advice as the
``mpsync train`` command line that runs it (:func:`train_command`).

    mpsync advise --metrics runs/bsp/metrics.json
    mpsync advise --speeds 1,1,2,4 --link 1gbit --model wide-mlp
"""

from __future__ import annotations

import argparse
import json
import sys

from mpsync import policies
from mpsync.config import ConfigError

__all__ = ["add_arguments", "main", "measurements_from_args", "format_ranking", "model_bytes",
           "runnable_candidates", "train_command", "TRAIN_FLAGS"]

_TOPOLOGIES = ("ring", "ps")
# The ``mpsync train`` flag of each candidate setting advice may sweep.  A candidate with a
# setting not here, or another wire than float32 (train has no flag for compression:
# ``Compression.fp16`` is the Python API's), is not advised: advice must be runnable.
TRAIN_FLAGS = {"staleness": "--staleness"}


def runnable_candidates(topologies) -> list:
    """The ranking's candidates on ``topologies`` that ``mpsync train`` can run as flags."""
    from mpsync.auto import default_candidates

    return [c for c in default_candidates(topologies)
            if c.wire == "fp32" and all(k in TRAIN_FLAGS for k, _ in c.settings)]


def train_command(candidate, m) -> str:
    """The ``mpsync train`` command line that runs ``candidate`` on ``m``'s workers (the
    job's own flags, its model, data and time budget, go after it)."""
    flags = [f"--np {m.n}", f"--policy {candidate.policy}", f"--topology {candidate.topology}"]
    flags += [f"{TRAIN_FLAGS[k]} {v}" for k, v in candidate.settings]
    if m.batch_size != 32:
        flags.append(f"--batch-size {m.batch_size}")
    return "mpsync train " + " ".join(flags)


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("what the cluster is (one of)")
    src.add_argument("--metrics", default=None,
                     help="a finished run's metrics.json (mpsync train / compare)")
    src.add_argument("--speeds", default=None,
                     help="stated slowdown factors, one per worker, e.g. 1,1,2,4")
    g = p.add_argument_group("stated cluster (with --speeds; override a metrics.json's)")
    g.add_argument("--iter-time", type=float, default=0.05,
                   help="seconds of one iteration at factor 1 (default 0.05, train's "
                        "emulated device)")
    g.add_argument("--link", default=None,
                   help="each worker's link: 1gbit, 100mbit (bits) or 125M (bytes/s); "
                        "default 10gbit")
    g.add_argument("--model", default=None,
                   help="a model of mpsync train on its digits data (auto, cnn, mlp, "
                        "wide-mlp): its gradient bytes")
    g.add_argument("--model-bytes", default=None, help="bytes aggregated per round instead")
    g.add_argument("--aggregation-s", type=float, default=None,
                   help="measured seconds of one aggregation round (instead of the link model)")
    g.add_argument("--jitter", type=float, default=None,
                   help="per-iteration lognormal sigma of the compute times")
    g.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--target-samples", type=float, default=None,
                   help="BSP-equivalent samples to the target (default: the run's, or "
                        "auto's default)")
    p.add_argument("--topologies", default="ring,ps", help="where candidates may run")
    p.add_argument("--horizon", type=int, default=None,
                   help="iterations per worker each candidate is simulated for (default "
                        "auto's)")
    p.add_argument("--top", type=int, default=0, help="print only the best N (0: all)")
    p.add_argument("--json", action="store_true", help="print the ranking as JSON")


def _link(text: str) -> float:
    """Bytes per second from ``1gbit`` / ``100mbit`` (bits, tc's units) or ``125M`` (bytes)."""
    from mpsync.simulate import parse_rate

    if str(text).strip().lower().endswith("bit"):
        from mpsync.cluster.layout import ClusterError, parse_rate as parse_bits
        try:
            return parse_bits(text) / 8.0
        except ClusterError as e:
            raise ConfigError(f"--link: {e}") from None
    return parse_rate(text, "--link")


def model_bytes(name: str) -> float:
    """The float32 gradient bytes of ``mpsync train --model NAME`` on its digits data."""
    from mpsync.apps.model_names import MODELS

    if name not in MODELS:
        raise ConfigError(f"--model {name!r}: choose from {', '.join(MODELS)}")
    from mpsync.apps.datasets import load_dataset
    from mpsync.apps.models import build_model

    data = load_dataset("digits")
    shape = data.input_shape if name != "mlp" else (int(data.x_train[0].size),)
    model = build_model(shape, int(data.n_classes), 0, name)
    return float(sum(p.numel() * p.element_size() for p in model.parameters()))


def measurements_from_args(args):
    """The :class:`mpsync.auto.Measurements` the flags describe."""
    from mpsync.auto import Measurements
    from mpsync.simulate import parse_rate

    if (args.metrics is None) == (args.speeds is None):
        raise ConfigError("give --metrics PATH (a finished run) or --speeds F1,F2,... "
                          "(stated slowdown factors), one of the two")
    kw = {}
    if args.link is not None:
        kw["bandwidth"] = _link(args.link)
    if args.model_bytes is not None:
        kw["model_bytes"] = parse_rate(args.model_bytes, "--model-bytes")
    elif args.model is not None:
        kw["model_bytes"] = model_bytes(args.model)
    for flag, key in (("aggregation_s", "aggregation_s"), ("jitter", "jitter"),
                      ("batch_size", "batch_size"), ("target_samples", "target_samples")):
        if getattr(args, flag) is not None:
            kw[key] = getattr(args, flag)
    topologies = tuple(t.strip() for t in args.topologies.split(",") if t.strip())
    bad = [t for t in topologies if t not in _TOPOLOGIES]
    if bad or not topologies:
        raise ConfigError(f"--topologies {args.topologies!r}: a comma list of ring, ps")
    kw["topologies"] = topologies
    try:
        if args.metrics is not None:
            return Measurements.from_metrics(args.metrics, **kw)
        try:
            factors = [float(x) for x in args.speeds.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"--speeds {args.speeds!r}: slowdown factors, e.g. "
                              f"1,1,2,4") from None
        if not args.iter_time > 0:
            raise ConfigError(f"--iter-time must be > 0 seconds, got {args.iter_time}")
        link = kw.pop("bandwidth", None)
        mb = kw.pop("model_bytes", None)
        extra = {"model_bytes": mb} if mb is not None else {}
        return Measurements.from_speeds(factors, iter_time=args.iter_time, link=link,
                                        **extra, **kw)
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(str(e)) from None


def describe(m) -> str:
    link = f"{m.bandwidth * 8 / 1e9:g} Gbit/s links"
    agg = (f"aggregation {m.aggregation_s * 1e3:.1f} ms/round (measured)"
           if m.aggregation_s is not None else
           f"{m.model_bytes / 1e6:.3g} MB per aggregation over {link}")
    speeds = ", ".join(f"{c * 1e3:.0f}" for c in m.compute_s[:16]) + \
        (", ..." if m.n > 16 else "")
    lines = [f"{m.source or 'cluster'}: {m.n} workers, compute {speeds} ms/iteration "
             f"(slowest / fastest {m.spread:.2f}), {agg}, target {m.target_samples:.0f} "
             f"BSP-equivalent samples"]
    lines += [f"  {note}" for note in m.notes]
    return "\n".join(lines)


def format_ranking(ranked, top: int = 0, m=None) -> str:
    """Best first: rank, candidate, predicted time to target, samples/s, efficiency, wait
    fraction, and why; then how much the best gains over the runner-up and over BSP, and
    (given ``m``, the measurements ranked) the ``mpsync train`` command line of the best."""
    rows = ranked[:top] if top else ranked
    lines = ["| # | candidate | time to target (s) | samples/s | efficiency | wait | why |",
             "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        ttt = r.predicted_time_to_target_s
        lines.append(f"| {i} | {r.candidate.label} | "
                     f"{'never' if ttt == float('inf') else f'{ttt:.1f}'} | "
                     f"{r.samples_per_s:.0f} | {r.efficiency:.2f} | {r.wait_fraction:.2f} | "
                     f"{'; '.join(r.reasons)} |")
    if ranked:
        best = ranked[0]
        lines.append("")
        to = "the target" if m is None else \
            f"{m.target_samples:,.0f} BSP-equivalent samples"
        lines.append(f"advice: {best.candidate.label}, predicted "
                     f"{best.predicted_time_to_target_s:.1f} s to {to}")
        t = best.predicted_time_to_target_s
        if len(ranked) > 1:
            lines.append(f"  {ranked[1].predicted_time_to_target_s / t:.2f}x faster than the "
                         f"runner-up, {ranked[1].candidate.label}")
        bsp = [r for r in ranked if policies.is_baseline(r.candidate.policy)
               and not r.candidate.settings
               and r.candidate.wire == "fp32"]
        if bsp and bsp[0] is not best:
            lines.append(f"  {bsp[0].predicted_time_to_target_s / t:.2f}x faster than "
                         f"{bsp[0].candidate.label}")
        if m is not None:
            lines.append(f"  run it: {train_command(best.candidate, m)}  (and the job's own "
                         f"flags: model, data, time budget)")
    return "\n".join(lines)


def main(args) -> int:
    from mpsync.auto import rank_candidates

    m = measurements_from_args(args)
    kw = {} if args.horizon is None else {"horizon": args.horizon}
    if args.horizon is not None and args.horizon < 3:
        raise ConfigError(f"--horizon must be >= 3 iterations, got {args.horizon}")
    ranked = rank_candidates(m, runnable_candidates(m.topologies), **kw)
    if args.json:
        print(json.dumps({"measurements": m.as_dict(),
                          "ranking": [r.as_dict() | {"command": train_command(r.candidate, m)}
                                      for r in ranked]}))
        return 0
    print(describe(m))
    print()
    print(format_ranking(ranked, args.top, m))
    sys.stdout.flush()
    return 0
