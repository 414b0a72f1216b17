"""A process that "holds" simulated GPU memory: whoever starts it sets GPUDECK_SIM_GPU_MEM.

It sets nothing itself. Prints ``pid N`` (and ``child N`` with --fork-holder,
whose child inherits the environment and so holds too), then ``ready``, then
burns CPU (--busy) or sleeps until killed or --seconds elapse. With
--ignore-term, SIGTERM is ignored (by the child too), like a stuck worker.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time


def run(busy: bool, seconds: float | None) -> None:
    """Burn CPU or sleep until the deadline (forever without one)."""
    deadline = None if seconds is None else time.monotonic() + seconds
    while deadline is None or time.monotonic() < deadline:
        if busy:
            end = time.monotonic() + 0.05
            x = 0
            while time.monotonic() < end:
                x += 1
        else:
            time.sleep(0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic())))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--busy", action="store_true", help="burn one core instead of sleeping")
    ap.add_argument("--fork-holder", action="store_true", help="fork a child that holds too (it outlives a killed parent)")
    ap.add_argument("--ignore-term", action="store_true", help="ignore SIGTERM")
    ap.add_argument("--seconds", type=float, default=None, help="exit after this long (default: run until killed)")
    ap.add_argument(
        "--child-seconds",
        type=float,
        default=None,
        help="with --fork-holder: the child's own lifetime (default: --seconds); longer leaves an orphan",
    )
    args = ap.parse_args()
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = 0
    if args.fork_holder:
        child = os.fork()
        if child == 0:
            run(args.busy, args.child_seconds if args.child_seconds is not None else args.seconds)
            os._exit(0)
    print(f"pid {os.getpid()}", flush=True)
    if child:
        print(f"child {child}", flush=True)
    print("ready", flush=True)
    run(args.busy, args.seconds)
    if child and args.child_seconds is None:
        try:
            os.waitpid(child, 0)
        except ChildProcessError:
            pass
    sys.exit(0)


if __name__ == "__main__":
    main()
