"""Provides what run-controlled text goes through before a person sees it: terminal escaping and secret redaction.

Pure functions, no I/O. A run controls its name, argv, environment, output
and the cause text its exit leaves; any of them can hold escape sequences
(set the window title, clear the screen, write the clipboard with OSC 52),
bidirectional overrides that reorder what is shown, or secrets passed with
``--env``.

- :func:`escape_controls` makes every control character visible as a Python
  style escape (``\\x1b``, ``\\x07``, ``\\u202e``): C0 (except the newline and
  tab a caller keeps), DEL, C1, the bidirectional controls and the line and
  paragraph separators. An ESC sequence is defused by escaping its ESC; the
  rest of it shows as plain text.
- :func:`one_line` is the same for a string shown where one row is expected (a dialog's title, a form's field, a
  line of a list): every control is escaped, line breaks and tabs too, and it is cut at :data:`LINE_LIMIT`
  characters with an ellipsis.
- :func:`redact_env`, :func:`redact_record` and :func:`redact_run` replace the values of environment
  variables whose names look like secrets (:data:`SECRET_RULE`, built from
  :data:`SECRET_WORDS` and :data:`SECRET_ANYWHERE`) with ``REDACTED``, for
  every view, ``--json`` included, unless asked not to.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # records (and msgspec, the wire's protocol with them) are loaded by whoever has one to redact:
    # the parser quotes SECRET_RULE in its help, and `gpudeck --help` must not pay for them
    from gpudeck.console.core.records import EventRecord, RunRecord

REDACTED = "REDACTED"

# C0 and DEL, C1, bidi embeddings/overrides/isolates, LRM/RLM/ALM, line and paragraph separators, BOM
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ufeff]")
# the one secret-name rule: the matcher, the --show-secrets help and the docs all come from these two tuples
SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "SECRETS", "PASSWD", "CREDENTIAL", "CREDENTIALS", "APIKEY")  # a whole _-separated word
SECRET_ANYWHERE = ("PASSWORD", "PRIVATE")  # anywhere in the name
SECRET_RULE = (
    f"case-insensitive, a _-separated word {', '.join(SECRET_WORDS[:-1])} or {SECRET_WORDS[-1]} anywhere in the name "
    f"(HF_TOKEN, AWS_SECRET_ACCESS_KEY, KEY_FILE), or {' or '.join(SECRET_ANYWHERE)} anywhere (MYPASSWORD)"
)
_SECRET_NAME = re.compile(
    rf"(^|_)({'|'.join(map(re.escape, SECRET_WORDS))})($|_)|{'|'.join(map(re.escape, SECRET_ANYWHERE))}", re.IGNORECASE
)


def _visible(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def escape_controls(text: str, keep: str = "") -> str:
    """``text`` with every control character shown as an escape, except those in ``keep`` (e.g. ``"\\n\\t"``)."""
    if not keep:
        return _CONTROLS.sub(_visible, text)
    return _CONTROLS.sub(lambda m: m.group() if m.group() in keep else _visible(m), text)


LINE_LIMIT = 200  # characters of one run-controlled string shown on one row (a name, a command line, a cause)


def one_line(text: str, limit: int = LINE_LIMIT) -> str:
    """``text`` as one row: every control escaped (line breaks and tabs too), cut at ``limit`` characters with '…'."""
    out = escape_controls(text)
    return out if len(out) <= limit else out[: max(0, limit - 1)] + "…"


def has_controls(text: str) -> bool:
    """Whether :func:`escape_controls` would change ``text``."""
    return _CONTROLS.search(text) is not None


def terminal_text(text: str) -> str:
    """A whole human view, ready to print: its own line breaks and tabs stay, every other control is escaped."""
    return escape_controls(text, keep="\n\t")


def escape_tree(value: Any) -> Any:
    """``value`` (JSON-like: dicts, lists, strings) with :func:`escape_controls` applied to every string, keys too."""
    if isinstance(value, str):
        return escape_controls(value)
    if isinstance(value, Mapping):
        return {escape_controls(k) if isinstance(k, str) else k: escape_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [escape_tree(v) for v in value]
    return value


def is_secret_name(name: str) -> bool:
    """Whether an environment variable's name looks like it holds a secret (``HF_TOKEN``, ``AWS_SECRET_ACCESS_KEY``, ``DB_PASSWORD``)."""
    return bool(_SECRET_NAME.search(name))


def redact_env(env: Mapping[str, str] | None) -> dict[str, str] | None:
    """``env`` with the values of secret-looking names replaced by ``REDACTED``."""
    if env is None:
        return None
    return {k: (REDACTED if is_secret_name(str(k)) and v else v) for k, v in env.items()}


def redact_record(rec: RunRecord) -> RunRecord:
    """A history record with its ``--env`` secrets redacted (the recorded spec's env)."""
    if not isinstance(rec.spec, Mapping) or not isinstance(rec.spec.get("env"), Mapping):
        return rec
    from msgspec import structs

    return structs.replace(rec, spec={**rec.spec, "env": redact_env(rec.spec["env"])})


def redact_events(events: list[EventRecord]) -> list[EventRecord]:
    """A run's events with the ``--env`` secrets of the specs they carry redacted."""
    from msgspec import structs

    out = []
    for e in events:
        spec = e.data.get("spec") if isinstance(e.data, Mapping) else None
        if isinstance(spec, Mapping) and isinstance(spec.get("env"), Mapping):
            e = structs.replace(e, data={**e.data, "spec": {**spec, "env": redact_env(spec["env"])}})
        out.append(e)
    return out


def redact_run(run: Mapping[str, Any]) -> dict[str, Any]:
    """``gpudeck runs --json``'s object for a run (the printing edge: RunInfo's JSON shape) with its ``--env`` secrets redacted."""
    out = dict(run)
    spec = out.get("spec")
    if isinstance(spec, Mapping):
        spec = dict(spec)
        if isinstance(spec.get("env"), Mapping):
            spec["env"] = redact_env(spec["env"])
        out["spec"] = spec
    if isinstance(out.get("env_vars"), Mapping):
        out["env_vars"] = redact_env(out["env_vars"])
    if isinstance(out.get("nodes"), list):
        out["nodes"] = [redact_run(n) if isinstance(n, Mapping) else n for n in out["nodes"]]
    if isinstance(out.get("events"), list):
        out["events"] = [_redact_event(e) for e in out["events"]]
    return out


def _redact_event(event: Any) -> Any:
    if not isinstance(event, Mapping) or not isinstance(event.get("data"), Mapping):
        return event
    data = dict(event["data"])
    if isinstance(data.get("spec"), Mapping):
        data["spec"] = redact_run({"spec": data["spec"]})["spec"]
    return {**event, "data": data}


def redact_raw_event(raw: str) -> str:
    """A quarantined event's raw JSON (``history --problems --json``) with the ``--env`` secrets of the spec it carries
    redacted; unchanged when it holds none (or is not JSON)."""
    try:
        event = json.loads(raw)
    except ValueError:
        return raw
    redacted = _redact_event(event)
    return raw if redacted == event else json.dumps(redacted, ensure_ascii=True)
