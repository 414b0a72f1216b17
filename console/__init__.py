"""Provides the gpudeck console: the CLI and (later) the Textual app over the fleet."""
