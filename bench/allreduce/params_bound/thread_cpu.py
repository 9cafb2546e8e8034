"""CPU seconds per thread of a running `mpsync train` job, read from /proc.

    python thread_cpu.py SECONDS > threads.txt &   # then start the job

Samples every 0.2 s for SECONDS and prints, for each thread of each Python process whose
command line names mpsync, the last CPU time it saw (user + system).  Two jobs that differ
only in their time budget, subtracted, give the CPU per second of training by thread: the
start-up (imports, the JIT cache) cancels out.
"""

import os
import sys
import time

TICKS = os.sysconf("SC_CLK_TCK")


def scan(seen: dict) -> None:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue            # it ended between the listing and the read
        if "mpsync" not in cmd or "python" not in cmd or "thread_cpu" in cmd:
            continue
        for tid in tids:
            try:
                stat = open(f"/proc/{pid}/task/{tid}/stat").read()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()   # after the command's name
            seen[(int(pid), int(tid))] = (cmd[:100], (int(fields[11]) + int(fields[12])) / TICKS)


def main(seconds: float) -> None:
    seen: dict = {}
    end = time.time() + seconds
    while time.time() < end:
        scan(seen)
        time.sleep(0.2)
    for (pid, tid), (cmd, cpu) in sorted(seen.items()):
        if cpu > 0.05:
            print(f"{pid:>7} {tid:>7} {cpu:8.2f}  {cmd}")


if __name__ == "__main__":
    main(float(sys.argv[1]))
