"""Provides the run report's two renderings: Markdown (a file an operator attaches to a post-mortem) and JSON (``--json``).

Input is :class:`~gpudeck.console.ops.report.RunReport`. Every string in it came from the run or its host and is
hostile: in the Markdown each one goes through :func:`md`, which makes it one line (controls, line breaks and tabs
escaped: console/core/sanitize.py), bounds its length, turns ``<``, ``>`` and ``&`` into entities (no raw HTML) and
backslash-escapes what Markdown would read as markup (``|`` would split a table cell). The environment diff against the
parent run is :func:`gpudeck.console.present.views.run_diff`'s, as ``gpudeck diff`` shows it.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

import msgspec

from gpudeck.console.core.fmt import duration, gib, when
from gpudeck.console.core.sanitize import one_line
from gpudeck.console.ops.report import LEDGER_SOURCE, SCHEMA, ClaimCheck, RunReport
from gpudeck.console.present.rundiff import Row
from gpudeck.console.present.views import run_diff

CELL_LIMIT = 160  # characters of one run-controlled value in a table cell
TEXT_LIMIT = 400  # in running text (a cause, an alert's message)
# what Markdown reads as markup inside a line: code spans, emphasis, links and images, table cells, strikethrough; an
# underscore only where it could open or close emphasis (not inside a word: run_state stays readable)
_MD_SPECIAL = re.compile(r"([\\`*\[\]|~])|(?<![0-9A-Za-z])_|_(?![0-9A-Za-z])")
LOUD = ("CONTRADICTED", "NO EVIDENCE")


def md(value: object, limit: int = CELL_LIMIT) -> str:
    """A hostile value as inline Markdown text: one line, bounded, no HTML, no markup ('-' for nothing)."""
    if value is None or value == "" or value == [] or value == {}:
        return "-"
    text = one_line(str(value), limit)
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _MD_SPECIAL.sub(lambda m: "\\" + m.group(), text)


def _n(v: object) -> str:
    """A figure: integers exactly (a parameter count is never rounded), floats to 4 significant digits."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    return md(v)


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def _verdict(c: ClaimCheck) -> str:
    return f"**{c.verdict}**" if c.verdict in LOUD else c.verdict


def _src(s: str) -> str:
    return md(s) if s else "*no evidence*"


def report_markdown(rep: RunReport) -> str:
    """The report as Markdown."""
    r = rep.run
    title = f"{r.id} ({r.name}) on {r.host}" if r.name else f"{r.id} on {r.host}"
    out = [f"# Run report: {md(title, 300)}", ""]
    bad, none = rep.verdicts("CONTRADICTED"), rep.verdicts("NO EVIDENCE")
    if bad:
        out.append(f"> **CONTRADICTED**: the evidence contradicts the claimed {', '.join(md(w) for w in bad)}.")
    if none:
        out.append(f"> **NO EVIDENCE**: nothing recorded backs the claimed {', '.join(md(w) for w in none)}.")
    out.append(f"> **Outcome**: {md(rep.ending.verdict, TEXT_LIMIT)}")
    out += [
        "",
        f"Written by `gpudeck report` at {when(rep.made)} from the gpudeck history (the replica of {md(r.host)}'s agent journal). "
        "Every figure names its source; a claim nothing recorded can check is marked NO EVIDENCE.",
        "",
    ]
    out += _claims(rep)
    out += _run(rep)
    out += _manifest(rep)
    out += _gpus(rep)
    out += _curve(rep)
    out += _environment(rep)
    out += _incidents(rep)
    out += _ending(rep)
    out += _leftovers(rep)
    return "\n".join(out).rstrip() + "\n"


def _claims(rep: RunReport) -> list[str]:
    rows = [
        [
            md(c.what),
            _n(c.claimed),
            md(c.claim_source) if c.claimed is not None else "-",
            _n(c.evidence),
            _src(c.evidence_source),
            _verdict(c),
            md(c.detail),
        ]
        for c in rep.claims
    ]
    return [
        "## Claims against evidence",
        "",
        *_table(["What", "Claimed", "Claim from", "Evidence", "Evidence from", "Verdict", "Detail"], rows),
        "",
    ]


