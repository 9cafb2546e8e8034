"""The applications built on mpsync: ``mpsync train`` (one policy, run under mpirun),
``mpsync compare`` (every policy, one run or interleaved repeats each) and ``mpsync simulate``,
with their data sets, models, emulated slow workers, checkpoints and reports."""
