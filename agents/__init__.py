"""Provides the gpudeck host agent: GPU and process sampling, run supervision, and the journal."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("gpudeck")  # the one version string: pyproject.toml's, through the installed metadata
except PackageNotFoundError:  # a checkout used without installing it (make run / make test install it)
    __version__ = "0+unknown"