def _run(rep: RunReport) -> list[str]:
    r = rep.run
    spec = r.launch_spec_or_none()
    claims = spec.claims if spec is not None else None
    note = claims.note if claims is not None else None
    rows = [
        ["run id", md(r.id), "history: runs"],
        ["name", md(r.name), "launch spec"],
        ["kind", md(r.kind), "launch spec"],
        ["command", md(shlex.join(r.argv or []), 300), "launch spec (argv, never a shell)"],
        ["GPUs asked for", md(",".join(str(g) for g in r.gpus) if r.gpus else None), "launch spec (--gpus)"],
        ["start", md(r.start), "launch spec"],
        ["operator", md(r.operator), "launch spec"],
        ["parent run", md(r.parent), "launch spec (relaunch / rollback)"],
        ["operator's note", md(note, TEXT_LIMIT), "launch spec (--note)"],
        ["claims", md(_claims_text(claims)), "launch spec (--claim-… options)"],
        ["created", when(r.created), "run_created event"],
        ["started", when(r.started), "run_state running"],
        ["ended", when(r.ended), "run_state (terminal)"],
        ["elapsed", duration(rep.figures.elapsed_s), "started to ended"],
    ]
    if r.spec_nodes:
        rows.append(["nodes", md(", ".join(r.spec_nodes)), "launch spec (multi-node: this report is of one node)"])
    return ["## The run", "", *_table(["", "Value", "Source"], rows), ""]


def _claims_text(claims: Any) -> str:
    if claims is None:
        return ""
    d = msgspec.to_builtins(claims)
    return ", ".join(f"{k}={v}" for k, v in d.items() if k != "note")


def _manifest(rep: RunReport) -> list[str]:
    out = ["## Manifest (exact figures)", ""]
    m = rep.manifest
    if not m:
        return [*out, "**NO EVIDENCE**: the trainer wrote no manifest (no parameter count, world size or dataset size is recorded).", ""]
    src = f"trainer manifest at {when(rep.manifest_ts)}" if rep.manifest_ts else "trainer manifest"
    rows = []
    for key in (
        "params_total",
        "params_trainable",
        "world_size",
        "device",
        "role",
        "config_hash",
        "dataset_samples",
        "dataset_tokens",
        "start",
    ):
        if key in m:
            rows.append([key, _n(m[key]) if isinstance(m[key], (int, float)) else md(m[key]), md(src)])
    return [*out, *_table(["Figure", "Value", "Source"], rows), ""]


def _gpus(rep: RunReport) -> list[str]:
    out = ["## GPUs held (GPU ledger)", ""]
    gpu = next((c for c in rep.claims if c.what == "GPUs"), None)
    asked = "GPUs " + ",".join(str(g) for g in rep.claimed_gpus) if rep.claimed_gpus else "none (--gpus not given)"
    claimed = f"{_n(gpu.claimed)} ({md(gpu.claim_source)})" if gpu is not None and gpu.claimed is not None else "nothing claimed"
    out.append(f"Claimed: {claimed}; asked for: {md(asked)}. Held, as the run's processes held memory over its life:")
    out.append("")
    if not rep.footprint:
        return [*out, md(rep.ledger_note, TEXT_LIMIT), ""]
    rows = [
        [
            md(f.host),
            str(f.gpu),
            md(f.uuid),
            when(f.first),
            "still held" if f.last is None else when(f.last),
            duration(f.held_s),
            gib(f.peak),
            md(",".join(map(str, f.pids[:16]))),
            md(",".join(map(str, f.ranks))),
        ]
        for f in rep.footprint
    ]
    out += _table(["Host", "GPU", "UUID", "First held", "Last held", "Held for", "Peak GiB", "PIDs", "Ranks"], rows)
    return [*out, "", f"Source: {LEDGER_SOURCE}, {len(rep.holds)} hold(s).", ""]


def _curve(rep: RunReport) -> list[str]:
    c = rep.curve
    out = ["## Loss and throughput", ""]
    if not c.steps:
        return [*out, "**NO EVIDENCE**: no training step was recorded.", ""]
    rows = [
        ["steps in the history", _n(c.steps)],
        ["first / last step", f"{_n(c.first_step)} / {_n(c.last_step)}"],
        ["loss first / last / min", f"{_n(c.loss_first)} / {_n(c.loss_last)} / {_n(c.loss_min)}"],
        ["tokens/s median (min, max)", f"{_n(c.tokens_per_s_median)} ({_n(c.tokens_per_s_min)}, {_n(c.tokens_per_s_max)})"],
        ["peak memory GiB", _n(rep.figures.peak_mem_gib)],
    ]
    return [*out, *_table(["Figure", "Value"], rows), "", f"Source: {md(c.source)}.", ""]


