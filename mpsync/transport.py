"""Open MPI transport settings for runs across nodes: one place decides them.

Every launch that crosses a network uses what :func:`mca_pairs` returns: ``mpsync cluster
mpirun-args`` and ``mpsync cluster env``, every ``--cluster`` launch (``train``, ``compare``,
the benchmarks), and the job templates (``jobs/``: the Slurm and PBS ``mpirun`` lines,
horovodrun's ``--mpi-args``, and ``mpsync compare`` inside a job).  Launches on one host keep
Open MPI's defaults unless ``MPSYNC_MPI_TUNING`` is set.

The tuned settings (``TUNED``), and why (measured over TCP links between network-namespace
nodes, ``bench/transport``):

* ``btl_tcp_links 2``: two TCP connections per pair of ranks.  An exchange that sends data both
  ways over one connection got about half the link each way; with two, each carries one way.
* ``coll_tuned_use_dynamic_rules 1`` + ``coll_tuned_allreduce_algorithm 4``: the ring allreduce
  for every ``MPI_Allreduce``.  Open MPI's size-based default for large buffers pairs ranks
  for bidirectional exchanges (recursive doubling, Rabenseifner), which pay the point above on
  every step; the ring sends to one neighbour and receives from the other (bandwidth-optimal,
  2(n-1)/n of the buffer per link each way).  Below one element per rank Open MPI's ring
  itself falls back to recursive doubling, so tiny allreduces keep their latency.  Horovod's
  CPU allreduce over MPI is an ``MPI_Allreduce`` of its fusion buffer, so it gets the ring too.

``MPSYNC_MPI_TUNING`` (or the ``spec`` argument) overrides them:

* unset or ``tuned``: ``TUNED``;
* ``none`` (also ``default``, ``defaults``, ``off``): nothing, Open MPI's own defaults;
* ``name=value`` pairs separated by spaces or commas (``btl_tcp_links=4,
  coll_tuned_allreduce_algorithm=6``): exactly those, replacing ``TUNED``.

Open MPI refuses an MCA parameter given twice on one command line: to change one of these,
set ``MPSYNC_MPI_TUNING`` rather than adding ``--mca`` for it by hand.
"""

from __future__ import annotations

import os
import re
import shlex
import sys

__all__ = ["TUNED", "ENV_VAR", "TransportError", "mca_pairs", "mca_argv", "mca_env",
           "is_set", "describe", "ompi_built_with_cuda"]

ENV_VAR = "MPSYNC_MPI_TUNING"
TUNED: tuple[tuple[str, str], ...] = (
    ("btl_tcp_links", "2"),
    ("coll_tuned_use_dynamic_rules", "1"),
    ("coll_tuned_allreduce_algorithm", "4"),
)
_OFF = ("none", "default", "defaults", "off")
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


class TransportError(ValueError):
    """A tuning spec that cannot be read; the message names the bad part."""


def _spec(spec: str | None, environ) -> str:
    if spec is not None:
        return spec
    environ = os.environ if environ is None else environ
    return environ.get(ENV_VAR, "").strip() or "tuned"


def mca_pairs(spec: str | None = None, environ=None) -> list[tuple[str, str]]:
    """The MCA parameters to give Open MPI, as (name, value) pairs (see the module doc)."""
    text = _spec(spec, environ).strip()
    if text.lower() == "tuned":
        return list(TUNED)
    if text.lower() in _OFF:
        return []
    pairs: list[tuple[str, str]] = []
    for item in re.split(r"[\s,]+", text):
        if not item:
            continue
        name, eq, value = item.partition("=")
        if item.startswith("--") or not eq or not _NAME.match(name) or not value:
            raise TransportError(
                f"{ENV_VAR}={text!r}: {item!r} is not name=value (use tuned, none, or pairs "
                f"such as btl_tcp_links=2,coll_tuned_allreduce_algorithm=4)")
        if any(name == n for n, _ in pairs):
            raise TransportError(f"{ENV_VAR}={text!r}: {name} given twice")
        pairs.append((name, value))
    return pairs


def mca_argv(spec: str | None = None, environ=None) -> list[str]:
    """``--mca NAME VALUE`` for each pair: what an ``mpirun`` command line takes."""
    return [a for name, value in mca_pairs(spec, environ) for a in ("--mca", name, value)]


def mca_env(spec: str | None = None, environ=None) -> dict[str, str]:
    """``OMPI_MCA_NAME=VALUE`` for each pair: for launchers whose ``mpirun`` line is their own
    (horovodrun); ``mpirun`` passes ``OMPI_*`` variables on to every rank."""
    return {f"OMPI_MCA_{name}": value for name, value in mca_pairs(spec, environ)}


def is_set(environ=None) -> bool:
    """Whether the user chose the tuning (``MPSYNC_MPI_TUNING`` set and not empty)."""
    environ = os.environ if environ is None else environ
    return bool(environ.get(ENV_VAR, "").strip())


def describe(spec: str | None = None, environ=None) -> str:
    """One line for logs and benchmark files: the options, or that Open MPI's defaults hold."""
    argv = mca_argv(spec, environ)
    return " ".join(argv) if argv else "Open MPI defaults"


def main(argv: list[str]) -> int:
    """``python -m mpsync.transport [SPEC]``: the ``--mca`` options, shell-quoted, for job
    scripts (``--env``: ``export OMPI_MCA_...`` lines instead)."""
    env = "--env" in argv
    rest = [a for a in argv if a != "--env"]
    try:
        if env:
            print("\n".join(f"export {k}={shlex.quote(v)}"
                            for k, v in mca_env(rest[0] if rest else None).items()))
        else:
            print(shlex.join(mca_argv(rest[0] if rest else None)))
    except TransportError as e:
        print(f"mpsync.transport: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def ompi_built_with_cuda() -> bool | None:
    """Open MPI's build flag ``mpi_built_with_cuda_support`` as ``ompi_info`` reports it, or
    None when ompi_info cannot say (not on PATH, no such line)."""
    import subprocess

    try:
        out = subprocess.run(["ompi_info", "--parsable", "--all"], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        if "built_with_cuda_support:value:" in line:
            return line.rsplit(":", 1)[1].strip() == "true"
    return None
