"""Provides the DFlash drafter trainer, run as ``python -m gpudeck.trainers.dflash`` (see :mod:`.trainer`)."""
