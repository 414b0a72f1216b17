"""Provides what both trainers share: runtime, checkpoints, telemetry, diagnostics, profiling, FLOPs, data, corpora, config limits."""
