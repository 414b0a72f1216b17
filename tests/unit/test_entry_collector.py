"""entry.collector_off: the `gpudeck` script's short commands (status --host H, the far side's bridge imports) run with
the cyclic collector off and freeze what they made; a caller's in-process ``main(argv)`` (a test's) is left alone."""

from __future__ import annotations

import gc
import subprocess
import sys

from gpudeck.console.entry import collector_off


def test_a_caller_s_process_keeps_its_collector_as_it_was() -> None:
    frozen = gc.get_freeze_count()
    with collector_off(False):
        assert gc.isenabled()
    assert gc.isenabled() and gc.get_freeze_count() == frozen


def test_the_script_s_own_process_runs_the_block_without_the_collector_and_freezes_what_it_made() -> None:
    code = (
        "import gc\n"
        "from gpudeck.console.entry import collector_off\n"
        "try:\n"
        "    with collector_off(True):\n"
        "        assert not gc.isenabled()\n"
        "        kept = [object() for _ in range(1000)]\n"
        "        raise KeyboardInterrupt\n"
        "except KeyboardInterrupt:\n"
        "    pass\n"
        "assert gc.isenabled(), 'the collector is on again after the block, even when it raised'\n"
        "assert gc.get_freeze_count() > 0, 'what the block made is frozen'\n"
        "print('ok')\n"
    )
    cp = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0 and cp.stdout.strip() == "ok", cp.stderr
