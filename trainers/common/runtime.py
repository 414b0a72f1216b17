"""Provides the process plumbing shared by gpudeck's trainers (fsdp_lm, dflash).

Public API (kept stable; dflash imports it):

Command line
    ``add_common_args(parser)``  adds the options both trainers share:
        --model-config, --init-from, --data, --tokenizer, --data-dtype,
        --corpus-bytes, --fresh | --resume latest|N, --new-run-dir, --trust-checkpoint,
        --max-steps, --batch-size, --seq-len, --grad-accum, --lr,
        --min-lr-ratio, --warmup-steps, --weight-decay, --grad-clip, --seed,
        --checkpoint-every, --keep, --out DIR, --compile,
        --activation-checkpointing, --log-every, --device.
    ``check_common_args(parser, args)``  calls ``parser.error`` (exit 2) unless
        exactly one of --fresh / --resume was given; validates numbers.

Distributed context
    ``DistContext``  rank, local_rank, world_size, device (torch.device),
        backend ("nccl" | "gloo" | None), distributed (bool), is_main.
    ``init_distributed(device="auto", init_timeout_s=300, single_process_group=False)
        -> DistContext``
        reads torchrun's RANK / WORLD_SIZE / LOCAL_RANK (a plain process is
        world size 1 without a process group unless single_process_group),
        picks cuda:LOCAL_RANK + NCCL when
        CUDA is there (unless device="cpu"), else CPU + gloo.
    ``set_collective_timeout(ctx, seconds)``  shortens the timeout of the
        default process group (torchtitan: 300 s at init, 100 s after step 1).
    ``barrier(ctx)``, ``all_reduce_mean(ctx, value) -> float``.
    ``finish_ok(ctx)``  ``destroy_process_group`` — call on success only.
    ``abort_and_exit(ctx, exc, telemetry=None, code=1)``  the error path: writes
        an ``error`` telemetry record, prints the traceback on stderr, aborts the
        process group (non-collective, bounded in time) and ``os._exit(code)``s
        so that no rank lingers in a collective or in atexit handlers.
    ``run_main(main)``  runs ``main() -> int`` and routes any exception to
        ``abort_and_exit`` (``main`` registers its context with ``register``).
    ``register(ctx=None, telemetry=None)``  tells ``run_main`` what to tear down.

Stopping on a signal (SIGTERM: gpudeck's agent stops a run with SIGTERM to every
process, waits a grace period, then SIGKILLs)
    ``install_stop_flag() -> StopFlag``  SIGTERM/SIGINT handlers that only set
        ``StopFlag.requested``; the trainer polls it once per step, the ranks
        agree, checkpoint, emit ``done`` with ``reason="stopped"`` and exit 0.
        A rank usually gets SIGTERM twice (from the agent and forwarded by
        torchrun): repeated SIGTERMs are the same request. Only a SIGINT after
        the first request (Ctrl-C again) means "leave now" (KeyboardInterrupt,
        the error path).
    ``reduce_mean_and_stop(ctx, value, stop_requested) -> (mean, stop)``  one
        all-reduce over all ranks per step: the mean of ``value`` (the loss)
        and whether any rank asked to stop, so every rank stops after the same
        step.

Device and misc
    ``device_info(device) -> dict``  {"device": "cuda:3", "gpu_uuid": "GPU-…",
        "gpu_name": …} ("cpu", None, None on CPU).
    ``seed_all(seed)``, ``config_hash(obj) -> str`` (sha256 of canonical JSON,
        first 16 hex digits).
    ``maybe_fail_for_test(step, rank)``  test hook: when the environment has
        ``GPUDECK_TEST_FAIL_AT_STEP=N`` (or ``N:R``), raise at step N (on rank R
        only, when given). Used by the e2e tests to check that a failing rank
        takes the whole run down promptly. Has no effect when unset.

This module imports torch lazily inside functions where possible so that
argument errors are reported before the (slow) torch import.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from gpudeck.trainers.errors import EXIT_BAD_INPUT, InputError
from gpudeck.trainers.presets import PRESETS

FAIL_ENV = "GPUDECK_TEST_FAIL_AT_STEP"


# --------------------------------------------------------------------------- CLI


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _resume_value(text: str) -> str:
    if text == "latest":
        return text
    try:
        if int(text) < 0:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"--resume takes 'latest' or a step number, got {text!r}") from None
    return str(int(text))


class TrainerArgumentParser(argparse.ArgumentParser):
    """argparse, except that a bad option is one line on stderr (``prog: error: ...``), not the usage block; exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {' '.join(message.split())} (see --help)\n")


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Add the options shared by fsdp_lm and dflash (see module docstring)."""
    g = parser.add_argument_group("model")
    g.add_argument("--model-config", default=None, help=f"config.json path or preset name ({', '.join(PRESETS)})")
    g.add_argument("--init-from", default=None, help="local pretrained folder to start from (from_pretrained)")

    g = parser.add_argument_group("data")
    g.add_argument(
        "--data",
        default=None,
        help="a folder made by `python -m gpudeck.trainers.prepare`, a token file (.bin), a Hugging Face dataset saved to disk, parquet/arrow files, or a text/JSONL file or folder; default: the built-in offline corpus (Python stdlib sources)",
    )
    g.add_argument("--tokenizer", default=None, help="local tokenizer folder (AutoTokenizer) or 'byte' (default: byte-level)")
    g.add_argument("--data-dtype", default="uint16", choices=["uint16", "uint32"], help="element type of .bin token files")
    g.add_argument(
        "--corpus-bytes", type=_positive_int, default=16 * 1024 * 1024, help="how many bytes of source text the built-in corpus gathers"
    )

    g = parser.add_argument_group("start (pick exactly one)")
    start = g.add_mutually_exclusive_group()
    start.add_argument("--fresh", action="store_true", help="start at step 0; refuses if OUT already holds checkpoints")
    start.add_argument(
        "--resume", type=_resume_value, default=None, metavar="latest|N", help="resume from the latest checkpoint or the one at step N"
    )
    g.add_argument(
        "--new-run-dir",
        action="store_true",
        help="with --fresh: move existing OUT/checkpoints aside to OUT/checkpoints.archived-<UTC time>/ and start a new run there",
    )

    g.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="with --resume: load a checkpoint another user could have written (their folder, group/other-writable, "
        "or saved without digests); the run's telemetry records it",
    )

    g = parser.add_argument_group("training")
    g.add_argument("--max-steps", type=_positive_int, default=100)
    g.add_argument("--batch-size", type=_positive_int, default=8, help="sequences per rank per micro-step")
    g.add_argument("--seq-len", type=_positive_int, default=512)
    g.add_argument("--grad-accum", type=_positive_int, default=1, help="micro-steps per optimizer step")
    g.add_argument("--lr", type=float, default=3e-4)
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine schedule floor as a fraction of --lr")
    g.add_argument("--warmup-steps", type=int, default=None, help="linear warmup steps (default: 5%% of --max-steps)")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)

    g = parser.add_argument_group("checkpoints and output")
    g.add_argument("--checkpoint-every", type=int, default=0, help="save a checkpoint every N steps (0: only at the end)")
    g.add_argument("--keep", type=_positive_int, default=3, help="keep the last K checkpoints")
    g.add_argument("--out", required=True, help="output folder (checkpoints/, final/, result.json)")
    g.add_argument("--log-every", type=_positive_int, default=1)

    g = parser.add_argument_group("performance")
    g.add_argument("--compile", action="store_true", help="torch.compile each decoder block")
    g.add_argument("--activation-checkpointing", action="store_true", help="recompute each decoder block's activations in backward")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])


def check_common_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject a command line without exactly one start, and nonsense numbers (exit 2)."""
    if not args.fresh and args.resume is None:
        parser.error(
            "pick how to start: --fresh (step 0, new checkpoints) or --resume latest|N (continue from a checkpoint); there is no default"
        )
    if args.new_run_dir and not args.fresh:
        parser.error("--new-run-dir only goes with --fresh")
    if args.trust_checkpoint and args.resume is None:
        parser.error("--trust-checkpoint only goes with --resume")
    if args.checkpoint_every < 0:
        parser.error("--checkpoint-every must be >= 0")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        parser.error("--warmup-steps must be >= 0")


