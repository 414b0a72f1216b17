"""Runs ``python -m gpudeck.trainers.fsdp_lm``."""

from gpudeck.trainers.common.runtime import run_main
from gpudeck.trainers.fsdp_lm.trainer import main

run_main(main)
