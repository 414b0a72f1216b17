"""Provides the fleet's host actions: removing hosts from the config (saying what settings went with them) and probing
every host's link (``gpudeck hosts --check``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, fields

from gpudeck.agents.wire.errors import AgentError
from gpudeck.console.core import config as cfg
from gpudeck.console.fleet.fleet import Fleet


@dataclass(frozen=True)
class Removed:
    """One ``hosts remove NAME``: whether it was in the config, and the ``[host.NAME]`` settings removed with it."""

    name: str
    found: bool
    settings: tuple[str, ...] = ()  # the settings that differed from the defaults, as `key = value` (env values left out)

    def line(self, path: str) -> str:
        """What the CLI says about it."""
        if not self.found:
            return f"{self.name}: not in {path} (`gpudeck hosts` lists the hosts)"
        if not self.settings:
            return f"{self.name}: removed from {path}"
        return (
            f"{self.name}: removed from {path}, with its [host.{self.name}] settings ({', '.join(self.settings)}); "
            f"`gpudeck hosts add {self.name}` adds it back without them"
        )


def _set_settings(h: cfg.HostSettings) -> tuple[str, ...]:
    """The settings of ``h`` that differ from a bare host's (env by its names only: values may be secrets)."""
    bare = cfg.HostSettings(name=h.name)
    out = []
    for f in fields(h):
        if f.name == "name" or getattr(h, f.name) == getattr(bare, f.name):
            continue
        value = getattr(h, f.name)
        out.append(f"env {', '.join(sorted(value))}" if f.name == "env" else f"{f.name} = {value!r}")
    return tuple(out)


def remove_hosts(names: list[str]) -> list[Removed]:
    """Remove each host and its ``[host.NAME]`` table from the config; what each removal took with it."""
    out = []
    for name in names:
        before = cfg.load().settings(name)
        found = cfg.remove_host(name)
        out.append(Removed(name, found, _set_settings(before) if found else ()))
    return out


@dataclass(frozen=True)
class Probe:
    """One host's link after a connect attempt."""

    name: str
    state: str
    agent_version: str | None
    error: str | None


async def probe_hosts(fleet: Fleet, names: list[str], timeout: float) -> list[Probe]:
    """Connect to every named host at once (at most ``timeout`` s each): its link state, agent version or error."""

    async def one(name: str) -> Probe:
        link = fleet.link(name)
        try:
            c = await link.client(timeout=timeout)
            return Probe(name, "up", c.hello.agent_version if c.hello else None, None)
        except AgentError as exc:
            return Probe(name, link.status.state, None, exc.message)

    return list(await asyncio.gather(*(one(n) for n in names)))
