"""A user's script and the ``mpsync`` command, run as ranks by tests/test_user_errors.py.

    python user_error_programs.py init policy=ssp topology=ring   # mpsync.torch.init(...)
    python user_error_programs.py cli train --time-budget 1        # mpsync.cli.main([...])
"""

from __future__ import annotations

import sys


def main() -> int:
    what, rest = sys.argv[1], sys.argv[2:]
    if what == "init":
        import mpsync.torch as mps

        mps.init(**dict(a.split("=", 1) for a in rest))
        mps.shutdown()
        return 0
    from mpsync.cli import main as mpsync_main

    return mpsync_main(rest)


if __name__ == "__main__":
    sys.exit(main())
