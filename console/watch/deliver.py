"""Provides the watcher's messages and their delivery through apprise.

A message says what happened and what to do: the run (id and name), the host, the state and its cause or the
alert's text, the last step, and the command to look (``gpudeck show RUN --host HOST``). Everything in it that
came from a host (names, causes, alert texts) is bounded and has its control characters escaped. A message about
an event that happened while the watcher was not running says so (``[late]``). Every message ends with its event
key, ``host/epoch/seq``, the key delivery is counted by.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from gpudeck.console.core.sanitize import escape_controls
from gpudeck.console.watch.targets import privacy_form, scrub

_TYPES = {
    "failed": "failure",
    "lost": "failure",
    "preflight_failed": "failure",
    "succeeded": "success",
    "started": "info",
    "stopped": "info",
}
SEND_TIMEOUT_S = 15.0  # apprise's own connect/read timeouts are shorter; this bounds a whole send


@dataclass(frozen=True)
class Message:
    """A notification as sent: title, body, and apprise's notify type (info, success, warning, failure)."""

    title: str
    body: str
    notify_type: str


def _clean(value: object, limit: int) -> str:
    text = escape_controls(str(value))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def compose(word: str, host: str, key: str, run_id: str, ts: float, data: dict[str, Any], run: dict[str, Any], late: bool) -> Message:
    """The message for one event (``word``: its on word, ``data``: the event's data, ``run``: its run's history row)."""
    rid = _clean(run_id, 80)
    h = _clean(host, 80)
    name = f" ({_clean(run['name'], 80)})" if run.get("name") else ""
    lines = []
    if word.startswith("alert:"):
        alert = data.get("alert", data) if isinstance(data.get("alert", data), dict) else {}
        severity = _clean(alert.get("severity") or "warning", 20)
        kind = word.removeprefix("alert:")
        title = f"gpudeck: {kind} on run {rid}{name} on {h}"
        notify_type = "failure" if severity == "critical" else "warning"
        lines.append(f"alert {kind} ({severity}) on run {rid}{name} on {h}, state {_clean(run.get('state') or '?', 20)}")
        if alert.get("message"):
            lines.append(_clean(alert["message"], 1000))
    else:
        state = "running" if word == "started" else word
        title = f"gpudeck: run {rid}{name} {state} on {h}"
        notify_type = _TYPES.get(word, "info")
        lines.append(f"run {rid}{name} on {h}: {state}")
        cause = data.get("cause") or run.get("cause")
        if cause:
            lines.append(f"cause: {_clean(cause, 1000)}")
        if data.get("exit_code") is not None:
            lines.append(
                f"exit code {_clean(data['exit_code'], 20)}" + (f", signal {_clean(data['signal'], 20)}" if data.get("signal") else "")
            )
    if run.get("kind"):
        step = f", step {_clean(run['last_step'], 20)}" if run.get("last_step") is not None else ""
        loss = f", loss {float(run['last_loss']):.4g}" if isinstance(run.get("last_loss"), (int, float)) else ""
        lines.append(f"kind {_clean(run['kind'], 20)}{step}{loss}")
    lines.append(f"look: gpudeck show {rid} --host {h}")
    if late:
        title = "[late] " + title
        lines.append(f"[late] this happened at {_when(ts)}, while gpudeck watch was not running")
    else:
        lines.append(f"at {_when(ts)}")
    lines.append(f"event {key}")
    return Message(title=title, body="\n".join(lines), notify_type=notify_type)


def test_message(now: float | None = None) -> Message:
    """What ``gpudeck watch --check`` sends to every target."""
    now = time.time() if now is None else now
    return Message(
        title="gpudeck: test notification",
        body=f"gpudeck watch --check sent this at {_when(now)}: this target will get gpudeck's notifications.",
        notify_type="info",
    )


class UnusableTarget(Exception):
    """Apprise cannot use this URL at all (unknown scheme, malformed): retrying will not help."""


def send(url: str, msg: Message) -> str | None:
    """Send one message to one apprise URL (blocking: call it in a thread); None when the target accepted it, else why not."""
    import apprise

    ap = apprise.Apprise()
    if not ap.add(url):
        raise UnusableTarget(
            f"apprise cannot use the URL {privacy_form(url)}: check its scheme and form (https://github.com/caronc/apprise/wiki)"
        )
    lines: list[str] = []
    result: Any = False
    try:
        result = ap.notify(title=msg.title, body=msg.body, notify_type=msg.notify_type)
    except Exception as exc:  # a plugin's own failure is the target failing (retried), told without the URL's secrets
        result, lines = False, [f"{type(exc).__name__}: {exc}"]
    if result:
        return None
    # this call's own warnings, as apprise (2.x) keeps them per attempt: a logger-wide capture took those of the sends
    # to other targets running at the same time too. They may quote the URL's path and query: its secrets are hidden
    for res in getattr(result, "results", ()):
        lines += [e.message for at in res.attempts for e in at.logs if e.level in ("WARNING", "ERROR", "CRITICAL")]
    why = scrub(" ".join(line.strip() for line in lines if line.strip()), url)[-500:]
    return why or f"{privacy_form(url)} did not accept the message"