# ------------------------------------------------------------------ distributed


@dataclass
class DistContext:
    """Where this process sits in the job."""

    rank: int
    local_rank: int
    world_size: int
    device: Any  # torch.device
    backend: str | None
    distributed: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str = "auto", init_timeout_s: float = 300.0, single_process_group: bool = False) -> DistContext:
    """Initialise torch.distributed from torchrun's environment (or run alone).

    With ``single_process_group=True`` a plain process (no torchrun) still gets a
    one-rank process group (in-memory store), which FSDP2 needs; ``distributed``
    is then True.
    """
    import torch
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and device != "cpu"
    from gpudeck.trainers.common.diagnostics import enable_flight_recorder

    enable_flight_recorder()  # NCCL and gloo (torch >= 2.9): before the process group exists
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda asked for, but torch.cuda.is_available() is False")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
        backend: str | None = "nccl"
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    else:
        dev = torch.device("cpu")
        backend = "gloo"
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if distributed:
        kwargs: dict[str, Any] = dict(backend=backend, timeout=_dt.timedelta(seconds=init_timeout_s))
        if use_cuda:
            kwargs["device_id"] = dev
        dist.init_process_group(**kwargs)
        rank, world = dist.get_rank(), dist.get_world_size()
    elif single_process_group:
        dist.init_process_group(
            backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=_dt.timedelta(seconds=init_timeout_s)
        )
        distributed = True
    else:
        backend = None
    ctx = DistContext(rank, local_rank, world, dev, backend, distributed)
    register(ctx=ctx)
    return ctx


