"""Issue 32 on a real GPU: the fingerprint names the libnccl torch really loads, and a CUDA process in a container's
cgroup is named by its container through real NVML.

- The cross-node gate compares the NCCL torch reports *and* the path and sha256 of the libnccl it loads: on a CUDA
  build the agent's probe must find the mapped libnccl (or say NCCL is linked into torch), its digest must be the
  file's, and the version must be what ``torch.cuda.nccl.version()`` says here.
- A real CUDA holder placed in a cgroup named as Docker names it (``system.slice/docker-<id>.scope``) must show with
  that container in ``gpudeck status --json`` and in the CONTAINER column, from NVML's own process list (root and a
  writable cgroup v2, else skipped with why).

Run on the accelerator: ``.venv/bin/python -m pytest -q -p no:randomly -s tests/gpu/test_forensics_gpu.py``
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpudeck.agents.wire.protocol import Fingerprint, FingerprintReply
from tests.agent_harness import AgentProc, wait_for
from tests.e2e.test_containers import A, Groups, why_not
from tests.gpu.test_agent_gpu import HOLD

# the holder places itself in its groups before it starts CUDA, as a runtime places a container's first process
PLACED_HOLD = (
    "import os, sys\nfor d in sys.argv[2:]:\n    open(d + '/cgroup.procs', 'w').write(str(os.getpid()))\nsys.argv = sys.argv[:2]\n"
)


def test_the_fingerprint_names_the_libnccl_torch_loads_and_its_digest(agent: AgentProc) -> None:
    import torch

    async def ask() -> FingerprintReply:
        c = await agent.client()
        try:
            got = await c.request(Fingerprint(python=sys.executable), timeout=300)
            assert isinstance(got, FingerprintReply)
            return got
        finally:
            await c.close()

    fp = asyncio.run(ask()).env
    here = ".".join(map(str, torch.cuda.nccl.version()))
    print(f"\nfingerprint: torch {fp.torch} cuda {fp.torch_cuda} nccl (torch says) {fp.nccl} runtime {fp.nccl_runtime}")
    print(f"fingerprint: libnccl {fp.libnccl} sha256 {fp.libnccl_sha256}")
    assert fp.nccl_runtime == here, (fp.nccl_runtime, here)
    assert fp.libnccl, "the probe named no libnccl on a CUDA build"
    if fp.libnccl.startswith("/"):
        data = Path(fp.libnccl).read_bytes()
        assert fp.libnccl_sha256 == hashlib.sha256(data).hexdigest()
    else:
        assert "linked into torch" in fp.libnccl, fp.libnccl


@pytest.fixture
def groups() -> Iterator[Groups]:
    reason = why_not()
    if reason is not None:
        pytest.skip(reason)
    g = Groups()
    try:
        yield g
    finally:
        g.close()


def test_a_cuda_holder_in_a_docker_named_cgroup_is_named_by_its_container_through_nvml(agent: AgentProc, groups: Groups) -> None:
    group = groups.make(f"system.slice/docker-{A}.scope")
    p = subprocess.Popen(
        [sys.executable, "-c", PLACED_HOLD + HOLD, "2", str(group)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"},
    )
    groups.procs.append(p)  # killed by its pid and its group removed by the fixture
    assert p.stdout is not None
    assert p.stdout.readline().startswith("holding"), "the CUDA holder did not start"

    def seen() -> dict | None:
        snap = agent.cli_json("status", "--host", "local")
        return next((q for g in snap["gpus"] for q in g.get("processes", []) if q["pid"] == p.pid and q.get("container")), None)

    got = wait_for(seen, timeout=60, what="the holder with its container in status --json")
    print(f"\nstatus --json: pid {p.pid} on GPU {got['gpu']}: {got['used_bytes'] / 2**30:.2f} GiB, container {got['container']}")
    assert got["container"]["runtime"] == "docker" and got["container"]["id"] == A
    text = agent.cli("status", "--host", "local").stdout
    row = next(line for line in text.splitlines() if line.startswith(str(p.pid)))
    print(f"status: {row}")
    assert "docker:" in row
