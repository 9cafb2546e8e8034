"""Starting mpsync's jobs: ``mpirun`` command lines built as argv lists, the job scripts of the
batch schedulers, and the runs on the virtual cluster.

Launch commands are built by pure functions as argv lists (never one formatted shell string),
so that they can be tested against expected output and reused by ``mpsync compare``, the
benchmarks, the job templates and the test harness alike.
"""

from mpsync.launch.mpirun import (FORWARDED_ENV, FORWARDED_PREFIXES, YIELD_WHEN_IDLE,
                                  LaunchResult, clean_launch_env, forwarded_env, is_root,
                                  mpirun_argv, mpirun_options, python_argv, run_with_deadline)

__all__ = ["mpirun_argv", "mpirun_options", "python_argv", "run_with_deadline", "LaunchResult",
           "is_root", "forwarded_env", "clean_launch_env", "FORWARDED_ENV", "FORWARDED_PREFIXES",
           "YIELD_WHEN_IDLE"]
