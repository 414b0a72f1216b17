"""A torchrun worker that runs the real worker as its child and records the child's exit code.

torchrun does not report its workers' exit codes when it shuts down on a signal, so the SIGTERM
tests start ``torchrun ... exit_code.py DIR -m gpudeck.trainers.dflash ...``. This process ignores SIGTERM
and SIGINT (the child gets the signals itself: torchrun signals the worker's whole process group,
the test signals the child's pid), waits for the child and writes ``DIR/rank<RANK>.json``
({"pid": child pid, "returncode": its exit code, negative for a signal}), then exits with that
code. At start it writes ``DIR/rank<RANK>.pids`` (its own pid and the child's) for the teardown.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path


def _default_signals() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)


def main() -> int:
    out = Path(sys.argv[1])
    rank = os.environ.get("RANK", "0")
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, *sys.argv[2:]], preexec_fn=_default_signals)
    (out / f"rank{rank}.pids").write_text(f"{os.getpid()} {child.pid}\n")
    rc = child.wait()
    tmp = out / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps({"pid": child.pid, "returncode": rc}) + "\n")
    os.replace(tmp, out / f"rank{rank}.json")
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main())
