"""Provides the long-run, coverage-guided fuzz target for the agent's wire decoder and the history's filter language (atheris).

Not a pytest file: run it by hand for as long as you like (the hypothesis tests
in this folder are the CI-fast version of the same properties)::

    .venv/bin/pip install atheris
    .venv/bin/python tests/fuzz/atheris_agent.py -max_total_time=300          # both targets
    .venv/bin/python tests/fuzz/atheris_agent.py --target=decode -runs=1000000
    .venv/bin/python tests/fuzz/atheris_agent.py --strict ...                # also crash on the known deep-nesting bug

Targets (chosen by the first input byte unless ``--target`` is given):

- ``decode``: the input, cut into chunks, goes through ``FrameReader`` and every
  frame through ``decode_request``. Contract: a Request, or an ``Error`` with
  code ``bad_json``/``bad_message`` and a message; nothing else, never an
  exception.
- ``query``: the input as text goes to ``compile_query``; the SQL it gives runs
  against the history's real schema in memory. Contract: ``QueryError`` or
  rows; never a ``sqlite3`` error (which would mean user text reached SQL).

A ``RecursionError`` from JSON nested more than ~900 deep is a known bug (see
tests/fuzz/test_protocol_fuzz.py): it is counted and printed at exit instead of
stopping the run, unless ``--strict``. Counts are printed every 100,000
executions; libFuzzer's last line (``Done N runs in S second(s)``) is the total.
"""

from __future__ import annotations

import os
import sqlite3
import sys

import atheris

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

with atheris.instrument_imports():
    import sqlite_utils

    from gpudeck.agents.wire import protocol
    from gpudeck.console.history.query import QueryError, compile_query
    from gpudeck.console.history.replica import ensure_schema

import typing

REQUEST_TYPES = typing.get_args(protocol.Request)
STRICT = "--strict" in sys.argv
TARGET = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--target=")), None)
sys.argv = [a for a in sys.argv if a != "--strict" and not a.startswith("--target=")]
COUNTS = {"decode": 0, "query": 0, "known_deep_nesting": 0}

_db = sqlite3.connect(":memory:")
ensure_schema(sqlite_utils.Database(_db))
_db.execute(
    "INSERT INTO runs(host, id, name, state, created, alerts, alert_count) VALUES ('h', 'r-00000001', 'x''y', 'failed', 1.0, '[]', 0)"
)


def _nesting(data: bytes) -> int:
    depth = best = 0
    for b in data:
        if b in (0x5B, 0x7B):
            depth += 1
            best = max(best, depth)
        elif b in (0x5D, 0x7D):
            depth = max(0, depth - 1)
    return best


def fuzz_decode(data: bytes) -> None:
    COUNTS["decode"] += 1
    fdp = atheris.FuzzedDataProvider(data)
    step = fdp.ConsumeIntInRange(1, 512)
    max_frame = fdp.ConsumeIntInRange(1, protocol.MAX_FRAME)
    stream = fdp.ConsumeBytes(fdp.remaining_bytes())
    fr = protocol.FrameReader(max_frame=max_frame)
    for i in range(0, len(stream), step):
        for frame in fr.feed(stream[i : i + step]):
            if frame is None:
                continue
            if len(frame) > max_frame:
                raise AssertionError("the framer yielded a frame over its limit")
            try:
                out = protocol.decode_request(frame)
            except RecursionError:
                if STRICT or _nesting(frame) < 900:
                    raise
                COUNTS["known_deep_nesting"] += 1
                continue
            if isinstance(out, protocol.Error):
                if out.code not in ("bad_json", "bad_message") or not out.message:
                    raise AssertionError(f"untyped error {out!r}")
            elif not isinstance(out, REQUEST_TYPES):
                raise AssertionError(f"decoded to {type(out)}")
            else:
                again = protocol.decode_request(protocol.encode(out).rstrip(b"\n"))
                if again != out:
                    raise AssertionError(f"round trip changed {out!r} into {again!r}")


def fuzz_query(data: bytes) -> None:
    COUNTS["query"] += 1
    text = atheris.FuzzedDataProvider(data).ConsumeUnicodeNoSurrogates(4096)
    try:
        sql, params = compile_query(text, now=1_800_000_000.0).sql()
    except QueryError:
        return
    _db.execute(sql, params).fetchall()  # any sqlite3 error here is a finding


def one_input(data: bytes) -> None:
    done = COUNTS["decode"] + COUNTS["query"]
    if done and done % 100_000 == 0:
        _report()
    if TARGET == "decode":
        fuzz_decode(data)
    elif TARGET == "query":
        fuzz_query(data)
    elif data:
        (fuzz_query if data[0] & 1 else fuzz_decode)(data[1:])


def _report() -> None:
    total = COUNTS["decode"] + COUNTS["query"]
    print(
        f"\natheris_agent: {total} executions (decode {COUNTS['decode']}, query {COUNTS['query']}); known deep-nesting RecursionErrors skipped: {COUNTS['known_deep_nesting']}",
        flush=True,
    )


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
