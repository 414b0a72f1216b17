"""Provides the telemetry writer that trainers use to tell gpudeck's agent about themselves.

Stdlib only: the agent (and anyone's tools) read the file, the trainers write it.
One JSON object per line, appended to the file named by ``GPUDECK_TELEMETRY``;
when the variable is unset nothing is written. Every line has ``ts`` (unix
seconds, float), ``rank`` (global rank, int) and ``type``:

``manifest``   once per rank at start: params_total, params_trainable,
               config_hash, world_size, role, device, gpu_uuid, dataset_samples,
               dataset_tokens, argv, start ("fresh" | "resume N"), kind,
               mfu_convention (what ``mfu`` counts)
``step``       step, loss, tokens_per_s, mfu (causal convention), mfu_torchtitan
               (fsdp_lm), flops_per_token, peak_flops, mem_allocated_gib,
               mem_peak_gib, (queue_depth for split DFlash)
``val_loss``   step, val_loss, val_tokens, seconds (fsdp_lm's validation loss)
``heartbeat``  from every rank at least every 10 s, even while stalled
``checkpoint`` step, path, seconds
``eval``       step, tau (DFlash acceptance length) or other metrics
``done``       final_step, result files
``error``      message (the trainer is about to exit non-zero)

See README.md ("Telemetry") for the full schema.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

HEARTBEAT_INTERVAL_S = 5.0


class Telemetry:
    """Appends telemetry records for one rank; thread-safe; a no-op without a path."""

    def __init__(self, path: str | None = None, rank: int | None = None) -> None:
        self.path = path if path is not None else os.environ.get("GPUDECK_TELEMETRY")
        self.rank = rank if rank is not None else int(os.environ.get("RANK", "0"))
        self._lock = threading.Lock()
        self._fh = None
        self._stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._last_step: int | None = None
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            # line-buffered append: each record lands as one write of one line
            self._fh = open(self.path, "a", buffering=1, encoding="utf-8")

    @property
    def enabled(self) -> bool:
        """True when records are written somewhere."""
        return self._fh is not None

    def emit(self, type_: str, **fields: Any) -> None:
        """Write one record of the given type."""
        if self._fh is None:
            return
        record = {"ts": time.time(), "rank": self.rank, "type": type_}
        record.update(fields)
        line = json.dumps(record, default=str, separators=(",", ":")) + "\n"
        with self._lock:
            self._fh.write(line)
            self._fh.flush()

    def manifest(self, **fields: Any) -> None:
        """Record what this rank is: exact parameter counts, world size, device, data."""
        self.emit("manifest", **fields)

    def step(self, step: int, **fields: Any) -> None:
        """Record one optimizer step's figures."""
        self._last_step = step
        self.emit("step", step=step, **fields)

    def start_heartbeat(self, interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        """Beat from a daemon thread so a rank stalled in data loading still reports."""
        if self._fh is None or self._hb_thread is not None:
            return

        def beat() -> None:
            while not self._stop.wait(interval_s):
                self.emit("heartbeat", step=self._last_step, pid=os.getpid())

        self.emit("heartbeat", step=self._last_step, pid=os.getpid())
        self._hb_thread = threading.Thread(target=beat, name="gpudeck-heartbeat", daemon=True)
        self._hb_thread.start()

    def close(self) -> None:
        """Stop the heartbeat and close the file."""
        self._stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=1.0)
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None

    def __enter__(self) -> Telemetry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
