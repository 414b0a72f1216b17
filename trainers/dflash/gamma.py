"""Provides the DFlash loss's position-decay gamma: the published value per block size, or the one given.

Plain Python (no torch), so that checking ``--block-size``/``--gamma`` before a run starts (trainers/dflash/config.py)
imports no torch: a refused run answers in a fraction of a second rather than after torch's import. The loss
(trainers/dflash/loss.py) re-exports both names.
"""

from __future__ import annotations

GAMMA_TABLE = {8: 4.0, 10: 5.0, 16: 7.0}


class GammaError(ValueError):
    """A block size outside the published gamma table, and no gamma given."""


def decay_gamma(block_size: int, gamma: float | None = None) -> float:
    """The position-decay gamma: ``gamma`` when given, else the published value for the block size.

    The DFlash paper and SpecForge's recipes publish gamma for B=8 (4), B=10 (5) and B=16 (7)
    only; for any other block size there is no reference value, so none is invented.
    """
    if gamma is not None:
        if not gamma > 0:
            raise GammaError(f"gamma must be positive (got {gamma})")
        return float(gamma)
    if block_size in GAMMA_TABLE:
        return GAMMA_TABLE[block_size]
    raise GammaError(
        f"block size {block_size} has no published loss-decay gamma (published: "
        + ", ".join(f"B={b}: {g:g}" for b, g in GAMMA_TABLE.items())
        + "); give --gamma"
    )
