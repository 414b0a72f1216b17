"""Fuzz the two decoders of hostile input: the agent's telemetry line decoder and the history's event check.

A mutation fuzzer with a fixed seed (no extra package): each execution takes a
valid record, mutates its bytes (flips, deletions, duplicated slices, brackets,
huge numbers, invalid UTF-8, surrogate escapes), and feeds it to the decoder.
Every execution must end in an accepted record that can be stored (JSON
encodable, every integer within 64 bits; for the history: inserted into a real
SQLite table) or in the decoder's own typed rejection; anything else is a
finding and stops the run. Prints one result line per decoder.

    python bench/fuzz_decoders.py [--n 1000000] [--seed 17] [--only telemetry|history]
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec

from gpudeck.agents.observe.telemetry import INT_MAX, INT_MIN, LineRejected, decode_line
from gpudeck.agents.wire.protocol import Event
from gpudeck.console.history.replica import quarantine

SEEDS = [
    b'{"ts": 1.5, "rank": 0, "type": "step", "step": 12, "loss": 2.25, "tokens_per_s": 1000.0, "mfu": 0.4}',
    b'{"ts": 1, "rank": 3, "type": "manifest", "params_total": 771000000, "world_size": 8, "role": "trainer", "device": "cuda:3", "argv": ["a", "b"]}',
    b'{"type": "done", "final_step": 100, "files": [{"path": "/x", "bytes": 12}]}',
    b'{"type": "error", "message": "CUDA out of memory \\u00e9"}',
    b'{"type": "eval", "tau": 3.5, "nested": {"a": [1, 2, {"b": null}]}}',
]
INSERTS = [
    b"[",
    b"]",
    b"{",
    b"}",
    b'"',
    b"\\",
    b",",
    b":",
    b"1e999",
    b"18446744073709551616",
    b"9" * 30,
    b"\xff",
    b"\xc3",
    b"\\ud800",
    b"-",
    b"NaN",
    b"\x00",
    b"[" * 70,
    b"true",
    b"null",
]


def mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        pos = rng.randrange(len(b) + 1)
        if op == 0 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op == 1 and b:
            del b[pos : pos + rng.randint(1, 8)]
        elif op == 2:
            b[pos:pos] = rng.choice(INSERTS)
        elif op == 3 and b:
            a = rng.randrange(len(b))
            b[pos:pos] = b[a : a + rng.randint(1, 16)]
        else:
            b[pos:pos] = str(rng.choice([2**63, -(2**63) - 1, 2**64, 10**400, 0, -1])).encode()
    return bytes(b)


def ints_ok(v: object) -> bool:
    stack = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, bool):
            continue
        if isinstance(x, int) and not INT_MIN <= x <= INT_MAX:
            return False
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return True


def fuzz_telemetry(n: int, rng: random.Random) -> tuple[int, int, float]:
    accepted = rejected = 0
    t0 = time.perf_counter()
    for _ in range(n):
        raw = mutate(rng, rng.choice(SEEDS))
        try:
            rec, _typed = decode_line(raw)
        except LineRejected:
            rejected += 1
            continue
        if not (isinstance(rec, dict) and isinstance(rec.get("type"), str) and ints_ok(rec)):
            raise AssertionError(f"accepted a record that cannot be stored: {raw!r}")
        msgspec.json.encode(rec)
        accepted += 1
    return accepted, rejected, time.perf_counter() - t0


def fuzz_history(n: int, rng: random.Random) -> tuple[int, int, float]:
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE events (seq INTEGER, ts REAL, kind TEXT, run_id TEXT, data TEXT, step INTEGER)")
    quarantine.create_table(db)
    dec = msgspec.json.Decoder()
    stored = kept_out = 0
    t0 = time.perf_counter()
    for i in range(n):
        raw = mutate(rng, rng.choice(SEEDS))
        try:
            data = dec.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            data = {"undecodable": raw.decode("utf-8", "surrogateescape")}  # a journal row that holds garbage
        odd = rng.random() < 0.05  # now and then the envelope itself is bad too
        ev = Event(
            seq=rng.choice([0, 2**64, -5]) if odd else i + 1,
            ts=float("inf") if odd and rng.random() < 0.5 else 1.5,
            kind=rng.choice(["", "x" * 80]) if odd else "telemetry",
            run_id="\ud800" if odd and rng.random() < 0.3 else "r-1",
            data={"record": data},
        )
        try:
            quarantine.check_event(ev)
        except quarantine.BadEvent as exc:
            if kept_out % 16 == 0:  # the raw copy must always be storable; writing every one would only measure SQLite
                quarantine.put(db, "h", "e", ev, str(exc))
            kept_out += 1
            continue
        rec = ev.data.get("record") if isinstance(ev.data.get("record"), dict) else {}
        step = rec.get("step") if isinstance(rec.get("step"), int) and not isinstance(rec.get("step"), bool) else None
        db.execute("INSERT INTO events VALUES (?,?,?,?,?,?)", (ev.seq, ev.ts, ev.kind, ev.run_id, json.dumps(ev.data), step))
        stored += 1
        if i % 10000 == 0:
            db.execute("DELETE FROM events")
            db.execute("DELETE FROM quarantine")
    return stored, kept_out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--only", choices=("telemetry", "history"), default=None, help="one decoder (each takes 1-2 min at 10^6 on 2 cores)")
    args = ap.parse_args()
    if args.only in (None, "telemetry"):
        a, r, dt = fuzz_telemetry(args.n, random.Random(args.seed))
        print(
            f"fuzz telemetry decode_line: {args.n:,} executions in {dt:.1f} s ({args.n / dt:,.0f}/s): {a:,} accepted (all storable), {r:,} rejected by line, 0 crashes"
        )
    if args.only == "telemetry":
        return
    s, q, dt = fuzz_history(args.n, random.Random(args.seed + 1))
    print(
        f"fuzz history check_event: {args.n:,} executions in {dt:.1f} s ({args.n / dt:,.0f}/s): {s:,} stored in SQLite, {q:,} quarantined, 0 crashes"
    )


if __name__ == "__main__":
    main()
