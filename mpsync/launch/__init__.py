"""Starting mpsync's ranks: one launch target per way (``mpirun`` here, the virtual cluster,
horovodrun, Slurm, PBS), chosen through the registry.

Launch commands are built by pure functions as argv lists (never one formatted shell string),
so that they can be tested against expected output and reused by ``mpsync compare``, the
benchmarks, the job templates and the test harness alike; job scripts are rendered from the
same builders (``mpsync jobs``, :mod:`mpsync.launch.jobs`).  ``mpsync train --np N`` and
``mpsync run --np N`` start their own ``mpirun`` through :func:`build_job` (pure) and
:func:`run_job` (one job, its outcome), :mod:`mpsync.launch.runner`.
"""

from mpsync.launch.mpirun import (FORWARDED_ENV, FORWARDED_PREFIXES, YIELD_WHEN_IDLE,
                                  LaunchResult, clean_launch_env, forwarded_env, is_root,
                                  mpirun_argv, mpirun_options, python_argv, run_with_deadline)
from mpsync.launch.registry import get, launch_argv, names, register, unregister
from mpsync.launch.runner import Job, JobOutcome, build_job, run_job
from mpsync.launch.target import LaunchError, LaunchTarget

__all__ = ["mpirun_argv", "mpirun_options", "python_argv", "run_with_deadline", "LaunchResult",
           "is_root", "forwarded_env", "clean_launch_env", "FORWARDED_ENV", "FORWARDED_PREFIXES",
           "YIELD_WHEN_IDLE", "LaunchTarget", "LaunchError", "register", "unregister", "get",
           "names", "launch_argv", "Job", "JobOutcome", "build_job", "run_job"]
