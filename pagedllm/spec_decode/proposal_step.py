"""ProposalStep: one step of the model runner as a proposer sees it, once the step's sampled tokens are in the
batch's token table (InputBatch.token_ids / num_tokens)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class ProposalStep:
    # Batch rows of the step's requests, in batch order.
    rows: np.ndarray
    # Per step request: its computed tokens before the step, and how many the step computed from there (its drafts
    # included, rejected ones too).
    num_computed: np.ndarray
    num_scheduled: np.ndarray
    # Indices into rows of the requests that sampled this step: the only ones that get drafts.
    sampling: np.ndarray
    # Per sampling request: at most this many drafts (0 for none), so that all of them accepted plus the token
    # sampled after them stay within max_model_len and max_tokens.
    max_drafts: np.ndarray

    @property
    def sample_rows(self) -> np.ndarray:
        return self.rows[self.sampling]
