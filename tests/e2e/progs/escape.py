"""A run whose processes try to leave it: env-cleared, setsid + double fork, TERM-ignoring, forking during the grace.

``escape.py PIDFILE MODE...`` starts one process per MODE, writes "role pid"
lines to PIDFILE once all are up, then sleeps (the leader exits at once with
``leader-exits``). Modes:

- ``envclear``: a child exec'd with an empty environment (``env -i``), still a descendant;
- ``daemon``: setsid + double fork, re-parented away from the leader (keeps the tag);
- ``daemon-envclear``: setsid + double fork + empty environment (no tag, no parentage to the leader);
- ``deaf``: a child that ignores SIGTERM;
- ``fork-on-term``: the leader, on SIGTERM, forks a TERM-ignoring child (role ``late``) and then exits;
- ``fork-on-term-envclear``: the same, the late child with an empty environment;
- ``leader-exits``: the leader exits once the others are up.
"""

import os
import signal
import sys
import time

SLEEPER = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN) if {deaf} else None\nwhile True: time.sleep(1)\n"

pidfile = sys.argv[1]
modes = sys.argv[2:]
r, w = os.pipe()
expected = 0


def spawn(role: str, *, session: bool, envclear: bool, deaf: bool) -> None:
    """Fork (twice when ``session``) a sleeper that reports ``role pid`` on the pipe."""
    if os.fork() == 0:
        if session:
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
        os.write(w, f"{role} {os.getpid()}\n".encode())
        env = {} if envclear else dict(os.environ)
        os.execve(sys.executable, [sys.executable, "-c", SLEEPER.format(deaf=deaf)], env)


# mode -> (role, own session and double fork, empty environment, ignores SIGTERM)
SPAWNS = {
    "envclear": ("envclear", False, True, False),
    "daemon": ("daemon", True, False, False),
    "daemon-envclear": ("daemon_envclear", True, True, True),
    "deaf": ("deaf", False, False, True),
}
for mode in modes:
    if mode in SPAWNS:
        role, session, envclear, deaf = SPAWNS[mode]
        spawn(role, session=session, envclear=envclear, deaf=deaf)
        expected += 1

late_envclear = "fork-on-term-envclear" in modes
if "fork-on-term" in modes or late_envclear:

    def on_term(_sig, _frame):  # type: ignore[no-untyped-def]
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            with open(pidfile + ".late.tmp", "w") as fh:
                fh.write(f"late {os.getpid()}\n")
            os.replace(pidfile + ".late.tmp", pidfile + ".late")
            env = {} if late_envclear else dict(os.environ)
            os.execve(sys.executable, [sys.executable, "-c", SLEEPER.format(deaf=True)], env)
        time.sleep(0.5)  # the late child is up before the leader goes
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)

os.close(w)
buf = b""
while buf.count(b"\n") < expected:
    chunk = os.read(r, 100)
    if not chunk:
        break
    buf += chunk
time.sleep(0.2)  # the double-forks' middle processes have exited: the daemons are re-parented
with open(pidfile + ".tmp", "w") as fh:
    fh.write(f"main {os.getpid()}\n")
    fh.write(buf.decode())
os.replace(pidfile + ".tmp", pidfile)
print("up", buf.decode().split(), flush=True)
if "leader-exits" in modes:
    sys.exit(0)
while True:
    time.sleep(1)
