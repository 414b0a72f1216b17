"""Provides the figures the CLI and the console both show for a run, each defined once.

- tokens/s: the median over the run's recorded steps (the last value seen only when no step was recorded);
- last step: the trainer's final step when it reported one, else the last step seen;
- peak memory (GiB), elapsed (started to ended, or to now while it runs), and the cause class.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from msgspec import UNSET

from gpudeck.agents.wire.causes import cause_class
from gpudeck.console.core import fmt  # the console's one clock (tests pin it)
from gpudeck.console.core.records import MetricPoint, RunRecord


@dataclass(frozen=True)
class RunFigures:
    """A run's figures as every view shows them."""

    tokens_per_s: float | None
    last_step: int | None
    peak_mem_gib: float | None
    elapsed_s: float | None
    cause_class: str | None


def median_tokens_per_s(metrics: Iterable[MetricPoint]) -> float | None:
    """The median tokens/s over recorded steps (None when none recorded one)."""
    values = [float(m.tokens_per_s) for m in metrics if isinstance(m.tokens_per_s, (int, float))]
    return statistics.median(values) if values else None


def run_figures(row: RunRecord, metrics: Iterable[MetricPoint] | None = None, now: float | None = None) -> RunFigures:
    """The figures of a run's record (and its step metrics, when read)."""
    tps = median_tokens_per_s(metrics or [])
    if tps is None:
        median = row.tokens_per_s_median
        tps = median if median is not UNSET and median is not None else row.tokens_per_s
    step = row.final_step if row.final_step is not None else row.last_step
    started, ended = row.started, row.ended
    elapsed = fmt.elapsed(started, ended) if now is None else (max(0.0, float(ended or now) - float(started)) if started else None)
    cls = row.cause_class
    if not cls and row.cause:
        cls = cause_class(row.state, str(row.cause))
    return RunFigures(
        tokens_per_s=float(tps) if isinstance(tps, (int, float)) else None,
        last_step=int(step) if isinstance(step, int) else None,
        peak_mem_gib=float(row.mem_peak_gib) if isinstance(row.mem_peak_gib, (int, float)) else None,
        elapsed_s=elapsed,
        cause_class=cls or None,
    )


def tokens_text(value: float | None) -> str:
    """tokens/s as every view writes it."""
    return "-" if value is None else f"{value:,.0f}"
