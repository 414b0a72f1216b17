"""A plain command (not a gpudeck trainer): reports a few steps through the documented telemetry file, then hangs."""

import json
import os
import time

path = os.environ["GPUDECK_TELEMETRY"]
if os.environ.get("HANG_PLAIN_NONDUMPABLE") == "1":  # prctl(PR_SET_DUMPABLE, 0): only CAP_SYS_PTRACE may read it now
    import ctypes

    assert ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) == 0


def wait_for_the_lock_forever() -> None:
    while True:
        time.sleep(3600)


with open(path, "a", buffering=1) as fh:
    for step in range(1, 6):
        fh.write(json.dumps({"ts": time.time(), "rank": 0, "type": "step", "step": step, "tokens_per_s": 100.0}) + "\n")
        time.sleep(0.2)
wait_for_the_lock_forever()
