"""Runs ``python -m gpudeck.trainers.dflash``."""

from gpudeck.trainers.common.runtime import run_main
from gpudeck.trainers.dflash.trainer import main

run_main(main)
