"""`gpudeck hosts add/remove` reach a running console (it follows the config file); 'unreachable since' is the
first failure, not the latest retry."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpudeck.console.core import config as cfg
from gpudeck.console.fleet.fleet import Fleet, HostLink
from gpudeck.console.ops.context import Ops
from gpudeck.console.tui.app import GpudeckApp
from gpudeck.console.tui.widgets.keyed_table import KeyedTable
from tests.agent_harness import AgentProc
from tests.functional.helpers import until


async def test_hosts_added_and_removed_in_the_config_show_up_in_a_running_console(agent: AgentProc, tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    cfg.add_host("127.0.0.1", path)  # loopback: nothing listens for ssh there in a test, so it is unreachable at once
    fleet = Fleet(config=cfg.load(path), state_dir=agent.state_dir, interval_s=0.2)
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=(150, 30)):
        table = app.screen.query_one("#fleet-table", KeyedTable)
        await until(lambda: set(table.keys()) == {"local", "127.0.0.1"}, what="the configured hosts")
        assert cfg.add_host("127.0.0.2", path)  # what `gpudeck hosts add` does
        await until(lambda: "127.0.0.2" in table.keys(), timeout=30, what="the added host in the Fleet")
        assert "127.0.0.2" in fleet.links
        assert cfg.remove_host("127.0.0.1", path)  # `gpudeck hosts remove`
        await until(lambda: "127.0.0.1" not in table.keys(), timeout=30, what="the removed host to leave the Fleet")
        assert "127.0.0.1" not in fleet.links and "local" in table.keys()


def test_unreachable_since_is_the_first_failure_not_the_latest_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr("gpudeck.console.fleet.fleet.time.time", lambda: clock[0])
    link = HostLink(cfg.HostSettings(name="gpu9"))
    link._set_state("unreachable", "connect timed out")
    for _ in range(3):  # retries: connecting, then unreachable again, a minute later each
        clock[0] += 60
        link._set_state("connecting", "connect timed out")
        clock[0] += 5
        link._set_state("unreachable", "connect timed out")
    assert link.status.down_since == 1000.0 and link.status.since == clock[0]
    link._set_state("up")
    assert link.status.down_since is None


async def test_a_config_edited_into_one_no_parser_should_see_is_refused_and_the_fleet_stays(agent: AgentProc, tmp_path: Path) -> None:
    """Nested 5000 deep (a RecursionError traceback before): the console says which file and line, and keeps its hosts."""
    path = tmp_path / "config.toml"
    cfg.add_host("127.0.0.1", path)
    fleet = Fleet(config=cfg.load(path), state_dir=agent.state_dir, interval_s=0.2)
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=(150, 30)):
        table = app.screen.query_one("#fleet-table", KeyedTable)
        await until(lambda: set(table.keys()) == {"local", "127.0.0.1"}, what="the configured hosts")
        path.write_text('hosts = ["127.0.0.1", "127.0.0.2"]\nx = ' + "[" * 5000 + "]" * 5000 + "\n")
        said = lambda: [str(n.message) for n in app._notifications if "nested more than" in str(n.message)]
        await until(said, timeout=30, what="the console to say why it cannot read the config")
        assert said()[0].startswith(f"{path}, line 2: arrays or inline tables nested more than {cfg.MAX_NESTING} deep")
        assert set(table.keys()) == {"local", "127.0.0.1"} and set(fleet.links) == {"local", "127.0.0.1"}


async def test_a_changed_host_setting_reaches_a_running_console_at_once(agent: AgentProc, tmp_path: Path) -> None:
    """Fixing `command =` for a host: the console reconnects with it now, not after its old link's backoff (1.5 min)."""
    path = tmp_path / "config.toml"
    path.write_text('hosts = ["127.0.0.1"]\n\n[host."127.0.0.1"]\ncommand = "/nonexistent/gpudeck agent dial"\n')
    fleet = Fleet(config=cfg.load(path), state_dir=agent.state_dir, interval_s=0.2)
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=(150, 30)):
        old = fleet.links["127.0.0.1"]
        assert old.settings.command == "/nonexistent/gpudeck agent dial"
        path.write_text('hosts = ["127.0.0.1"]\n\n[host."127.0.0.1"]\ncommand = "/opt/fixed/gpudeck agent dial"\n')
        await until(lambda: fleet.links["127.0.0.1"] is not old, timeout=30, what="a new link with the new settings")
        assert fleet.links["127.0.0.1"].settings.command == "/opt/fixed/gpudeck agent dial"
        assert "local" in fleet.links
