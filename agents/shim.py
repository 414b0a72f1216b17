"""Provides the run shim: starts a run's argv and records how it ended, even if the agent dies.

The agent starts ``python -m agents.shim STATUS_FD EXIT_FILE -- ARGV...`` in a
new session. The shim starts ARGV (no shell) as its child, writes the child's
pid (or the reason it could not start) to STATUS_FD, waits, and writes the
exit status to EXIT_FILE atomically (fsync, rename). It ignores the signals an
operator's stop sends, so it outlives the run by a moment and the exit status
is never lost; it keeps no GPU memory and exits as soon as the child does.
Stdlib only: it starts fast and imports nothing of the agent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


def _write_exit(path: str, record: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(record, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _report(fd: int, msg: dict) -> None:
    """Tell the agent how the start went; an agent that died meanwhile must not take the run down with the shim."""
    try:
        os.write(fd, json.dumps(msg).encode() + b"\n")
    except OSError:
        pass
    finally:
        try:
            os.close(fd)
        except OSError:
            pass


def _record_exit(path: str, record: dict) -> None:
    """Write exit.json; when that fails (disk full), say so on stderr (the run's output.log): the exit code still reaches the agent."""
    try:
        _write_exit(path, record)
    except OSError as exc:
        try:
            print(f"gpudeck-shim: could not write {path} ({exc.strerror}); the run ended with {record}", file=sys.stderr, flush=True)
        except OSError:
            pass


def main(argv: list[str]) -> int:
    """Run the shim; returns the child's exit code (128+N for a signal)."""
    if len(argv) < 4 or argv[2] != "--":
        print("usage: python -m agents.shim STATUS_FD EXIT_FILE -- ARGV...", file=sys.stderr)
        return 2
    status_fd = int(argv[0])
    exit_file = argv[1]
    cmd = argv[3:]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_IGN)
    try:
        # the child gets default signal handling back (Popen restores SIGPIPE etc. too)
        child = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            close_fds=True,
            restore_signals=True,
            preexec_fn=_default_signals,
        )
    except OSError as exc:
        reason = f"{type(exc).__name__}: {exc}"
        _record_exit(exit_file, {"returncode": None, "signal": None, "launch_error": reason, "ended": time.time()})
        _report(status_fd, {"error": reason})
        return 127
    _report(status_fd, {"pid": child.pid})
    while True:
        try:
            rc = child.wait()
            break
        except InterruptedError:  # pragma: no cover
            continue
    record = {"pid": child.pid, "returncode": rc if rc >= 0 else None, "signal": None, "ended": time.time()}
    if rc < 0:
        try:
            record["signal"] = signal.Signals(-rc).name
        except ValueError:
            record["signal"] = f"signal {-rc}"
    _record_exit(exit_file, record)
    return rc if rc >= 0 else 128 - rc


def _default_signals() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # exit without the interpreter's final flush: on a full disk it fails and turns the run's code into 120
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:
            pass
    os._exit(code)
