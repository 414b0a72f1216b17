"""Provides the checks that keep a launch from hurting anyone: pre-flight, the memory estimate, containment and membership, attribution of GPU memory, the environment probe and rebuild, leftovers."""
