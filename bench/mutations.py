"""Mutation check of the fidelity tests: does the suite notice when a policy's paper-specific
rule is removed, or the policy is replaced by BSP or by ASP?

Each mutation is a textual patch of mpsync's source (an exact string, found exactly once,
replaced), applied to a copy of the tree in a temporary folder; the tests named for it then
run against that copy, and the table lists which of them failed.  A mutation that no test
catches is a hole in the tests.  Run by hand (minutes; multi-rank tests take the longest),
not part of the suite:

    PYTHONPATH=. .venv/bin/python bench/mutations.py [--only NAME ...] [--out FILE]

Before any mutation the named tests run once on the unpatched copy and must pass.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RULES = "tests/test_fidelity_rules.py"
MPI = "tests/test_fidelity.py"
TABLE = "tests/test_policies.py::test_docs_fidelity_table_and_the_code_state_the_same_departures"


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str                           # the rule or policy the patch removes or replaces
    patches: tuple[tuple[str, str, str], ...]   # (file, old, new)
    tests: tuple[str, ...]              # pytest node ids or files


_REG = "mpsync/policies.py"

MUTATIONS = [
    # -- each policy replaced by BSP or ASP (its registry entry names the other server) --------
    Mutation("bsp->asp", "BSP replaced by ASP",
             ((_REG, 'server=_SERVER + "BSP",', 'server=_SERVER + "ASP",'),), (RULES,)),
    Mutation("asp->bsp", "ASP replaced by BSP",
             ((_REG, 'server=_SERVER + "ASP", strategies', 'server=_SERVER + "BSP", strategies'),),
             (RULES,)),
    *[Mutation(f"{name}->{other.lower()}", f"{title} replaced by {other}",
               ((_REG, ref, f'server=_SERVER + "{other}"'),), (RULES,))
      for name, title, ref in (("ssp", "SSP", 'server=_SERVER + "SSP"'),
                               ("dssp", "DSSP", 'server=_SERVER + "DSSP"'),
                               ("ebsp", "ElasticBSP", 'server=_STEP_SERVER + "ElasticBSP"'),
                               ("esync", "ESync", 'server=_STEP_SERVER + "ESync"'),
                               ("osp", "OSP", 'server=_STEP_SERVER + "OSP"'))
      for other in ("BSP", "ASP")],
    # -- SSP's staleness bound (DSSP §I.A) ------------------------------------------------------
    Mutation("ssp-bound-removed", "SSP: the staleness bound (never hold a pull)",
             (("mpsync/sched/dssp.py", "    return iters[p] - lo <= s\n", "    return True\n"),),
             (RULES,)),
    Mutation("ssp-bound-off-by-one", "SSP: a gap of exactly s no longer allowed",
             (("mpsync/sched/dssp.py", "    return iters[p] - lo <= s\n",
               "    return iters[p] - lo < s\n"),), (RULES,)),
    # -- DSSP's synchronization controller (Alg. 1 lines 11-15, Alg. 2) -------------------------
    Mutation("dssp-controller-removed", "DSSP: Alg. 2 controller (r* = 0 always: SSP at s_L)",
             (("mpsync/sched/dssp.py",
               "        r = dssp_controller(push_table, p, r_max, dssp_slowest(iters))\n",
               "        r = 0\n"),), (RULES,)),
    Mutation("dssp-allowance-left-removed", "DSSP: controller given the full r_max each time",
             (("mpsync/server/policies.py",
               "        r_max = max(0, min(self.config.staleness_high - self.config.staleness_low,\n"
               "                           self.config.staleness_high - gap + 1))\n",
               "        r_max = self.config.staleness_high - self.config.staleness_low\n"),),
             (RULES,)),
    Mutation("dssp-first-extra-ok-removed", "DSSP: r_p = r* (the granting OK not counted)",
             (("mpsync/sched/dssp.py",
               "dssp_slowest(iters))\n        if r > 0:\n            return True, r - 1\n",
               "dssp_slowest(iters))\n        if r > 0:\n            return True, r\n"),),
             (RULES,)),
    # -- ElasticBSP: ZipLine's barrier, after a join, and the ring's barrier weights ----------
    Mutation("zipline-barrier-removed", "ElasticBSP: ZipLine's barrier (barrier right after "
             "monitoring)",
             (("mpsync/server/step_policies.py", "t.iteration[ws] + res.z + 1",
               "t.iteration[ws] + 1"),), (RULES,)),
    Mutation("ebsp-replan-after-join-removed", "ElasticBSP on the PS: plans over the workers "
             "still running after a join",
             (("mpsync/server/step_policies.py",
               "return np.flatnonzero(self.t.active & ~self.t.final_pushed)",
               "return np.flatnonzero(self.t.active)"),),
             (RULES, f"{MPI}::test_ebsp_on_the_ps_keeps_placing_barriers_among_the_workers_left"
                     f"_after_a_join")),
    Mutation("ebsp-ring-same-weights-removed", "ElasticBSP on the ring: same weights at the "
             "barrier (first round's model not made equal)",
             (("mpsync/torch/strategies/__init__.py", "        if self.round == 0:\n            # Every",
               "        if False:\n            # Every"),),
             (f"{MPI}::test_ebsp_on_the_ring_every_worker_holds_the_same_weights_at_every_"
              f"barrier",)),
    # -- ESync: capability test, QUERY-STATE, §4.2 abort ---------------------------------------
    Mutation("esync-capability-test-removed", "ESync: Alg. 1 capability test (first query "
             "not held)",
             (("mpsync/server/family_rules.py",
               "    for m in members:\n        if not es.capability[m] > 0.0:\n"
               "            return HOLD\n    return W.LOCAL\n",
               "    return W.LOCAL\n"),), (RULES,)),
    Mutation("esync-query-state-removed", "ESync: Alg. 2 readiness (READY at every query)",
             (("mpsync/sched/esync.py",
               "    return p == s or ready[s] or capability[p] + eps > rest_time\n",
               "    return True\n"),), (RULES,)),
    Mutation("esync-abort-removed", "ESync §4.2: abort of the iteration READY interrupts",
             (("mpsync/torch/strategies/__init__.py",
               "if self.delayed_ack and self.local_steps > 0 and self.client.ready_arrived():",
               "if False:"),),
             (f"{MPI}::test_esync_delayed_ack_discards_the_iteration_a_ready_interrupts",)),
    # -- OSP: Eq. 5's U_max and Alg. 1's schedule ----------------------------------------------
    Mutation("osp-eq5-removed", "OSP: Eq. 5 U_max (the fixed 0.8 fraction instead)",
             (("mpsync/sched/osp.py",
               "    u = bandwidth * (1.0 + loss_rate) * t_compute / n_workers\n",
               "    u = OSP_MAX_MODEL_FRACTION * model_size\n"),), (RULES,)),
    Mutation("osp-server-u-max-ignored", "OSP: the workers' measured U_max (server uses the cap)",
             (("mpsync/server/step_policies.py",
               "return min(measured, cap) if np.isfinite(measured) else 0.0", "return cap"),),
             (RULES,)),
    Mutation("osp-alg1-epoch1-removed", "OSP: Alg. 1's S(G^u) = 0 in epoch 1",
             (("mpsync/sched/osp.py", "    if epoch == 1:\n        return 0.0\n    if not first",
               "    if not first"),),
             (RULES,)),
    Mutation("osp-alg1-loss-removed", "OSP: Alg. 1's (1 - loss_i/L) scaling of U_max",
             (("mpsync/sched/osp.py",
               "NaN or inf\")\n    s = (1.0 - loss / first_loss) * u_max\n",
               "NaN or inf\")\n    s = u_max\n"),), (RULES,)),
    # -- the fidelity table and the code ------------------------------------------------------
    Mutation("table-drops-a-departure", "fidelity table: a departure the code states is "
             "missing from the DSSP row",
             ((_REG, '"[dssp-first-extra-ok] (mpsync.sched.dssp:dssp_on_push)"',
               '"(mpsync.sched.dssp:dssp_on_push)"'),), (TABLE,)),
    Mutation("table-lists-a-phantom-departure", "fidelity table: the DSSP row lists a "
             "departure the code does not state",
             ((_REG, "s_U [dssp-allowance-left]", "s_U [dssp-allowance-left] [dssp-phantom]"),),
             (TABLE,)),
]


def copy_tree(dest: Path) -> None:
    """The tracked and untracked-but-not-ignored files of the work tree, plus the venv link."""
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard"],
                           capture_output=True, text=True, check=True).stdout.split("\n")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file() and not src.is_symlink():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def apply(root: Path, patches) -> dict[Path, str]:
    saved: dict[Path, str] = {}
    for rel, old, new in patches:
        path = root / rel
        saved.setdefault(path, path.read_text())
        current = path.read_text()
        if current.count(old) != 1:
            raise SystemExit(f"{rel}: the patch text occurs {current.count(old)} times: {old!r}")
        path.write_text(current.replace(old, new))
    return saved


def run_tests(root: Path, tests, timeout: float) -> tuple[int, list[str], str]:
    # A fresh Numba cache for every run: a cached kernel is keyed by its own file only, so a
    # caller compiled before the patch would keep the unpatched callee it inlined.
    cache = root / ".numba-cache"
    shutil.rmtree(cache, ignore_errors=True)
    env = dict(os.environ, PYTHONPATH=str(root), NUMBA_CACHE_DIR=str(cache),
               PYTHONDONTWRITEBYTECODE="1")
    argv = [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *tests]
    try:
        out = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return -1, [], f"timed out after {timeout:.0f} s\n{e.stdout or ''}"
    failed = re.findall(r"^FAILED (\S+)", out.stdout, re.M)
    failed = [f.split("::", 1)[1] if "::" in f else f for f in failed]
    return out.returncode, failed, out.stdout[-3000:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="mutation names to run (default: all)")
    ap.add_argument("--out", help="write the table (Markdown) here too")
    ap.add_argument("--timeout", type=float, default=900.0, help="per test run, seconds")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    with tempfile.TemporaryDirectory(prefix="mpsync-mutations-") as tmp:
        root = Path(tmp)
        copy_tree(root)
        every = sorted({t for m in chosen for t in m.tests})
        t0 = time.perf_counter()
        rc, failed, tail = run_tests(root, every, args.timeout)
        if rc != 0:
            print(f"the tests fail before any mutation ({failed}):\n{tail}")
            return 1
        print(f"baseline: {', '.join(every)} pass ({time.perf_counter() - t0:.0f} s)",
              flush=True)
        rows = []
        for m in chosen:
            saved = apply(root, m.patches)
            t0 = time.perf_counter()
            try:
                rc, failed, tail = run_tests(root, m.tests, args.timeout)
            finally:
                for path, text in saved.items():
                    path.write_text(text)
            caught = rc != 0 and (failed or rc == -1)
            rows.append((m, failed if failed else ([tail.splitlines()[0]] if rc else [])))
            print(f"{m.name}: {'caught' if caught else 'NOT CAUGHT'} by {len(failed)} test(s) "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
            if rc != 0 and not failed:
                print(tail)
    table = ["| mutation | rule or policy removed | tests that failed |", "|---|---|---|"]
    for m, failed in rows:
        table.append(f"| `{m.name}` | {m.what} | "
                     f"{'<br>'.join(f'`{f}`' for f in failed) or '**none: not caught**'} |")
    text = "\n".join(table)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if all(f for _, f in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
