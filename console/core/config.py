"""Provides the console's configuration: where its state lives and which hosts make up the fleet.

``GPUDECK_HOME``, when set, holds all of the console's state (``config.toml``,
``history.db``) as well as the local agent's, so tests and users with several
fleets keep them apart. Otherwise the config is in the user config dir
(``~/.config/gpudeck/config.toml``) and the history in the user data dir.

The config file::

    hosts = ["gpu1", "gpu2"]          # names as in ~/.ssh/config; "local" is always there

    [host.gpu2]                       # optional, per host
    command = "/opt/gpudeck/.venv/bin/gpudeck agent dial"   # what runs over SSH
    rdzv_host = "10.1.0.2"            # address other hosts reach it at (multi-node)
    nccl_socket_ifname = "ib0"
    gloo_socket_ifname = "eth0"

    [[notify]]                        # optional, any number: what `gpudeck watch` sends where (console/watch/)
    to = ["ntfy://ntfy.example/gpudeck"]            # apprise URLs
    on = ["failed", "lost", "alert:rank_died"]      # run states and alert kinds
    match = "host:gpu* kind:fsdp"                   # the history filter language (console/history/query.py)

``gpudeck hosts add/remove`` edit the file with tomlkit, so the user's comments
and layout survive.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import platformdirs

from gpudeck.agents.wire import paths

if TYPE_CHECKING:  # tomlkit is imported by the commands that write the file (hosts add/remove); reading it is tomllib's
    import tomlkit

LOCAL = "local"
DEFAULT_DIAL = "gpudeck agent dial"
_HOST_RE = re.compile(r"^[A-Za-z0-9_.@:\[\]-]{1,253}$")
# what _HOST_RE accepts, in words (every host-name error quotes it)
HOST_NAME_RULE = "1-253 characters from letters, digits and . _ - @ : [ ], not starting with - (gpu1, user@gpu1, [fe80::1])"
_HOST_KEYS = {"command", "rdzv_host", "nccl_socket_ifname", "gloo_socket_ifname", "env"}
_NOTIFY_KEYS = {"to", "on", "match"}
MAX_NOTIFY_RULES = 64


class ConfigError(Exception):
    """The config file cannot be read or a host entry is not valid; the message says how to fix it."""


def home() -> Path | None:
    """``$GPUDECK_HOME`` when set."""
    h = os.environ.get("GPUDECK_HOME")
    return Path(h).expanduser().resolve() if h else None


def config_path() -> Path:
    """The console's config file."""
    h = home()
    return h / "config.toml" if h else Path(platformdirs.user_config_dir("gpudeck")) / "config.toml"


def history_path() -> Path:
    """The console's SQLite history."""
    h = home()
    return h / "history.db" if h else Path(platformdirs.user_data_dir("gpudeck")) / "history.db"


@dataclass(frozen=True)
class HostSettings:
    """One host of the fleet as the config describes it."""

    name: str
    command: str = DEFAULT_DIAL
    rdzv_host: str | None = None
    nccl_socket_ifname: str | None = None
    gloo_socket_ifname: str | None = None
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class NotifyRule:
    """One ``[[notify]]`` table: send events named in ``on`` of runs matching ``match`` to the apprise URLs in ``to``.

    Only the shape is checked here; console/watch/rules.py checks the words of ``on`` and compiles ``match``."""

    to: tuple[str, ...]
    on: tuple[str, ...]
    match: str = ""


@dataclass(frozen=True)
class Config:
    """The fleet: ``local`` first, then the configured hosts in file order; and the notification rules."""

    hosts: tuple[HostSettings, ...]
    path: Path
    notify: tuple[NotifyRule, ...] = ()

    @property
    def names(self) -> list[str]:
        """Host names, ``local`` first."""
        return [h.name for h in self.hosts]

    def settings(self, name: str) -> HostSettings:
        """A host's settings (defaults for a host given only with ``--host``)."""
        for h in self.hosts:
            if h.name == name:
                return h
        return HostSettings(name=name)


def check_host_name(name: str) -> str:
    """A host name as it may appear in the config, or ConfigError."""
    if not _HOST_RE.match(name) or name.startswith("-"):
        raise ConfigError(f"{name!r} is not a host name: use the name of a Host entry in ~/.ssh/config ({HOST_NAME_RULE})")
    return name


