"""RejectionSampler: verifies a step's draft tokens against the target model, keeping its output distribution exact.

Request i of the step drafted d_i tokens and has d_i + 1 rows of logits: row j is the target's distribution p_j
for the token after its known tokens and drafts 0 .. j - 1. Every sampling control (allowed tokens, bad words,
min_tokens, logit_bias, penalties, then temperature, top-k, top-p, min-p) shapes each p_j exactly as the plain
Sampler would have shaped it had drafts 0 .. j - 1 been sampled: the rows' SamplingMetadata sees those drafts as
output (InputBatch.make_sampling_metadata with offsets).

Drafts are checked in order and the first rejection ends a request's run:
- greedy rows accept draft x while x is p_j's argmax, and then emit the argmax: exactly greedy decoding;
- random rows accept x with probability min(1, p_j(x) / q_j(x)) and on rejection sample from the normalised
  max(p_j - q_j, 0), the standard rule (Leviathan et al., Chen et al.) under which every emitted token is
  distributed as p. The proposers here (n-gram) propose one token for sure, so q_j is one-hot at x: accept with
  probability p_j(x), else sample p_j with x removed.
When all d_i drafts are accepted, the bonus token is sampled from p_{d_i}. A request thus emits 1 .. d_i + 1
tokens. A seeded request's rows each sample their token by the exponential race with the noise of that token's
output position (sampler.position_generator), and a draft is accepted while it is the token sampled there: for
a one-hot q the same rule (the token is x with probability p_j(x); when it is not, it is distributed as p_j less
x), and the tokens are those plain decoding with that seed emits, whatever else is in the batch and however many
drafts the step verified.
"""
from __future__ import annotations

import numpy as np
import torch

from pagedllm.sample.logprobs import PROCESSED_LOGPROBS_MODES, compute_token_logprobs
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler, SamplerOutput, greedy_sample, is_greedy, random_sample

PLACEHOLDER_TOKEN_ID = -1  # pads each request's row of output tokens past the ones it emits


class RejectionSampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata, draft_token_ids: list[list[int]]
                 ) -> SamplerOutput:
        """``logits``: [sum(d_i + 1), V], request i's rows together, in order; ``metadata`` has one row per logits
        row; ``draft_token_ids``: request i's d_i drafts. Returns sampled_token_ids [n, max d_i + 1] (the
        accepted drafts, then the token sampled after them, then PLACEHOLDER_TOKEN_ID) and, when asked, the
        logprobs of every emitted token (of the logits the Sampler's logprobs_mode names), in request order."""
        num_drafts = np.array([len(d) for d in draft_token_ids], dtype=np.int64)
        n, width = len(num_drafts), int(num_drafts.max(initial=0)) + 1
        starts = np.cumsum(num_drafts + 1) - (num_drafts + 1)
        # Padded drafts [n, width]; the last column (and each request's columns past d_i) hold no draft.
        drafts = np.full((n, width), PLACEHOLDER_TOKEN_ID, dtype=np.int64)
        draft_mask = np.arange(width) < num_drafts[:, None]
        drafts[draft_mask] = np.concatenate([np.asarray(d, dtype=np.int64) for d in draft_token_ids]
                                            ) if num_drafts.sum() else []
        row_of = np.minimum(starts[:, None] + np.arange(width), len(logits) - 1)  # [n, width] logits row
        drafts_t, row_of_t = torch.from_numpy(drafts), torch.from_numpy(row_of)

        processed = self.sampler.process_logits(logits, metadata)
        greedy_rows = is_greedy(metadata, len(logits))
        greedy = greedy_rows[torch.from_numpy(starts)]  # per request
        accepted = torch.zeros(n, width, dtype=torch.bool)
        final = torch.empty(n, dtype=torch.int64)
        if greedy.any():
            target = greedy_sample(processed)
            target_at = target[row_of_t]  # [n, width]
            accepted[greedy] = (target_at == drafts_t)[greedy]
        seeded = torch.tensor([int(start) in metadata.generators for start in starts], dtype=torch.bool)
        unseeded = ~greedy & ~seeded
        final_logits = processed if metadata.all_greedy else self.sampler.final_logits(processed, metadata)
        if not metadata.all_greedy:
            probs = final_logits.softmax(dim=-1)
            if unseeded.any():
                draft_probs = probs[row_of_t, drafts_t.clamp(min=0)]
                accepted[unseeded] = (torch.rand(n, width) < draft_probs)[unseeded]
            if seeded.any():  # every row's own token (see the module's docstring)
                rows = sorted(metadata.generators)
                sampled_at = torch.empty(len(logits), dtype=torch.int64)
                sampled_at[rows] = random_sample(probs[rows], {k: metadata.generators[row]
                                                               for k, row in enumerate(rows)})
                seeded_target = sampled_at[row_of_t]
                accepted[seeded] = (seeded_target == drafts_t)[seeded]
        accepted &= torch.from_numpy(draft_mask)
        # The first draft not accepted (d_i when all are): where the run ends and the final token is sampled.
        num_accepted = (~accepted).int().argmax(dim=1)
        final_rows = torch.from_numpy(starts) + num_accepted
        if greedy.any():
            final[greedy] = target[final_rows[greedy]]
        if seeded.any():
            final[seeded] = sampled_at[final_rows[seeded]]
        if unseeded.any():
            random = unseeded.nonzero().squeeze(1)
            final[random] = self._sample_after_rejection(probs, final_rows[random],
                                                         drafts_t[random, num_accepted[random]])
        columns = torch.arange(width)
        sampled = torch.where(columns < num_accepted.unsqueeze(1), drafts_t, PLACEHOLDER_TOKEN_ID)
        sampled[torch.arange(n), num_accepted] = final
        logprobs = None
        if metadata.max_num_logprobs is not None:
            emitted = columns <= num_accepted.unsqueeze(1)
            mode = self.sampler.logprobs_mode
            scored = final_logits if mode in PROCESSED_LOGPROBS_MODES else logits
            scored_rows = row_of_t[emitted]
            requested = {i: metadata.logprob_token_ids[row] for i, row in enumerate(scored_rows.tolist())
                         if row in metadata.logprob_token_ids} if metadata.logprob_token_ids else {}
            logprobs = compute_token_logprobs(scored[scored_rows], sampled[emitted], metadata.max_num_logprobs, mode,
                                              requested)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def _sample_after_rejection(probs: torch.Tensor, rows: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
        """One token per given (unseeded) request from p at its final row, less the draft rejected there (none
        where all were accepted: ``rejected`` is PLACEHOLDER_TOKEN_ID), by the exponential race as the Sampler
        draws."""
        p = probs[rows]
        has_rejected = rejected >= 0
        p[has_rejected.nonzero().squeeze(1), rejected[has_rejected]] = 0.0
        return random_sample(p, {})
