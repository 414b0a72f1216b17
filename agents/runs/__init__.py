"""Provides the supervision of runs: the registry of live and ended runs, launch, the shim, the tick, stop, reclaim, adoption after a restart, and how a run's end is decided."""
