"""Provides the FSDP2 causal-LM trainer, run as ``python -m gpudeck.trainers.fsdp_lm`` (see :mod:`.trainer`)."""
