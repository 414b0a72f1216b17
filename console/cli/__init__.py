"""Provides the ``gpudeck`` command line: it parses what the operator asks and prints what ``ops`` answers."""
