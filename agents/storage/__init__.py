"""Provides the agent's durable storage: the journal (SQLite) of every event, replicated by the console's history."""
