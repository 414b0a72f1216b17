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

Before either parser sees it, the file is checked (:func:`read_config_text`): at most
:data:`MAX_CONFIG_BYTES` (1 MiB), UTF-8, values nested at most :data:`MAX_NESTING` (16)
deep, keys of at most :data:`MAX_KEY_PARTS` (16) dotted parts and at most
:data:`MAX_ITEMS` (10,000) keys, values and tables. Both parsers recurse on nesting
(a RecursionError traceback) and slow down on long dotted keys (one of 50,000 parts:
46-97 s); the check is one regular-expression pass that stops at the first excess, and
each failure is a :class:`ConfigFileError` naming the file and the line.
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
MAX_CONFIG_BYTES = 1 << 20
MAX_NESTING = 16  # arrays and inline tables inside one another (the config needs 2)
MAX_KEY_PARTS = 16  # parts of a dotted key (host.gpu1.env.NAME is 4)
# keys, values, tables and dotted-key parts in all (counted as strings and `=`, `[`, `{`, `,`, `.` outside them): tomlkit
# takes about 0.1 ms for each, more for many dotted keys of one table. 256 hosts with a table and an env each and 64
# rules are about 3,500
MAX_ITEMS = 10_000
# what the check sees of TOML: strings (an unterminated one runs to the end of its line, for the parser to report),
# comments, brackets and braces, the separators that end a key, and dots
_TOKENS = re.compile(
    r'"""[^"\\]*(?:(?:\\.|"(?!""))[^"\\]*)*(?:"""|\Z)'  # a multi-line basic string (loops unrolled: one step a run)
    r"|'''[^']*(?:'(?!'')[^']*)*(?:'''|\Z)"  # a multi-line literal string
    r'|"[^"\\\n]*(?:\\.[^"\\\n]*)*(?:"|$)'  # a basic string
    r"|'[^'\n]*(?:'|$)"  # a literal string
    r"|#[^\n]*|[\[{]|[\]}\s]+|[=,]|\.",  # closing brackets and white space in runs (one match for many)
    re.MULTILINE,
)


class ConfigError(Exception):
    """The config file cannot be read or a host entry is not valid; the message says how to fix it."""


class ConfigFileError(ConfigError):
    """The config file is not one gpudeck reads (too large, not UTF-8, nested too deep, a key too long): which file, which line."""

    def __init__(self, path: Path, line: int | None, problem: str) -> None:
        self.path = path
        self.line = line
        where = f"{path}, line {line}" if line is not None else str(path)
        super().__init__(f"{where}: {problem}")


class ConfigTooLarge(ConfigFileError):
    """The file is larger than :data:`MAX_CONFIG_BYTES`."""


class ConfigNotUtf8(ConfigFileError):
    """The file is not UTF-8 (TOML is)."""


class ConfigTooDeep(ConfigFileError):
    """Arrays or inline tables nested deeper than :data:`MAX_NESTING`."""


class ConfigKeyTooLong(ConfigFileError):
    """A dotted key of more than :data:`MAX_KEY_PARTS` parts."""


class ConfigTooManyItems(ConfigFileError):
    """More than :data:`MAX_ITEMS` keys, values and tables."""


def read_config_text(path: Path) -> str:
    """The config file's text, checked before a TOML parser sees it (see the module); ConfigFileError says what and where."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigTooLarge(path, None, f"larger than {MAX_CONFIG_BYTES // (1 << 20)} MiB, the most gpudeck reads: is it the right file?")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigNotUtf8(path, line, f"byte {data[exc.start]:#04x} is not UTF-8 (TOML files are UTF-8): save it as UTF-8") from None
    _check_shape(path, text)
    return text


def _check_shape(path: Path, text: str) -> None:
    depth = dots = items = 0
    for m in _TOKENS.finditer(text):
        tok = m.group()
        if tok in ("[", "{"):
            depth += 1
            if depth > MAX_NESTING:
                raise ConfigTooDeep(path, _line(text, m), f"arrays or inline tables nested more than {MAX_NESTING} deep: flatten them")
        elif tok[0] in "]}" or tok[0].isspace():
            depth = max(0, depth - tok.count("]") - tok.count("}"))
        elif tok == ".":
            dots += 1
            if dots >= MAX_KEY_PARTS:
                raise ConfigKeyTooLong(path, _line(text, m), f"a dotted key of more than {MAX_KEY_PARTS} parts: use a [table] instead")
        if tok in ("=", ",", "{") or "\n" in tok or "}" in tok:
            dots = 0  # a key starts after these (a float's or a table header's dots are counted until then: a few)
        if tok in ("=", ",", ".", "[", "{") or tok[0] in "\"'":
            items += 1
            if items > MAX_ITEMS:
                raise ConfigTooManyItems(path, _line(text, m), f"more than {MAX_ITEMS:,} keys, values and tables: is it the right file?")


def _line(text: str, m: re.Match[str]) -> int:
    return text.count("\n", 0, m.start()) + 1


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
        text = read_config_text(path)
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f'cannot read {path}: {exc}; fix the file (it is TOML: hosts = ["gpu1", ...])') from exc
        except RecursionError:  # the check above bounds nesting; a parser that still recurses too far is told, not a traceback
            raise ConfigTooDeep(path, None, f"nested too deep for the TOML parser: flatten it (at most {MAX_NESTING} levels)") from None
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
    text = read_config_text(path)
    try:
        return tomlkit.parse(text)
    except RecursionError:
        raise ConfigTooDeep(path, None, f"nested too deep for the TOML parser: flatten it (at most {MAX_NESTING} levels)") from None
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
