"""Logprobs of chosen tokens plus the top-k alternatives, for sampled tokens and for prompt_logprobs."""
from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import torch

# vLLM's logprobs_mode, the engine's choice of what logprobs report. raw_*: the model's logits as they came, which no
# sampling control changes (the default); processed_*: the logits each token was sampled from (after the request's
# controls, and for random sampling its temperature, min-p, top-k and top-p). *_logprobs: their log-softmax;
# *_logits: the logits themselves. Prompt logprobs are of the raw logits in every mode (no control applies to them).
LogprobsMode = Literal["raw_logits", "raw_logprobs", "processed_logits", "processed_logprobs"]
LOGPROBS_MODES: tuple[str, ...] = get_args(LogprobsMode)
PROCESSED_LOGPROBS_MODES = ("processed_logits", "processed_logprobs")


class LogprobsLists(NamedTuple):
    """LogprobsTensors as plain Python lists, cheap to send across processes."""

    # [N][k+1]: the chosen token, then the top-k ids.
    logprob_token_ids: list[list[int]]
    # [N][k+1]
    logprobs: list[list[float]]
    # [N]
    sampled_token_ranks: list[int]

    def first(self, n: int) -> "LogprobsLists":
        """The rows of the first n tokens (a step's tokens cut at a stop)."""
        return self if n >= len(self.sampled_token_ranks) else LogprobsLists(
            self.logprob_token_ids[:n], self.logprobs[:n], self.sampled_token_ranks[:n])


class LogprobsTensors(NamedTuple):
    # [N, k+1] int64: column 0 the sampled (or given) token, then the top-k ids.
    logprob_token_ids: torch.Tensor
    # [N, k+1] float32: log-softmax of the logits (raw by default), or the logits themselves (LogprobsMode).
    logprobs: torch.Tensor
    # [N] int64: rank of the column-0 token in its row (1 = the most likely).
    selected_token_ranks: torch.Tensor

    def tolists(self) -> LogprobsLists:
        return LogprobsLists(
            self.logprob_token_ids.tolist(),
            self.logprobs.tolist(),
            self.selected_token_ranks.tolist(),
        )


def compute_token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int,
                           logprobs_mode: LogprobsMode = "raw_logprobs",
                           requested: dict[int, torch.Tensor] | None = None) -> LogprobsTensors:
    """Logprob and rank of token_ids[i] under logits[i], plus the k most likely tokens of each row; in a *_logits
    logprobs_mode the values are the logits themselves (the ranks are the same). A row of ``requested`` (row -> its
    logprob_token_ids, at most k) has those ids, in their order, in place of its first top ones.

    Used for sampled tokens (the Sampler) and for prompt_logprobs (the next prompt token of each position).
    """
    if logprobs_mode in ("raw_logits", "processed_logits"):
        logprobs = logits.float()
    else:
        logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    for row, ids in (requested or {}).items():
        top_ids[row, :len(ids)] = ids
        top_logprobs[row, :len(ids)] = logprobs[row, ids]
    token_ids = token_ids.long().unsqueeze(1)
    token_logprobs = logprobs.gather(1, token_ids)
    # Ties with the token count ahead of it, so rank 1 means nothing is more likely.
    ranks = (logprobs >= token_logprobs).sum(dim=-1)
    return LogprobsTensors(
        torch.cat((token_ids, top_ids), dim=1),
        torch.cat((token_logprobs, top_logprobs), dim=1),
        ranks,
    )
