"""Provides the harness the trainer e2e tests share: start torchrun jobs, read telemetry, stop every process by pid.

Every process a test starts is recorded (torchrun's pid, each worker's pid from
its telemetry, and the exit-code wrappers' pids from their pid files) and
stopped by pid in teardown, after checking that the pid's environment carries
the test's GPUDECK_RUN_ID, so a reused pid is never hit. Workers live in their
own sessions, so a process-group kill would miss them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXIT_CODE = Path(__file__).resolve().parent / "e2e" / "progs" / "exit_code.py"


# fsdp_lm's "tiny" preset on a 1 MiB built-in corpus: the arguments every CPU test of fsdp_lm starts from
FSDP_SMALL = [
    "--model-config",
    "tiny",
    "--seq-len",
    "64",
    "--batch-size",
    "4",
    "--corpus-bytes",
    str(1024 * 1024),
    "--lr",
    "1e-3",
    "--warmup-steps",
    "2",
]
# a random-weight tiny target (fsdp_lm's "tiny" preset: Llama, 4 layers, hidden 256, vocab 320) and a
# 2-layer drafter: the DFlash arguments every CPU test of the trainer starts from
DFLASH_SMALL = [
    "--target-config",
    "tiny",
    "--seq-len",
    "64",
    "--batch-size",
    "2",
    "--num-anchors",
    "8",
    "--block-size",
    "4",
    "--gamma",
    "2",
    "--drafter-layers",
    "2",
    "--corpus-bytes",
    str(600_000),
]
# the split topology on three ranks: two target ranks feed one drafter rank
DFLASH_SPLIT = ["--topology", "split", "--target-ranks", "0,1", "--drafter-ranks", "2", "--queue-depth", "2"]


class WritesMarker:
    """Unpickling this writes ``marker`` (``pathlib`` only: any process can unpickle it): proof that a checkpoint's pickle ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "pwned"))


def fsdp_lm_argv(
    out: Path, *extra: str, nproc: int | None = None, batch_size: int = 2, seq_len: int = 64, corpus_bytes: int = 400_000
) -> list[str]:
    """The tiny fsdp_lm that trains until it is stopped: under torchrun on ``nproc`` ranks (None: one plain process)."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if nproc is not None else []
    return [
        sys.executable,
        *launcher,
        "-m",
        "gpudeck.trainers.fsdp_lm",
        "--model-config",
        "tiny",
        "--fresh",
        "--out",
        str(out),
        "--max-steps",
        "100000",
        "--batch-size",
        str(batch_size),
        "--seq-len",
        str(seq_len),
        "--corpus-bytes",
        str(corpus_bytes),
        "--no-export",
        *extra,
    ]


def fsdp_endless_argv(out: Path, nproc: int, *extra: str) -> list[str]:
    """torchrun of the tiny fsdp_lm on CPU that trains until it is stopped (the supervision, hang and stop tests' run)."""
    return fsdp_lm_argv(out, *extra, nproc=nproc)


def dflash_records_args(folder: Path) -> list[str]:
    """DFlash on prompt/response records (400, seeded) with a token budget and a sliding-window drafter, files written to ``folder``."""
    import numpy as np

    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta"]
    data = folder / "chat.jsonl"
    with open(data, "w") as fh:
        for _ in range(400):
            prompt = " ".join(rng.choice(words, int(rng.integers(1, 6))))
            response = " ".join(rng.choice(words, int(rng.integers(2, 14))))
            fh.write(json.dumps({"prompt": prompt, "response": response}) + "\n")
    dcfg = folder / "drafter.json"
    layout = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8, "use_sliding_window": True}
    dcfg.write_text(json.dumps({**layout, "block_size": 4}))
    return ["--target-config", "tiny", "--data", str(data), "--seq-len", "64", "--token-budget", "192", "--num-anchors", "8"] + [
        "--drafter-config",
        str(dcfg),
        "--gamma",
        "2",
    ]


