"""Provides the command ``python -m gpudeck.trainers.prepare`` (the code is :mod:`gpudeck.trainers.common.prepare`)."""
