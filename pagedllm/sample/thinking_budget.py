"""vLLM's thinking_token_budget: a request may think for at most this many tokens, then the sampler forces the end
of its reasoning, and it samples as usual after.

A request thinks from the last reasoning start marker of its tokens (its prompt's, such as a template's trailing
``<think>``, and its output's) that no end marker (the parser's, vLLM's natural end) has closed; its thinking
tokens are those after that start marker. When they number ``budget`` or more, the next token is forced to the
forced end (the end marker, or a phrase ending in it: config.ReasoningConfig): its first token, or, where the tokens
already end with its first k tokens (a forced end of several tokens, forced one a step), its (k+1)th. Forced, as
vLLM forces it, by setting the token's logit to 1e9 after every other control (sample/ops.py), so greedy and random
rows (whatever their temperature, top-k, top-p or min-p) both take it; with the end marker there the reasoning is
over, and a later start marker opens a new section with a whole budget again (the rule of vLLM's
v1/worker/gpu/sample/thinking_budget.py).

The markers are found incrementally: each request's scan of its committed tokens (MarkerScan) remembers where it
stopped, so a step looks at its new tokens only; speculative drafts, not yet the request's, are scanned for each
logits row they precede.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pagedllm.config import ReasoningConfig


@dataclass
class MarkerScan:
    """A request's last start and end marker positions (-1: none) in its committed tokens before ``scanned``."""

    scanned: int = 0
    last_start: int = -1
    last_end: int = -1


class ThinkingBudget:
    """The reasoning markers' token ids, and which token a request whose budget is spent must sample next."""

    def __init__(self, config: ReasoningConfig) -> None:
        self.start = np.array(config.reasoning_start_token_ids, dtype=np.int64)
        self.natural_end = np.array(config.natural_reasoning_end_token_ids, dtype=np.int64)
        self.forced_end = np.array(config.reasoning_end_token_ids, dtype=np.int64)

    def forced_token(self, tokens: np.ndarray, num_committed: int, length: int, budget: int, scan: MarkerScan
                     ) -> Optional[int]:
        """The token forced after ``tokens[:length]`` (the request's ``num_committed`` tokens, then drafts), or None.
        Advances ``scan`` over the committed tokens."""
        self._advance(scan, tokens, num_committed)
        last_start, last_end = scan.last_start, scan.last_end
        if length > num_committed:  # drafts: the markers that end in them
            last_start = max(last_start, _last_match(tokens[:length], self.start, num_committed - len(self.start) + 1))
            last_end = max(last_end, _last_match(tokens[:length], self.natural_end,
                                                 num_committed - len(self.natural_end) + 1))
        if last_start <= last_end or length - (last_start + len(self.start)) < budget:
            return None
        # How much of the forced end the tokens already end with (several tokens are forced one a step).
        done = next((k for k in range(min(len(self.forced_end) - 1, length), 0, -1)
                     if np.array_equal(tokens[length - k:length], self.forced_end[:k])), 0)
        return int(self.forced_end[done])

    def _advance(self, scan: MarkerScan, tokens: np.ndarray, num_committed: int) -> None:
        """The markers of the committed tokens not scanned yet (a request's committed tokens only ever grow)."""
        committed = tokens[:num_committed]
        scan.last_start = max(scan.last_start, _last_match(committed, self.start, scan.scanned))
        scan.last_end = max(scan.last_end, _last_match(committed, self.natural_end, scan.scanned))
        # A marker starting before this was wholly in the tokens scanned.
        scan.scanned = max(0, num_committed - max(len(self.start), len(self.natural_end)) + 1)


def _last_match(tokens: np.ndarray, marker: np.ndarray, lowest: int) -> int:
    """The last i >= lowest where ``tokens[i:i + len(marker)]`` is ``marker``; -1 if none."""
    lowest = max(lowest, 0)
    if len(tokens) - lowest < len(marker):
        return -1
    window = tokens[lowest:]
    hits = np.flatnonzero(window == marker[0] if len(marker) == 1
                          else (sliding_window_view(window, len(marker)) == marker).all(axis=1))
    return lowest + int(hits[-1]) if len(hits) else -1
