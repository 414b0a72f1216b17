"""A distributed-looking run whose ranks do not take each other down (the "crawl" of failure 4).

``ranks.py ROOT N [--sim-gib G] [--seconds S] [--tps T]``: starts N rank processes
(RANK, LOCAL_RANK, WORLD_SIZE set, each in its own session like torchrun's
workers); each writes a manifest, a step record with tokens/s every 0.2 s and a
heartbeat, through trainers/common/telemetry.py. With --sim-gib each rank declares
that much simulated GPU memory on GPU <rank>. The parent waits for every rank
and exits 0; a rank that dies leaves the others running.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

RANK_CODE = r"""
import os, sys, time
sys.path.insert(0, sys.argv[1])
from gpudeck.trainers.common.telemetry import Telemetry
rank = int(os.environ["RANK"]); world = int(os.environ["WORLD_SIZE"]); tps = float(sys.argv[3])
tel = Telemetry()
tel.manifest(params_total=3_066_112, params_trainable=3_066_112, world_size=world, role="trainer", device=f"cpu:{rank}",
             argv=sys.argv, start="fresh", pid=os.getpid(), config_hash="ranks-test", dataset_samples=100, dataset_tokens=12800)
deadline = time.monotonic() + float(sys.argv[2])
step = 0
while time.monotonic() < deadline:
    step += 1
    tel.step(step, loss=5.0 / step, tokens_per_s=tps)
    tel.emit("heartbeat", step=step, pid=os.getpid())
    time.sleep(0.2)
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("n", type=int)
    ap.add_argument("--sim-gib", type=float, default=None)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--tps", type=float, default=1000.0)
    a = ap.parse_args()
    procs = []
    for rank in range(a.n):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(a.n))
        if a.sim_gib is not None:
            env["GPUDECK_SIM_GPU_MEM"] = f"{rank}:{a.sim_gib}"
        procs.append(
            subprocess.Popen([sys.executable, "-c", RANK_CODE, a.root, str(a.seconds), str(a.tps)], env=env, start_new_session=True)
        )
    print("ranks " + " ".join(str(p.pid) for p in procs), flush=True)
    for p in procs:
        p.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
