"""Provides ``gpudeck watch``: a headless view of the fleet that sends notifications (apprise) and serves Prometheus metrics.

- :mod:`.rules`: the ``[[notify]]`` rules, checked, and which history events they pick;
- :mod:`.outbox`: the on-disk outbox that makes delivery exactly-once across restarts and network failures;
- :mod:`.deliver`: messages and their delivery through apprise;
- :mod:`.metrics`: the OpenMetrics endpoint (prometheus_client);
- :mod:`.service`: the long-lived process that ties them to the Fleet and the history;
- :mod:`.cli`: the ``watch`` subcommand (``--check``, ``--status``).
"""
