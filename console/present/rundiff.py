"""Provides what changed between two runs: config and environment side by side, the meaningful first (failure 5).

Both the CLI (``gpudeck diff``) and the console's History screen show this.
Inputs are run records (``History.find``); the environment part uses
:func:`gpudeck.agents.envdiff.diff`, which orders python, torch and its CUDA build, the
driver, NCCL, cuDNN and transformers before leaf packages.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from gpudeck.agents.wire import envdiff
from gpudeck.console.core.fmt import duration
from gpudeck.console.core.records import MetricPoint, RunRecord
from gpudeck.console.ops.figures import run_figures


@dataclass(frozen=True)
class Row:
    """One compared item: its name, the two values, and whether they differ."""

    key: str
    a: str
    b: str
    core: bool = False

    @property
    def differs(self) -> bool:
        return self.a != self.b


@dataclass
class RunDiff:
    """Config, environment and outcome of two runs, compared."""

    a_id: str
    b_id: str
    config: list[Row] = field(default_factory=list)
    environment: list[Row] = field(default_factory=list)
    outcome: list[Row] = field(default_factory=list)
    env_note: str = ""

    @property
    def differences(self) -> int:
        return sum(r.differs for r in (*self.config, *self.environment))


def _v(x: object) -> str:
    if x is None or x == "" or x == [] or x == {}:
        return "-"
    if isinstance(x, float):
        return f"{x:,.4g}" if abs(x) < 1000 else f"{x:,.0f}"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, list):
        return " ".join(str(i) for i in x)
    return str(x)


def diff_runs(
    a: RunRecord, b: RunRecord, a_metrics: list[MetricPoint] | None = None, b_metrics: list[MetricPoint] | None = None
) -> RunDiff:
    """Compare two runs' records (and, when given, their step metrics)."""
    out = RunDiff(a_id=a.id, b_id=b.id)
    sa, sb = a.launch_spec_or_none(), b.launch_spec_or_none()
    for key, va, vb in (
        ("host", a.host, b.host),
        ("kind", a.kind, b.kind),
        ("command", shlex.join(a.argv or []), shlex.join(b.argv or [])),
        ("gpus", a.gpus, b.gpus),
        ("start", a.start, b.start),
        ("python", sa.python if sa else None, sb.python if sb else None),
        ("cwd", a.cwd, b.cwd),
        ("world size", a.world_size, b.world_size),
        ("params", a.params_total, b.params_total),
        ("config hash", a.config_hash, b.config_hash),
        ("dataset samples", a.dataset_samples, b.dataset_samples),
    ):
        out.config.append(Row(key, _v(va), _v(vb)))
    ea, eb = dict(sa.env if sa else {}), dict(sb.env if sb else {})
    for k in sorted(set(ea) | set(eb)):
        if k in ("PATH", "VIRTUAL_ENV", "PYTHONPATH", "CONDA_PREFIX") and ea.get(k) == eb.get(k):
            continue
        out.config.append(Row(f"env {k}", _v(ea.get(k)), _v(eb.get(k))))
    fa, fb = a.env_fingerprint(), b.env_fingerprint()
    if fa is None or fb is None:
        missing = [r.id for r, f in ((a, fa), (b, fb)) if f is None]
        out.env_note = f"no environment fingerprint recorded for {', '.join(missing)} (not a python run, or recorded before fingerprints)"
    else:
        for c in envdiff.diff(fa, fb, ignore=envdiff.PATH_KEYS):
            out.environment.append(Row(c.key.removeprefix("package:") + ("" if c.core else " (package)"), _v(c.a), _v(c.b), core=c.core))
        if not out.environment:
            out.env_note = f"same environment (freeze {fa.freeze_hash[:12]})"
    fa_, fb_ = run_figures(a, a_metrics), run_figures(b, b_metrics)  # the figures every view shows (console/ops/figures.py)
    outcome: tuple[tuple[str, object, object], ...] = (
        ("state", a.state, b.state),
        ("cause", a.cause, b.cause),
        ("cause class", fa_.cause_class, fb_.cause_class),
        ("tokens/s (median)", fa_.tokens_per_s, fb_.tokens_per_s),
        ("peak memory GiB", fa_.peak_mem_gib, fb_.peak_mem_gib),
        ("last step", fa_.last_step, fb_.last_step),
        (
            "elapsed",
            duration(fa_.elapsed_s) if fa_.elapsed_s is not None else None,
            duration(fb_.elapsed_s) if fb_.elapsed_s is not None else None,
        ),
        ("loss", a.last_loss, b.last_loss),
    )
    for key, oa, ob in outcome:
        out.outcome.append(Row(key, _v(oa), _v(ob)))
    return out


def format_diff(d: RunDiff, only_changes: bool = False) -> str:
    """Side-by-side text, differences marked with '*'; values are never cut (a long left value puts the right one on
    the next line, under its column)."""
    lines = []
    width = max((len(r.key) for r in (*d.config, *d.environment, *d.outcome)), default=10)
    col = max(24, max((len(r.a) for r in (*d.config, *d.environment, *d.outcome)), default=0))
    col = min(col, 60)

    def section(title: str, rows: list[Row], always: bool = False) -> None:
        shown = [r for r in rows if always or not only_changes or r.differs]
        lines.append(f"{title}:")
        if not shown:
            lines.append("  (no differences)")
        for r in shown:
            mark = "*" if r.differs else " "
            if len(r.a) > col:
                lines.append(f"{mark} {r.key:<{width}}  {r.a}")
                lines.append(f"  {'':<{width}}  {'':<{col}}  {r.b}")
            else:
                lines.append(f"{mark} {r.key:<{width}}  {r.a:<{col}}  {r.b}")

    lines.append(f"  {'':<{width}}  {d.a_id:<{col}}  {d.b_id}")
    section("config", d.config)
    section("environment (meaningful first)", d.environment)
    if d.env_note:
        lines.append(f"  {d.env_note}")
    section("outcome", d.outcome, always=True)
    return "\n".join(lines)