@contextmanager
def steps_in_this_process() -> Iterator[None]:
    """A trainer's steps driven in pytest's process: the signal handlers its set-up installs and its one-rank group are undone after."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_telemetry(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _pid_has_tag(pid: int, run_id: str) -> bool:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"GPUDECK_RUN_ID={run_id}".encode() in env.split(b"\0")


class Runs:
    """Starts trainer processes and remembers them (and their workers) for teardown."""

    def __init__(self) -> None:
        self.procs: list[tuple[subprocess.Popen, str]] = []
        self.telemetry: list[tuple[Path, str]] = []
        self.pid_dirs: list[tuple[Path, str]] = []

    def start(
        self,
        module: str,
        args: list[str],
        out: Path,
        nproc: int | None = None,
        env: dict[str, str] | None = None,
        exit_codes: Path | None = None,
        stderr: int = subprocess.STDOUT,
    ) -> tuple[subprocess.Popen, Path]:
        """Start a run; with ``exit_codes`` (torchrun only) each worker goes through
        progs/exit_code.py, which writes the worker's exit code to that folder."""
        run_id = f"test-{uuid.uuid4().hex[:10]}"
        tel = out.parent / f"{out.name}-{run_id}.jsonl"
        e = dict(os.environ)
        e.update({"GPUDECK_RUN_ID": run_id, "GPUDECK_TELEMETRY": str(tel), "PYTHONUNBUFFERED": "1"})
        e.pop("GPUDECK_TEST_FAIL_AT_STEP", None)
        e.update(env or {})
        if nproc is None:
            # threads that sleep while they wait: spinning ones stall badly when the 2 cores are shared
            e.setdefault("OMP_WAIT_POLICY", "PASSIVE")
            cmd = [sys.executable, "-m", module, *args, "--out", str(out)]
        else:
            e["OMP_NUM_THREADS"] = "1"  # two ranks on two cores
            e.setdefault("PET_LOG_DIR", str(out.parent / f"{out.name}-{run_id}-torchelastic"))  # not a /tmp/torchelastic_* left behind
            entry = ["-m", module]
            if exit_codes is not None:
                exit_codes.mkdir(parents=True, exist_ok=True)
                self.pid_dirs.append((exit_codes, run_id))
                entry = [str(EXIT_CODE), str(exit_codes), *entry]
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "1",
                "--nproc-per-node",
                str(nproc),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(_free_port()),
                *entry,
                *args,
                "--out",
                str(out),
            ]
        p = subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)
        self.procs.append((p, run_id))
        self.telemetry.append((tel, run_id))
        return p, tel

    def finish(self, p: subprocess.Popen, timeout: float) -> tuple[str, str | None]:
        """Wait for a run started here: (stdout, stderr or None when merged); fails on timeout."""
        try:
            return p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.teardown()
            output, _ = p.communicate()
            pytest.fail(f"{p.args[:6]} did not finish in {timeout}s:\n{output[-4000:]}")

    def run(
        self, module: str, args: list[str], out: Path, nproc: int | None = None, env: dict[str, str] | None = None, timeout: float = 150.0
    ):
        t0 = time.monotonic()
        p, tel = self.start(module, args, out, nproc, env)
        output, _ = self.finish(p, timeout)
        return p.returncode, output, read_telemetry(tel), time.monotonic() - t0

    def worker_pids(self) -> list[tuple[int, str]]:
        """(pid, run id) of every worker that reported a pid in its telemetry."""
        return sorted({(int(r["pid"]), run_id) for tel, run_id in self.telemetry for r in read_telemetry(tel) if "pid" in r})

    def teardown(self) -> None:
        for p, _ in self.procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=5)
        tagged = set(self.worker_pids())
        for folder, run_id in self.pid_dirs:
            for f in folder.glob("*.pids"):
                tagged |= {(int(x), run_id) for x in f.read_text().split()}
        for pid, run_id in sorted(tagged):
            if _pid_has_tag(pid, run_id):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def alive(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
