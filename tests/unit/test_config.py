"""The fleet config: hosts add/remove keep the user's file, bad entries say how to fix them."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpudeck.console.core import config as cfg


def test_add_and_remove_keep_comments_and_tables(tmp_path: Path) -> None:
    p = tmp_path / "config.toml"
    p.write_text('# my fleet\nhosts = ["gpu1"]  # the big one\n\n[host.gpu1]\ncommand = "/opt/gd/bin/gpudeck agent dial"\n')
    assert cfg.add_host("gpu2", p) is True
    assert cfg.add_host("gpu2", p) is False
    text = p.read_text()
    assert "# my fleet" in text and "# the big one" in text and "/opt/gd/bin/gpudeck" in text
    conf = cfg.load(p)
    assert conf.names == ["local", "gpu1", "gpu2"]
    assert conf.settings("gpu1").command == "/opt/gd/bin/gpudeck agent dial"
    assert conf.settings("gpu2").command == cfg.DEFAULT_DIAL
    assert cfg.remove_host("gpu1", p) is True
    assert cfg.load(p).names == ["local", "gpu2"]
    assert "[host.gpu1]" not in p.read_text()
    assert cfg.remove_host("gpu1", p) is False


def test_missing_file_is_just_local_and_extra_hosts_join(tmp_path: Path) -> None:
    conf = cfg.load(tmp_path / "none.toml", extra_hosts=["gpu9", "local"])
    assert conf.names == ["local", "gpu9"]


@pytest.mark.parametrize(
    "text,match",
    [
        ("hosts = 3", "must be a list"),
        ("hosts = [", "cannot read"),
        ('hosts = ["ok"]\n[host.ok]\ncolour = "red"', "unknown keys"),
        ('hosts = ["-oProxyCommand=evil"]', "not a host name"),
    ],
)
def test_bad_config_says_what_to_fix(tmp_path: Path, text: str, match: str) -> None:
    p = tmp_path / "config.toml"
    p.write_text(text)
    with pytest.raises(cfg.ConfigError, match=match):
        cfg.load(p)


def test_local_cannot_be_added_or_removed(tmp_path: Path) -> None:
    with pytest.raises(cfg.ConfigError):
        cfg.add_host("local", tmp_path / "c.toml")
    with pytest.raises(cfg.ConfigError):
        cfg.remove_host("local", tmp_path / "c.toml")


def test_gpudeck_home_holds_the_console_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUDECK_HOME", str(tmp_path))
    assert cfg.config_path() == tmp_path.resolve() / "config.toml"
    assert cfg.history_path() == tmp_path.resolve() / "history.db"
