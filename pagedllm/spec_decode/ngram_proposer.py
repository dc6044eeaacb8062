"""NgramProposer: prompt-lookup drafts from each request's own tokens (vLLM's ``ngram`` method).

For a request whose tokens end with an n-gram (n from prompt_lookup_max down to prompt_lookup_min, the longest
that matches wins) seen earlier in its prompt or output, the tokens that followed the earliest such occurrence
are the draft, up to num_speculative_tokens of them. Text that quotes, edits or summarises its prompt repeats
long runs of it, so the drafts are often right; elsewhere few n-grams recur and little is proposed.

The search runs over the whole batch at once in numpy: per n, one comparison of every row's n-token windows with
its suffix, no per-token Python.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pagedllm.spec_decode.proposal_step import ProposalStep
from pagedllm.worker.input_batch import InputBatch


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, num_speculative_tokens: int,
                 max_model_len: int) -> None:
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len

    def propose_for_step(self, batch: InputBatch, step: ProposalStep) -> list[list[int]]:
        """Per sampling request of ``step``: its drafts, from its tokens so far, at most its max_drafts."""
        rows = step.sample_rows
        if not step.max_drafts.any():
            return [[] for _ in rows]
        num_tokens = batch.num_tokens[rows]
        # the rows' tokens so far only: the batch's rows are max_model_len long, mostly unused
        token_ids = batch.token_ids[rows, :int(num_tokens.max())]
        return [drafts[:limit] for drafts, limit in zip(self.propose(token_ids, num_tokens),
                                                        step.max_drafts.tolist())]

    def propose(self, token_ids: np.ndarray, num_tokens: np.ndarray) -> list[list[int]]:
        """Drafts for each row of ``token_ids`` ([R, >= max(num_tokens)], row r's tokens in its first
        num_tokens[r] entries); an empty list where nothing matches. A draft never runs past the last token the
        row could hold (max_model_len)."""
        num_rows = len(num_tokens)
        if num_rows == 0:
            return []
        length = int(num_tokens.max())
        tokens = token_ids[:, :length]
        # Per row: where the draft starts in its tokens (-1: no match yet).
        draft_start = np.full(num_rows, -1, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            pending = (draft_start < 0) & (num_tokens > n)
            if not pending.any():
                continue
            suffix = np.take_along_axis(tokens, np.maximum(num_tokens[:, None] - n, 0) + np.arange(n), axis=1)
            windows = sliding_window_view(tokens, n, axis=1)  # [R, length - n + 1, n], a view
            matches = (windows == suffix[:, None, :]).all(axis=2)
            # A match must start before the suffix itself does, so at least one token follows it.
            matches &= np.arange(length - n + 1) < (num_tokens - n)[:, None]
            matches &= pending[:, None]
            found = matches.any(axis=1)
            draft_start[found] = matches[found].argmax(axis=1) + n
        drafts: list[list[int]] = []
        for row, start in enumerate(draft_start.tolist()):
            if start < 0:
                drafts.append([])
                continue
            count = min(self.k, int(num_tokens[row]) - start, self.max_model_len - 1 - int(num_tokens[row]))
            drafts.append(tokens[row, start:start + max(count, 0)].tolist())
        return drafts
