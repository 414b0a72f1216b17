"""Provides the judgement of a live run's health: the rules and their alerts, the operator's claims, triage of a hung run, and the Flight Recorder."""
