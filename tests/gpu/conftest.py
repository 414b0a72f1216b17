"""GPU tests run only where NVML sees a GPU and torch can use it (the accelerator); elsewhere they skip."""

from __future__ import annotations

import pytest


def _gpu_reason() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() < 1:
            return "NVML reports no GPU"
    except Exception as exc:  # no driver, no library
        return f"no NVML: {exc}"
    try:
        import torch

        if not torch.cuda.is_available():
            return "torch sees no CUDA device"
    except ImportError:
        return "torch is not installed"
    return None


REASON = _gpu_reason()


# modules whose tests use CUDA inside the pytest process itself: that process then holds GPU memory (its
# CUDA context at least) until it exits, and gpudeck's pre-flight rightly names it a FOREIGN holder. They run
# after the tests that launch runs through the agent.
IN_PROCESS_CUDA = ("test_dflash_gpu.py",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.fspath.basename in IN_PROCESS_CUDA)  # stable: the order within each group stays
    if REASON is None:
        return
    skip = pytest.mark.skip(reason=f"needs a GPU ({REASON})")
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(skip)
