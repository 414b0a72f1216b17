"""Provides the console's screens: fleet, host, runs, run, launch and the dialogs."""
