"""Provides the agent's wire: everything a client of the agent (the console, the CLI, a test) may import.

The console imports nothing of ``gpudeck.agents`` outside this package (an import-linter contract in
pyproject.toml says so), so what is here is the agent's API, and what is not is the daemon's own:

- ``protocol``: the request/reply/event messages on the agent's socket, their limits and version;
- ``events``: the journal's typed event payloads, as the history replicates them;
- ``errors``: the typed errors both sides raise and send;
- ``client``, ``dial``: connecting to an agent (a Unix socket here, ``gpudeck agent dial`` over SSH);
- ``paths``: where an agent keeps its socket, journal and runs, and the checks on those folders;
- ``causes``: the classification of a run's end cause, applied by both sides;
- ``envdiff``: the rules for comparing two environment fingerprints, and their labels.
"""

__all__ = ["causes", "client", "dial", "envdiff", "errors", "events", "paths", "protocol"]
