"""Journal tests with real SQLite files: gapless seq under concurrency, durability across kill -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from agents.journal import Journal

ROOT = Path(__file__).resolve().parents[2]


def test_concurrent_appends_have_no_gaps(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j.db", "h")
    n_threads, per = 8, 60

    def writer(k: int) -> None:
        for i in range(per):
            if i % 10 == 0:
                j.append_many([("batch", None, {"w": k, "i": i, "n": n}) for n in range(3)])
            else:
                j.append("ev", None, {"w": k, "i": i})

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = j.events_after(0, limit=100000)
    seqs = [e.seq for e in events]
    assert seqs == list(range(1, len(seqs) + 1))
    assert len(seqs) == n_threads * (per + 2 * (per // 10))
    assert j.last_seq == seqs[-1]
    # a reader asking after any seq gets exactly the rest
    assert [e.seq for e in j.events_after(100, limit=5)] == [101, 102, 103, 104, 105]


def test_epoch_is_stable_and_new_for_a_new_file(tmp_path: Path) -> None:
    a = Journal(tmp_path / "a.db", "h")
    epoch = a.epoch
    a.close()
    assert Journal(tmp_path / "a.db", "h").epoch == epoch
    assert Journal(tmp_path / "b.db", "h").epoch != epoch


WRITER = r"""
import sys
from pathlib import Path
from agents.journal import Journal
j = Journal(Path(sys.argv[1]), "h")
i = 0
while True:
    ev = j.append("tick", None, {"i": i})
    # acknowledged only after the commit returned
    sys.stdout.write(f"{ev.seq}\n"); sys.stdout.flush()
    i += 1
"""


def test_kill9_of_the_writer_loses_no_acknowledged_event(tmp_path: Path) -> None:
    db = tmp_path / "j.db"
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(db)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    acked: list[int] = []
    assert p.stdout is not None
    for line in p.stdout:
        acked.append(int(line))
        if len(acked) >= 300:
            break
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    j = Journal(db, "h")
    assert j.integrity_check() == "ok"
    seqs = [e.seq for e in j.events_after(0, limit=1_000_000)]
    assert seqs == list(range(1, len(seqs) + 1))
    assert set(acked) <= set(seqs)
    # and the journal goes on from where it was
    assert j.append("after", None, {}).seq == seqs[-1] + 1
