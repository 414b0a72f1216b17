"""Provides what every layer of the console shares: formatting, sanitising run-controlled text, the configuration and the typed records."""
