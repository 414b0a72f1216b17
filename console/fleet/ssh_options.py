"""Provides what the Fleet knows of SSH before it connects: the client's options and the errors a connection raises.

Kept apart from :mod:`gpudeck.console.fleet.transport` so that a command that never opens an SSH connection (the
local host, ``--help``) never imports asyncssh: the transport, and asyncssh with it, is imported by the first
connection to a remote host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpudeck.agents.wire.errors import AgentError

KEEPALIVE_S = 10.0
KEEPALIVE_COUNT = 3


class HostKeyError(AgentError):
    """The host's SSH key is unknown or changed; nothing was sent to it."""

    code = "host_key"


class SshError(AgentError):
    """The SSH connection could not be made or was refused."""

    code = "ssh"


@dataclass(frozen=True)
class SshOptions:
    """Where the SSH client settings come from (the user's files unless a test says otherwise)."""

    config: Sequence[Path] | None = None  # None: ~/.ssh/config (if it exists)
    known_hosts: Sequence[Path] | None = None  # None: ~/.ssh/known_hosts and /etc/ssh/ssh_known_hosts
    client_keys: Sequence[Path] | None = None  # None: IdentityFile from the config, else ~/.ssh/id_*
    keepalive_s: float = KEEPALIVE_S
    keepalive_count: int = KEEPALIVE_COUNT
    connect_timeout_s: float | None = None  # None: the host's ConnectTimeout in the ssh config, else transport.CONNECT_TIMEOUT_S
    env: dict[str, str] = field(default_factory=dict)

    def config_paths(self) -> list[str]:
        if self.config is not None:
            return [str(p) for p in self.config]
        p = Path("~/.ssh/config").expanduser()
        return [str(p)] if p.exists() else []

    def known_hosts_paths(self) -> list[str]:
        if self.known_hosts is not None:
            return [str(p) for p in self.known_hosts]
        return [str(p) for p in (Path("~/.ssh/known_hosts").expanduser(), Path("/etc/ssh/ssh_known_hosts")) if p.exists()]
