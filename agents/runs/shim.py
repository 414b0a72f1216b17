"""Provides the run shim: starts a run's argv and records how it ended, even if the agent dies.

The agent starts ``python -m gpudeck.agents.runs.shim STATUS_FD EXIT_FILE [CGROUP_PROCS] -- ARGV...``
in a new session. The shim starts ARGV (no shell) as its child, writes the child's
pid (or the reason it could not start) to STATUS_FD, waits, and writes the
exit status to EXIT_FILE atomically (fsync, rename).

With CGROUP_PROCS (the ``cgroup.procs`` file of the run's cgroup v2 group),
the child moves itself into the group between fork and exec, so the user's
command and everything it forks start inside it; a child that cannot join
is never started. The shim itself stays outside the group: killing the group
never costs the exit status. The shim is a child subreaper, so a process of
the run that double-forks is re-parented to the shim, not to init, and stays
a descendant the agent can find even without a cgroup. It ignores the signals an
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
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)  # 0600 whatever the umask
    os.fchmod(fd, 0o600)
    with open(fd, "w", encoding="utf-8") as fh:
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


PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> None:
    """Orphans of the run are re-parented to the shim (not to init): parentage then keeps finding them."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def main(argv: list[str]) -> int:
    """Run the shim; returns the child's exit code (128+N for a signal)."""
    cgroup_procs: str | None = None
    if len(argv) >= 5 and argv[3] == "--" and argv[2] != "--":
        cgroup_procs = argv[2] if argv[2] != "-" else None
        argv = argv[:2] + argv[3:]
    if len(argv) < 4 or argv[2] != "--":
        print("usage: python -m gpudeck.agents.runs.shim STATUS_FD EXIT_FILE [CGROUP_PROCS] -- ARGV...", file=sys.stderr)
        return 2
    status_fd = int(argv[0])
    exit_file = argv[1]
    cmd = argv[3:]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_IGN)
    _become_subreaper()
    try:
        # the child gets default signal handling back (Popen restores SIGPIPE etc. too)
        child = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            close_fds=True,
            restore_signals=True,
            preexec_fn=_child_setup(cgroup_procs),
        )
    except (OSError, subprocess.SubprocessError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
        if cgroup_procs is not None and not isinstance(exc, OSError):
            reason = f"could not join the run's cgroup ({cgroup_procs}) before starting it; nothing was started"
        _record_exit(exit_file, {"returncode": None, "signal": None, "launch_error": reason, "ended": time.time()})
        _report(status_fd, {"error": reason})
        return 127
    _report(status_fd, {"pid": child.pid})
    rc = _wait_child(child.pid)
    record: dict[str, object] = {"pid": child.pid, "returncode": rc if rc >= 0 else None, "signal": None, "ended": time.time()}
    if rc < 0:
        try:
            record["signal"] = signal.Signals(-rc).name
        except ValueError:
            record["signal"] = f"signal {-rc}"
    _record_exit(exit_file, record)
    _reap_orphans()
    return rc if rc >= 0 else 128 - rc


def _reap_orphans() -> None:
    """Reap the run's orphans that already exited (they came to the subreaper): left, they would wait for init."""
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _wait_child(pid: int) -> int:
    """Reap every child (orphans of the run come to the subreaper) until the run's own child ends; its wait code."""
    while True:
        try:
            got, status = os.waitpid(-1, 0)
        except InterruptedError:  # pragma: no cover
            continue
        except ChildProcessError:  # pragma: no cover - someone else reaped it
            return -signal.SIGKILL
        if got == pid:
            return os.waitstatus_to_exitcode(status)


def _child_setup(cgroup_procs: str | None):
    def setup() -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        if cgroup_procs is not None:
            # "0" moves the writer: the child joins before exec, so nothing of the run starts outside
            fd = os.open(cgroup_procs, os.O_WRONLY)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)

    return setup


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # exit without the interpreter's final flush: on a full disk it fails and turns the run's code into 120
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:
            pass
    os._exit(code)
