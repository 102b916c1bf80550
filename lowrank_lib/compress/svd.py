"""Plain truncated SVD at a canonical keep ratio (the baseline every family is compared with)."""
from __future__ import annotations

import copy
from typing import Iterable

from ..factorized import LLAMA_PROJ, factorize


def compress_svd(model, keep: float, targets: Iterable[str] = LLAMA_PROJ, include_lm_head: bool = False,
                 inplace: bool = False):
    """Replace each target projection W by its best rank-r approximation, r = keep_rank(out, in, keep).

    Returns the factorized model (a deep copy unless ``inplace``).
    """
    m = model if inplace else copy.deepcopy(model)
    return factorize(m, keep=keep, targets=targets, include_lm_head=include_lm_head)
