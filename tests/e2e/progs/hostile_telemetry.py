"""A run that writes hostile lines into its own telemetry file between valid ones, then waits for a gate file."""

import os
import sys
import time

path = os.environ["GPUDECK_TELEMETRY"]
gate = sys.argv[1]
lines = [
    b'{"ts": 1, "rank": 0, "type": "step", "step": 1, "loss": 3.0}',
    b"[" * 5000 + b"]" * 5000,
    b'{"type": "step", "step": 2, "x": ' + b'{"a":' * 2000 + b"1" + b"}" * 2000 + b"}",
    b'{"type": "manifest", "params_total": 18446744073709551616}',
    b'{"type": "step", "step": ' + b"9" * 5000 + b"}",
    b'{"type": "error", "message": "\xff\xfe not utf-8"}',
    b'{"type": "eval", "tau": 1e999}',
    b'{"ts": 2, "rank": 0, "type": "step", "step": 3, "loss": 2.0}',
]
with open(path, "ab") as fh:
    fh.write(b"\n".join(lines) + b"\n")
    fh.write(b'{"type": "done", "final_step": 3}')  # no newline: read when the run has ended
open(gate + ".ready", "w").close()
while not os.path.exists(gate):
    time.sleep(0.05)
