"""Provides the gpudeck host agent: GPU and process sampling, run supervision, and the journal."""

__version__ = "0.1.0"