def load(path: Path | None = None, extra_hosts: list[str] | None = None) -> Config:
    """Read the config (a missing file is an empty fleet: just ``local``), plus ``--host`` names."""
    path = path or config_path()
    data: dict = {}
    if path.exists():
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f'cannot read {path}: {exc}; fix the file (it is TOML: hosts = ["gpu1", ...])') from exc
    names = data.get("hosts", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f'{path}: `hosts` must be a list of host names, e.g. hosts = ["gpu1", "gpu2"]')
    tables = data.get("host", {})
    if not isinstance(tables, dict):
        raise ConfigError(f"{path}: [host.NAME] tables hold per-host settings")
    out: list[HostSettings] = [HostSettings(name=LOCAL, **_settings(path, LOCAL, tables.get(LOCAL, {})))]
    seen = {LOCAL}
    for n in [*names, *(extra_hosts or [])]:
        if n in seen:
            continue
        check_host_name(n)
        seen.add(n)
        out.append(HostSettings(name=n, **_settings(path, n, tables.get(n, {}))))
    return Config(hosts=tuple(out), path=path, notify=_notify_rules(path, data.get("notify", [])))


def _notify_rules(path: Path, tables: object) -> tuple[NotifyRule, ...]:
    example = '[[notify]] to = ["ntfy://ntfy.example/gpudeck"] on = ["failed"] match = "host:gpu1"'
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ConfigError(f"{path}: notification rules are [[notify]] tables, e.g. {example}")
    if len(tables) > MAX_NOTIFY_RULES:
        raise ConfigError(f"{path}: {len(tables)} [[notify]] tables, at most {MAX_NOTIFY_RULES}: merge rules that send the same events")
    out = []
    for i, t in enumerate(tables, 1):
        unknown = set(t) - _NOTIFY_KEYS
        if unknown:
            raise ConfigError(f"{path}: [[notify]] number {i} has unknown keys {sorted(unknown)}; known: {sorted(_NOTIFY_KEYS)}")
        lists = {}
        for k in ("to", "on"):
            v = t.get(k)
            if not isinstance(v, list) or not v or not all(isinstance(x, str) and x for x in v):
                raise ConfigError(f"{path}: [[notify]] number {i}: `{k}` must be a non-empty list of strings, e.g. {example}")
            lists[k] = tuple(v)
        match = t.get("match", "")
        if not isinstance(match, str):
            raise ConfigError(f'{path}: [[notify]] number {i}: `match` is a history filter as a string, e.g. "host:gpu1 kind:fsdp"')
        out.append(NotifyRule(to=lists["to"], on=lists["on"], match=match))
    return tuple(out)


def _settings(path: Path, name: str, table: object) -> dict:
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [host.{name}] must be a table")
    unknown = set(table) - _HOST_KEYS
    if unknown:
        raise ConfigError(f"{path}: [host.{name}] has unknown keys {sorted(unknown)}; known: {sorted(_HOST_KEYS)}")
    out = {k: v for k, v in table.items()}
    for k, v in out.items():
        if k == "env":
            if not isinstance(v, dict) or not all(isinstance(x, str) for x in v.values()):
                raise ConfigError(f"{path}: [host.{name}] env must be a table of strings")
        elif not isinstance(v, str) or not v:
            raise ConfigError(f"{path}: [host.{name}] {k} must be a non-empty string")
    return out


def _read_doc(path: Path) -> tomlkit.TOMLDocument:
    import tomlkit

    if not path.exists():
        return tomlkit.document()
    try:
        return tomlkit.parse(path.read_text())
    except Exception as exc:  # tomlkit raises its own ParseError family
        raise ConfigError(f"cannot read {path}: {exc}; fix the file first") from exc


def _write_doc(path: Path, doc: tomlkit.TOMLDocument) -> None:
    import tomlkit

    # 0700 folder, 0600 file whatever the umask, never written through a link (paths.private_file checks)
    paths.ensure_private_dir(path.parent)
    tmp = paths.private_file(path.with_suffix(".toml.tmp"))
    with open(tmp, "w") as fh:
        fh.write(tomlkit.dumps(doc))
    os.replace(tmp, path)


def add_host(name: str, path: Path | None = None) -> bool:
    """Add a host to the config; False when it was already there."""
    check_host_name(name)
    if name == LOCAL:
        raise ConfigError("'local' is always part of the fleet; nothing to add")
    path = path or config_path()
    doc = _read_doc(path)
    hosts = doc.get("hosts")
    if hosts is None:
        import tomlkit

        hosts = tomlkit.array()
        doc["hosts"] = hosts
    if name in [str(h) for h in hosts]:
        return False
    hosts.append(name)
    _write_doc(path, doc)
    return True


def remove_host(name: str, path: Path | None = None) -> bool:
    """Remove a host (and its [host.NAME] table); False when it was not there."""
    if name == LOCAL:
        raise ConfigError("'local' is always part of the fleet and cannot be removed")
    path = path or config_path()
    doc = _read_doc(path)
    hosts = doc.get("hosts")
    names = [str(h) for h in hosts] if hosts is not None else []
    if hosts is None or name not in names:
        return False
    del hosts[names.index(name)]
    tables = doc.get("host")
    if tables is not None and name in tables:
        del tables[name]
    _write_doc(path, doc)
    return True
