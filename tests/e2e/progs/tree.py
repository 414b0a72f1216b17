"""A run whose process tree is hard to stop: a setsid grandchild that ignores SIGTERM, and an orphan.

Writes "role pid" lines to the file named by argv[1] once every process is up.
"""

import os
import signal
import sys
import time

out = sys.argv[1]
pids = {"main": os.getpid()}

# 1. a grandchild in its own session that ignores SIGTERM (torchrun workers live in their own sessions)
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.write(w, f"stubborn {os.getpid()}\n".encode())
        while True:
            time.sleep(1)
    os._exit(0)

# 2. a child whose parent exits at once, so it is re-parented to init
if os.fork() == 0:
    if os.fork() == 0:
        os.write(w, f"orphan {os.getpid()}\n".encode())
        while True:
            time.sleep(1)
    os._exit(0)

os.close(w)
buf = b""
while buf.count(b"\n") < 2:
    buf += os.read(r, 100)
for line in buf.decode().split("\n"):
    if line:
        role, pid = line.split()
        pids[role] = int(pid)
os.wait()
os.wait()
with open(out + ".tmp", "w") as fh:
    for role, pid in pids.items():
        fh.write(f"{role} {pid}\n")
os.replace(out + ".tmp", out)
print("tree up", pids, flush=True)
while True:
    time.sleep(1)
