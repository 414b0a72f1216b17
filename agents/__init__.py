"""Provides the gpudeck host agent: GPU and process sampling, run supervision, and the journal."""

from __future__ import annotations


def __getattr__(name: str) -> str:
    """``__version__``, read on first use: the one version string, pyproject.toml's, through the installed metadata.

    Read lazily because importlib.metadata costs every process that imports any of gpudeck.agents (the console's
    CLI through the wire package, `gpudeck agent dial` on every SSH connection) more than most of what they run;
    only the daemon's Hello and ``--version`` print it."""
    if name != "__version__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("gpudeck")
    except PackageNotFoundError:  # a checkout used without installing it (make run / make test install it)
        found = "0+unknown"
    globals()["__version__"] = found
    return found
