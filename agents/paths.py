"""Provides where the agent keeps its state: the journal, run folders and the socket."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def state_dir() -> Path:
    """The agent's state folder: ``$GPUDECK_HOME/agent`` when set, else the user state dir."""
    home = os.environ.get("GPUDECK_HOME")
    if home:
        return Path(home).expanduser().resolve() / "agent"
    return Path(platformdirs.user_state_dir("gpudeck")) / "agent"


def socket_path(base: Path | None = None) -> Path:
    """The agent's Unix socket, inside a 0700 folder."""
    return (base or state_dir()) / "sock" / "agent.sock"


def journal_path(base: Path | None = None) -> Path:
    """The agent's SQLite journal."""
    return (base or state_dir()) / "journal.db"


def runs_dir(base: Path | None = None) -> Path:
    """Where each run's folder (spec.json, output.log, telemetry.jsonl, exit.json) lives."""
    return (base or state_dir()) / "runs"


def envs_dir(base: Path | None = None) -> Path:
    """Where ``--rebuild-env`` recreates recorded python environments."""
    return (base or state_dir()) / "envs"


def log_path(base: Path | None = None) -> Path:
    """The agent's own log file."""
    return (base or state_dir()) / "agent.log"


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) and make it 0700, so only this user can reach what is inside."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path
