"""Runs ``python -m gpudeck.trainers.prepare``: tokenise a corpus once into memory-mapped token files."""

import sys

from gpudeck.trainers.common.prepare import main

sys.exit(main())
