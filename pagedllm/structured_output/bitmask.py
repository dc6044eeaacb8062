"""The grammar bitmask applied to a step's logits, on the worker: numpy and torch only, so that a worker imports
no grammar library (xgrammar is the engine's, and loads when a first grammar compiles)."""
from __future__ import annotations

import numpy as np
import torch


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Sets the logits of disallowed tokens to -inf, in place, for the given logits rows (bitmask row i
    belongs to logits row rows[i]).

    Bit j of 32-bit word w allows token 32 * w + j; numpy unpacks the inverted words (little-endian bytes,
    little bit order) straight into a boolean "disallowed" mask, one vectorised pass where xgrammar's CPU
    apply_token_bitmask_inplace is several times slower.
    """
    vocab_size = logits.shape[1]
    disallowed = np.unpackbits((~bitmask.numpy()).view(np.uint8), axis=-1, bitorder="little")[:, :vocab_size]
    disallowed = torch.from_numpy(disallowed.view(bool))
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(disallowed, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill_(disallowed, float("-inf"))
