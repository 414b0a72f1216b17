"""The agent-only install: without the console's packages, `gpudeck agent serve|dial|status|stop` and `--version` still work."""

from __future__ import annotations

import subprocess
import sys

HIDDEN = ("textual", "asyncssh", "sqlite_utils", "rich")  # the console's packages (pyproject's [console] extra)
BLOCK = f"import sys\nHIDDEN = {HIDDEN!r}\nfor m in HIDDEN:\n    sys.modules[m] = None\n"


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK + code], capture_output=True, text=True, timeout=120)


def test_version_and_the_agents_commands_need_no_console_package() -> None:
    cp = _run("from gpudeck.console.entry import main\nraise SystemExit(main(['--version']))")
    assert cp.returncode == 0 and cp.stdout.startswith("gpudeck "), cp.stderr
    # what `gpudeck agent dial` and `gpudeck agent serve` import
    cp = _run("import gpudeck.agents.__main__, gpudeck.agents.wire.dial, gpudeck.agents.server.daemon\nprint('ok')")
    assert cp.returncode == 0 and cp.stdout.strip() == "ok", cp.stderr


def test_a_console_command_on_an_agent_only_install_says_what_to_install() -> None:
    cp = _run("from gpudeck.console.entry import main\nraise SystemExit(main(['status']))")
    assert cp.returncode == 2, cp.stderr
    assert "needs the console's packages" in cp.stderr and "[console]" in cp.stderr and "Traceback" not in cp.stderr


def test_the_agents_commands_usage_lines_name_the_command_as_typed() -> None:
    # `gpudeck agent serve --help` printed `usage: python -m gpudeck.agents [-h] [--state-dir STATE_DIR] {serve,dial}`
    for cmd in ("serve", "dial", "status", "stop"):
        cp = _run(f"from gpudeck.console.entry import main\nraise SystemExit(main(['agent', '{cmd}', '--help']))")
        assert cp.returncode == 0, cp.stderr
        assert cp.stdout.startswith(f"usage: gpudeck agent {cmd} [-h] [--state-dir DIR]"), cp.stdout
    cp = _run("from gpudeck.agents.__main__ import main\nraise SystemExit(main(['serve', '--help']))")
    assert cp.returncode == 0 and cp.stdout.startswith("usage: python -m gpudeck.agents serve [-h] [--state-dir DIR]\n"), cp.stdout