_ENV_FIELDS = (
    ("python", "python_version"),
    ("interpreter", "python"),
    ("torch", "torch"),
    ("torch CUDA build", "torch_cuda"),
    ("cuDNN", "cudnn"),
    ("NCCL (torch reports)", "nccl"),
    ("NCCL loaded", "nccl_runtime"),
    ("libnccl", "libnccl"),
    ("transformers", "transformers"),
    ("driver", "driver"),
    ("freeze hash", "freeze_hash"),
    ("probe error", "error"),
)


def _environment(rep: RunReport) -> list[str]:
    out = ["## Environment", ""]
    env = rep.run.env_fingerprint()
    if env is None:
        out += [md(rep.env_source, TEXT_LIMIT), ""]
    else:
        rows = [[k, md(getattr(env, f))] for k, f in _ENV_FIELDS if getattr(env, f)]
        rows.append(["packages", _n(len(env.packages))])
        rows += [[md(k), md(v)] for k, v in rep.dist_env.items()]
        out += [*_table(["", "Value"], rows), "", f"Source: {md(rep.env_source)}.", ""]
    out += ["### Against the parent run", ""]
    if rep.parent is None:
        return [*out, md(rep.parent_note, TEXT_LIMIT), ""]
    d = run_diff(rep.parent, rep.run, rep.parent_metrics, rep.metrics)
    changed: list[Row] = [row for row in (*d.environment, *d.config) if row.differs]
    out.append(f"Parent: {md(rep.parent.label(), 300)} (from the history; compared as `gpudeck diff` compares).")
    out.append("")
    if not changed:
        return [*out, md(d.env_note or "no differences in environment or configuration"), ""]
    rows = [[md(row.key), md(row.a), md(row.b), "yes" if row.core else ""] for row in changed]
    out += _table(["Changed", "Parent", "This run", "Core"], rows)
    if d.env_note:
        out += ["", md(d.env_note, TEXT_LIMIT)]
    return [*out, ""]


def _incidents(rep: RunReport) -> list[str]:
    out = ["## Alerts, rank deaths, hangs and triage", ""]
    if not rep.alerts and not rep.triages:
        return [*out, "None recorded (alert and triage events).", ""]
    if rep.alerts:
        rows = [
            [
                when(a.ts),
                md(a.kind),
                md(a.severity),
                _n(a.rank),
                _n(a.pid),
                md(a.message, TEXT_LIMIT),
                when(a.cleared) if a.cleared else "not cleared",
            ]
            for a in rep.alerts
        ]
        out += _table(["Raised", "Kind", "Severity", "Rank", "PID", "Message", "Cleared"], rows)
        out += ["", f"Rank deaths: {len(rep.rank_deaths)}; hangs and stragglers: {len(rep.hangs)}. Source: alert events.", ""]
    for t in rep.triages:
        out.append(f"- Triage at {when(t.ts)} ({md(t.reason)}, {len(t.ranks)} rank(s)): likely culprit {md(t.culprit, TEXT_LIMIT)}")
    if rep.triages:
        out += ["", "Source: triage events (`gpudeck show --json` has every rank's stacks).", ""]
    return out


def _ending(rep: RunReport) -> list[str]:
    e = rep.ending
    out = ["## How it ended", "", f"**{md(e.verdict, TEXT_LIMIT)}**", ""]
    rows = [
        ["state", md(e.state), md(e.source)],
        ["cause", md(e.cause, TEXT_LIMIT), md(e.source)],
        ["cause class", md(e.cause_class), "classified from the cause"],
        ["exit code", _n(e.exit_code), md(e.source)],
        ["signal", md(e.signal), md(e.source)],
        ["decided on", md(e.decided_on), md(e.source)],
        ["ended by", md(e.ended_by), md(e.source)],
        ["telemetry records", md(", ".join(e.telemetry_types) or "none"), "telemetry events"],
        ["final step", _n(e.final_step), "the trainer's done record"],
        ["error", md(e.error, TEXT_LIMIT), "the trainer's error record"],
        ["output", f"{e.output_bytes:,} bytes" if e.output_bytes is not None else "-", md(e.output_source)],
    ]
    out += _table(["", "Value", "Source"], rows)
    if e.notes:
        out += ["", *(f"- {md(n, TEXT_LIMIT)}" for n in e.notes)]
    if e.output_tail:
        out += ["", f"Last {len(e.output_tail)} non-blank line(s) of the output:", ""]
        out += [f"- {md(line, CELL_LIMIT)}" for line in e.output_tail]  # escaped like any other value: no raw HTML anywhere
    if rep.preflight is not None:
        failed = [c for c in rep.preflight.checks if not c.ok]
        forced = " (forced past GPU holders, recorded)" if rep.preflight.forced else ""
        verdict = f"{len(failed)} of {len(rep.preflight.checks)} checks failed" if failed else "passed"
        out += ["", f"Pre-flight: {verdict}{forced}. Source: preflight event."]
        out += [f"- {md(c.name)}: {md(c.message, TEXT_LIMIT)}" for c in failed]
    return [*out, ""]