def set_collective_timeout(ctx: DistContext, seconds: float) -> None:
    """Shorten the default group's collective timeout (best effort)."""
    if not ctx.distributed:
        return
    try:
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(_dt.timedelta(seconds=seconds), None)
    except Exception as exc:  # older torch or backend without support
        print(f"[rank {ctx.rank}] could not shorten collective timeout: {exc}", file=sys.stderr)


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        import torch.distributed as dist

        if ctx.backend == "nccl":
            dist.barrier(device_ids=[ctx.local_rank])
        else:
            dist.barrier()


def all_reduce_mean(ctx: DistContext, value: Any) -> float:
    """Mean over ranks of a float or 0-d tensor; returns a Python float."""
    import torch
    import torch.distributed as dist

    t = value.detach().float().reshape(1) if torch.is_tensor(value) else torch.tensor([float(value)])
    if ctx.distributed:
        t = t.to(ctx.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t = t / ctx.world_size
    return float(t.item())


def finish_ok(ctx: DistContext | None) -> None:
    """Clean shutdown: destroy the process group (success path only)."""
    if ctx is not None and ctx.distributed:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _abort_pg() -> None:
    try:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return
        try:
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group()
            return
        except ImportError:
            pass
        pg = dist.group.WORLD
        if pg is not None and hasattr(pg, "abort"):
            pg.abort()
    except Exception:
        pass


_REGISTERED: dict[str, Any] = {"ctx": None, "telemetry": None}


def register(ctx: DistContext | None = None, telemetry: Any = None) -> None:
    """Remember what ``run_main`` must tear down on error."""
    if ctx is not None:
        _REGISTERED["ctx"] = ctx
    if telemetry is not None:
        _REGISTERED["telemetry"] = telemetry


def abort_and_exit(ctx: DistContext | None, exc: BaseException, telemetry: Any = None, code: int = 1, bad_input: bool = False) -> None:
    """Error path: telemetry ``error`` record, the error on stderr, abort, ``os._exit``.

    ``bad_input`` (an :class:`~gpudeck.trainers.errors.InputError` or :class:`ExitWith`): one line, the
    message that says what to fix, no traceback; otherwise the type, the message and the traceback (a bug).
    """
    rank = ctx.rank if ctx is not None else int(os.environ.get("RANK", "0"))
    message = f"{type(exc).__name__}: {exc}"
    try:
        if telemetry is not None:
            telemetry.emit("error", message=message, exit_code=code)
    except Exception:
        pass
    try:
        if bad_input:
            sys.stderr.write(f"[rank {rank}] error: {' '.join(str(exc).split())}\n")
        else:
            sys.stderr.write(f"[rank {rank}] error: {message}\n")
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        sys.stderr.flush()
        sys.stdout.flush()
    except Exception:
        pass
    # abort is non-collective but can block inside a broken communicator: bound it
    t = threading.Thread(target=_abort_pg, daemon=True)
    t.start()
    t.join(timeout=10.0)
    try:
        if telemetry is not None:
            telemetry.close()
    except Exception:
        pass
    os._exit(code)


class ExitWith(Exception):
    """Raise to leave with a given exit code and a message (e.g. 2 for bad usage)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def run_main(main: Callable[[], int]) -> None:
    """Run ``main``; exit with its code, or tear everything down on an exception."""
    try:
        code = main()
    except SystemExit:
        raise
    except ExitWith as exc:
        abort_and_exit(_REGISTERED["ctx"], exc, _REGISTERED["telemetry"], code=exc.code, bad_input=True)
        return
    except InputError as exc:
        abort_and_exit(_REGISTERED["ctx"], exc, _REGISTERED["telemetry"], code=EXIT_BAD_INPUT, bad_input=True)
        return
    except BaseException as exc:
        abort_and_exit(_REGISTERED["ctx"], exc, _REGISTERED["telemetry"], code=1)
        return
    sys.exit(code or 0)


# ------------------------------------------------------------------ stopping on a signal


class StopFlag:
    """Whether this process was asked to stop; set by the handlers ``install`` puts in place.

    ``requested`` (bool) and ``signal_name`` (the first signal, e.g. "SIGTERM", or None).
    """

    def __init__(self) -> None:
        self.requested = False
        self.signal_name: str | None = None

    def install(self) -> StopFlag:
        """Handle SIGTERM and SIGINT in this (main) thread; returns self."""

        def handler(signum, frame):
            if self.requested:
                # the agent signals every process and torchrun forwards what it got, so a
                # rank commonly sees SIGTERM twice: that is still the one request
                if signum == signal.SIGINT:
                    raise KeyboardInterrupt(f"SIGINT after {self.signal_name}: leaving now")
                return
            self.requested = True
            self.signal_name = signal.Signals(signum).name
            # from now on the OS ignores SIGTERM: a late duplicate cannot kill the process even
            # while Python shuts down (which puts the handlers it installed back to the default)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handler)
        return self


def install_stop_flag() -> StopFlag:
    """Make SIGTERM / SIGINT ask for a graceful stop instead of killing the process.

    Call it early in ``main`` (before the slow setup): a signal during setup is
    remembered. The handlers only set ``StopFlag.requested``; the trainer checks it
    once per step through ``reduce_mean_and_stop`` (or an equivalent vote over all
    ranks), so all ranks stop after the same step, save a checkpoint, emit a
    ``done`` record with ``reason="stopped"`` and exit 0 — within the agent's grace
    period (30 s by default) before its SIGKILL. Further SIGTERMs are ignored (one
    rank gets one from the agent and one from torchrun), at the OS level from the
    first request on (``SIG_IGN``, which Python keeps through its shutdown, so a late
    duplicate cannot turn a clean exit 0 into a death by SIGTERM); a SIGINT after
    the first signal raises KeyboardInterrupt (leave now, through the error path).
    """
    return StopFlag().install()


def reduce_mean_and_stop(ctx: DistContext, value: Any, stop_requested: bool) -> tuple[float, bool]:
    """One all-reduce (SUM) over all ranks of ``[value, stop_requested]``.

    Returns (the mean of ``value`` over ranks as a Python float, whether any rank
    asked to stop). Collective: every rank calls it once per step, at the same point.
    Without a process group (or with one rank) it returns the local values.
    """
    import torch
    import torch.distributed as dist

    v = value.detach().float().reshape(()) if torch.is_tensor(value) else torch.tensor(float(value))
    red = torch.stack([v.to(ctx.device), torch.tensor(float(stop_requested), device=ctx.device)])
    if ctx.distributed and ctx.world_size > 1:
        dist.all_reduce(red, op=dist.ReduceOp.SUM)
        red[0] /= ctx.world_size
    mean, votes = red.tolist()
    return mean, votes > 0


# ------------------------------------------------------------------ misc


def device_info(device: Any) -> dict[str, Any]:
    """Describe a device for the manifest: name like ``cuda:3`` plus GPU uuid/name."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return {"device": str(dev.type), "gpu_uuid": None, "gpu_name": None}
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    uuid_s = None
    if uuid is not None:
        uuid_s = str(uuid)
        if not uuid_s.startswith("GPU-"):
            uuid_s = "GPU-" + uuid_s
    return {"device": f"cuda:{index}", "gpu_uuid": uuid_s, "gpu_name": props.name}


def seed_all(seed: int) -> None:
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def config_hash(obj: Any) -> str:
    """Stable short hash of a JSON-able object (e.g. a model config dict)."""
    text = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def maybe_fail_for_test(step: int, rank: int) -> None:
    """Test hook: raise at step N when GPUDECK_TEST_FAIL_AT_STEP=N[:RANK] is set."""
    spec = os.environ.get(FAIL_ENV)
    if not spec:
        return
    at, _, only_rank = spec.partition(":")
    if int(at) == step and (not only_rank or int(only_rank) == rank):
        raise RuntimeError(f"{FAIL_ENV}={spec}: injected failure at step {step} on rank {rank}")
