"""A run that reports like a trainer: manifest, steps, a checkpoint, done; paced by a go-file."""

import os
import sys
import time

sys.path.insert(0, sys.argv[1])
from gpudeck.trainers.common.telemetry import Telemetry

gate = sys.argv[2]
tel = Telemetry()
tel.manifest(
    params_total=771_000_000,
    params_trainable=771_000_000,
    world_size=1,
    role="trainer",
    device="cpu",
    argv=sys.argv,
    start="fresh",
    pid=os.getpid(),
)
for step in range(1, 6):
    tel.step(step, loss=10.0 / step, tokens_per_s=1000.0 * step)
tel.emit("checkpoint", step=5, path="/tmp/x/step_5", seconds=0.1)
with open(gate + ".ready", "w"):
    pass
while not os.path.exists(gate):  # the test restarts the agent meanwhile
    time.sleep(0.05)
for step in range(6, 9):
    tel.step(step, loss=10.0 / step, tokens_per_s=1000.0 * step)
tel.emit("done", final_step=8, files=[])
