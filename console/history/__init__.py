"""Provides the run history: the SQLite replica of every agent's journal, its filter language, and the quarantine of events it could not take."""
