"""Provides the trainers' step profiler: ``torch.profiler`` over a few steps, then the top kernels and where the time went.

``StepProfiler(start, steps, on_gpu, rank)``: call ``before_step(step)`` at the top of
every step and ``after_step(step)`` at its end. It profiles steps
``start .. start + steps - 1`` (``steps`` 0: never) and, on rank 0, prints lines
beginning with ``profile`` (the bench copies them into its output):

    profile: steps 6..8, 3 steps, 702.4 ms wall, 688.1 ms in GPU kernels (98.0%)
    profile class gemm            452.1 ms  64.4%  (of the wall time)
    profile class attention       101.0 ms  14.4%
    ...
    profile top  1  120.3 ms 17.1%  x 396  sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256...

On CPU the kernels are the CPU operators (``self_cpu_time_total``), so the same
path runs in the CPU tests. ``classify(name)`` puts a kernel in one of
``gemm``, ``attention``, ``triton`` (torch.compile's fused kernels), ``nccl``,
``memory`` (copies, fills), ``optimizer``, ``other``.
"""

from __future__ import annotations

import sys
import time
from typing import Any

TOP = 20

_CLASSES: list[tuple[str, tuple[str, ...]]] = [
    ("nccl", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn_generated_fort_native_sdpa", "_efficient_attention", "softmax_warp")),
    (
        "gemm",
        (
            "gemm",
            "xmma",
            "cutlass",
            "nvjet",
            "aten::mm",
            "aten::addmm",
            "aten::bmm",
            "aten::matmul",
            "aten::linear",
            "sm90_",
            "sm80_",
            "cublas",
            "ampere_",
            "hopper",
        ),
    ),
    ("optimizer", ("adam", "multi_tensor_apply", "foreach")),
    ("triton", ("triton_",)),
    (
        "memory",
        (
            "memcpy",
            "memset",
            "copy_",
            "fill_",
            "cat",
            "elementwise_kernel_with_index",
            "vectorized_elementwise_kernel<4, at::native::FillFunctor",
        ),
    ),
]


def classify(name: str) -> str:
    """The class of a kernel (or CPU operator) name."""
    low = name.lower()
    for cls, keys in _CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


def kernel_times(prof: Any, on_gpu: bool) -> list[tuple[str, float, int]]:
    """(name, self time in ms, calls) of every kernel (GPU) or operator (CPU), largest first."""
    import torch

    rows = []
    for evt in prof.key_averages():
        if on_gpu:
            if getattr(evt, "device_type", None) != torch.autograd.DeviceType.CUDA:
                continue
            dev_us = getattr(evt, "self_device_time_total", None)
            us: float = dev_us if dev_us is not None else getattr(evt, "self_cuda_time_total", 0.0)
        else:
            us = evt.self_cpu_time_total
        if us > 0:
            rows.append((evt.key, us / 1000.0, int(evt.count)))
    if on_gpu and not rows:  # a profiler build without kernel events: operators' device time
        for evt in prof.key_averages():
            us = getattr(evt, "self_device_time_total", 0.0) or getattr(evt, "self_cuda_time_total", 0.0)
            if us > 0:
                rows.append((evt.key, us / 1000.0, int(evt.count)))
    rows.sort(key=lambda r: -r[1])
    return rows


class StepProfiler:
    """Profiles a window of steps and prints where the time went (rank 0)."""

    def __init__(self, start: int, steps: int, on_gpu: bool, rank: int = 0) -> None:
        self.start = start
        self.steps = steps
        self.on_gpu = on_gpu
        self.rank = rank
        self.prof: Any = None
        self.t0 = 0.0
        self.lines: list[str] = []

    @property
    def enabled(self) -> bool:
        return self.steps > 0

    def before_step(self, step: int) -> None:
        """``step`` is the step about to run (1-based)."""
        if not self.enabled or step != self.start:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_gpu else [])
        if self.on_gpu:
            torch.cuda.synchronize()
        self.prof = profile(activities=acts, record_shapes=False, with_stack=False)
        self.prof.__enter__()
        self.t0 = time.perf_counter()

    def after_step(self, step: int) -> None:
        """``step`` is the step just finished."""
        if self.prof is None or step != self.start + self.steps - 1:
            return
        import torch

        if self.on_gpu:
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - self.t0) * 1000.0
        self.prof.__exit__(None, None, None)
        rows = kernel_times(self.prof, self.on_gpu)
        self.prof = None
        self.lines = self.report(rows, wall_ms, step)
        if self.rank == 0:
            for line in self.lines:
                print(line, file=sys.stdout)
            sys.stdout.flush()

    def report(self, rows: list[tuple[str, float, int]], wall_ms: float, last: int) -> list[str]:
        """The ``profile`` lines for kernel rows over a window of ``wall_ms``."""
        busy = sum(r[1] for r in rows)
        what = "GPU kernels" if self.on_gpu else "CPU operators (self time)"
        out = [
            f"profile: steps {self.start}..{last}, {self.steps} steps, {wall_ms:.1f} ms wall, "
            f"{busy:.1f} ms in {what} ({100 * busy / max(wall_ms, 1e-9):.1f}%)"
        ]
        by_class: dict[str, float] = {}
        for name, ms, _ in rows:
            cls = classify(name)
            by_class[cls] = by_class.get(cls, 0.0) + ms
        for cls, ms in sorted(by_class.items(), key=lambda kv: -kv[1]):
            out.append(f"profile class {cls:<10} {ms:9.1f} ms {100 * ms / max(wall_ms, 1e-9):5.1f}%")
        if self.on_gpu:
            idle = max(0.0, wall_ms - busy)
            out.append(
                f"profile class {'(idle)':<10} {idle:9.1f} ms {100 * idle / max(wall_ms, 1e-9):5.1f}%"
                "  (wall time without a kernel, if one stream)"
            )
        for i, (name, ms, calls) in enumerate(rows[:TOP], 1):
            out.append(
                f"profile top {i:2d} {ms:9.1f} ms {100 * ms / max(wall_ms, 1e-9):5.1f}% x{calls:<5d} [{classify(name)}] {name[:140]}"
            )
        return out
