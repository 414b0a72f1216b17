"""Provides gpudeck's training programs: FSDP2 LM pretraining and DFlash drafter training."""
