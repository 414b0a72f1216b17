"""Provides what the agent sees of its host: GPUs (through NVML, or simulated and labelled so), the process table, and runs' telemetry files."""
