"""``kernels.nvfp4.configs``: the words kernel's register caps per direction set.
"""

from __future__ import annotations

from hybrid_dist.kernels.nvfp4.configs import (NVFP4_WORDS_BOTH, NVFP4_WORDS_DEFAULT,
                                              NVFP4_WORDS_RHT_DEFAULT, nvfp4_words_default)


def test_nvfp4_words_default_caps_both_directions_at_96_registers():
    """Row+col (with or without RHT) at 96 registers; one direction uncapped, or 80 with RHT
    (a cap also raises a one-direction kernel's registers: ``quant_tiles``' comment)."""
    assert nvfp4_words_default(False, both=True) == nvfp4_words_default(True, both=True) == NVFP4_WORDS_BOTH
    assert NVFP4_WORDS_BOTH.maxnreg == 96
    assert nvfp4_words_default(False) == NVFP4_WORDS_DEFAULT and NVFP4_WORDS_DEFAULT.maxnreg is None
    assert nvfp4_words_default(True) == NVFP4_WORDS_RHT_DEFAULT and NVFP4_WORDS_RHT_DEFAULT.maxnreg == 80
