"""A simulated GPU holder whose hold changes: it holds the first of ``--stages`` GiB on ``--gpu``, then re-execs itself
(same pid, same start time) holding the next, every ``--after`` seconds, and sleeps in the last until killed or
``--seconds`` elapse.

The simulated sampler reads a holder's ``GPUDECK_SIM_GPU_MEM`` from its environment, which a running process cannot
change; an exec can, and the agent's process table re-reads a process that exec'd while it is young (3 s), so every
re-exec happens within 3 s of the start. Prints ``pid N`` and ``ready`` once.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

STAGE = "GPUDECK_TEST_GROWER_STAGE"


def started() -> float:
    """This process's start (wall clock), as the kernel has it: the same across its execs."""
    with open("/proc/self/stat", "rb") as fh:
        data = fh.read()
    ticks = int(data[data.rfind(b")") + 2 :].split()[19])
    with open("/proc/stat", "rb") as fh:
        boot = next(int(line.split()[1]) for line in fh if line.startswith(b"btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--stages", required=True, help="GiB held at each stage, e.g. 2,20,40")
    ap.add_argument("--after", type=float, default=1.0, help="seconds in each stage but the last (from the process's start)")
    ap.add_argument("--seconds", type=float, default=600.0, help="seconds in the last stage")
    args = ap.parse_args()
    stages = [float(s) for s in args.stages.split(",")]
    if (len(stages) - 1) * args.after >= 3.0:
        ap.error("every re-exec must come within 3 s of the start (the agent re-reads only young processes)")
    i = int(os.environ.get(STAGE, "-1"))
    if i < 0:  # the first stage's declaration put in the environment the agent reads (a caller may set both itself)
        os.execve(
            sys.executable, [sys.executable, *sys.argv], dict(os.environ, GPUDECK_SIM_GPU_MEM=f"{args.gpu}:{stages[0]}", **{STAGE: "0"})
        )
    if i == 0:
        print(f"pid {os.getpid()}", flush=True)
        print("ready", flush=True)
    if i + 1 < len(stages):
        # timed from the process's start, not from this exec's (each python start-up would push the next one later)
        time.sleep(max(0.0, started() + (i + 1) * args.after - time.time()))
        env = dict(os.environ, GPUDECK_SIM_GPU_MEM=f"{args.gpu}:{stages[i + 1]}", **{STAGE: str(i + 1)})
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    time.sleep(args.seconds)


if __name__ == "__main__":
    main()