def _leftovers(rep: RunReport) -> list[str]:
    lo = rep.leftovers
    out = ["## Leftovers and what reclaimed them", ""]
    if lo.lingering:
        out.append(f"- Alive at the run's end: pid {md(', '.join(map(str, lo.lingering)))} (run_state event).")
    for h in lo.stale_holds:
        end = f"until {when(h.ended)} ({md(h.end_evidence)})" if h.ended else "still held"
        out.append(
            f"- pid {_n(h.pid)} held GPU {h.gpu} on {md(h.host)} after the run ended (STALE), peak {gib(h.peak)} GiB, {end} (GPU ledger)."
        )
    if lo.stop is not None:
        s = lo.stop
        out.append(
            f"- Stopped by the operator: {len(s.stopped)} process(es), {len(s.survivors)} survivor(s), "
            f"{gib(s.freed_bytes)} GiB freed, GPU verified: {'yes' if s.gpu_verified else 'no'} {md(s.gpu_note)} (run_state stop result)."
        )
    for rc in lo.reclaims:
        out.append(
            f"- Reclaimed at {when(rc.ts)}: pid {md(', '.join(map(str, rc.pids)))}, {md(rc.state)}, {gib(rc.freed_bytes)} GiB freed: "
            f"{md(rc.message, TEXT_LIMIT)} ({md(rc.source)})."
        )
    if len(out) == 2:
        out.append("None recorded: no process outlived the run (run_state), the ledger shows no STALE hold, nothing was reclaimed.")
    return [*out, ""]


# ----------------------------------------------------------------------------- JSON


def report_json(rep: RunReport) -> dict[str, Any]:
    """The report as plain data (``report --json``): the keys are stable under :data:`SCHEMA`."""
    r = rep.run
    d = None
    if rep.parent is not None:
        diff = run_diff(rep.parent, rep.run, rep.parent_metrics, rep.metrics)
        d = [{"key": row.key, "parent": row.a, "run": row.b, "core": row.core} for row in (*diff.environment, *diff.config) if row.differs]
    env = rep.run.env_fingerprint()
    return {
        "schema": SCHEMA,
        "made": rep.made,
        "run": {
            "host": r.host,
            "id": r.id,
            "name": r.name,
            "kind": r.kind,
            "state": r.state,
            "argv": list(r.argv or []),
            "gpus": r.gpus,
            "start": r.start,
            "operator": r.operator,
            "parent": r.parent,
            "created": r.created,
            "started": r.started,
            "ended": r.ended,
            "spec": r.spec,  # --env secrets redacted
        },
        "claims": [vars(c) for c in rep.claims],
        "contradicted": rep.verdicts("CONTRADICTED"),
        "no_evidence": rep.verdicts("NO EVIDENCE"),
        "manifest": rep.manifest,
        "gpus": {
            "asked": rep.claimed_gpus,
            "footprint": [vars(f) for f in rep.footprint],
            "holds": msgspec.to_builtins(rep.holds),
            "note": rep.ledger_note,
            "source": LEDGER_SOURCE,
        },
        "curve": vars(rep.curve),
        "environment": {
            "fingerprint": None
            if env is None
            else {f: getattr(env, f) for _k, f in _ENV_FIELDS} | {"packages": len(env.packages), "dist_env": rep.dist_env},
            "source": rep.env_source,
            "parent": rep.parent.id if rep.parent is not None else None,
            "parent_note": rep.parent_note,
            "diff": d,
        },
        "incidents": {
            "alerts": msgspec.to_builtins(rep.alerts),
            "rank_deaths": len(rep.rank_deaths),
            "hangs": len(rep.hangs),
            "triages": [{"ts": t.ts, "reason": t.reason, "culprit": t.culprit, "ranks": len(t.ranks)} for t in rep.triages],
        },
        "preflight": msgspec.to_builtins(rep.preflight) if rep.preflight is not None else None,
        "ending": vars(rep.ending),
        "leftovers": {
            "lingering": rep.leftovers.lingering,
            "stale_holds": msgspec.to_builtins(rep.leftovers.stale_holds),
            "stop": msgspec.to_builtins(rep.leftovers.stop) if rep.leftovers.stop is not None else None,
            "reclaims": [vars(x) for x in rep.leftovers.reclaims],
        },
    }
