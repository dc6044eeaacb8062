"""SamplingMetadata: the batch's sampling settings as tensors, built once per step by the model runner."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PenaltyMetadata:
    """The presence/frequency/repetition penalties of the rows that use one; other rows are left alone."""

    # [P] int64: the rows (of the step's logits) these penalties apply to.
    rows: torch.Tensor
    # [P] float32 each.
    presence_penalties: torch.Tensor
    frequency_penalties: torch.Tensor
    repetition_penalties: torch.Tensor
    # [P, L] int64 each, padded with vocab_size: the prompt tokens, and the tokens generated so far.
    prompt_token_ids: torch.Tensor
    output_token_ids: torch.Tensor


@dataclass
class SamplingMetadata:
    """Per-row sampling settings of one step's batch.

    Optional tensors are None when no row uses the knob, so the Sampler can skip that work entirely.
    """

    # [B] float32; greedy rows hold 0. None when the whole batch is greedy.
    temperature: torch.Tensor | None
    all_greedy: bool
    all_random: bool
    # [B] float32, or None when no row uses top-p.
    top_p: torch.Tensor | None
    # [B] int64, or None when no row uses top-k; 0 in a row means "no top-k" for it.
    top_k: torch.Tensor | None
    # [B] float32, or None when no row uses min-p.
    min_p: torch.Tensor | None
    # Batch row -> its request's generator (seeded once from the request's seed, advanced each step).
    generators: dict[int, torch.Generator]
    # The largest logprobs count any row asked for; None when no row wants logprobs.
    max_num_logprobs: int | None
    # Row -> token ids (EOS and stop tokens) to suppress because the request is still under min_tokens.
    min_tokens_mask: dict[int, set[int]]
    # The rows of min_tokens_mask that the mask may leave with no token at all (a grammar, allowed_token_ids): they
    # get their stop tokens back if it does (sample/ops.apply_min_tokens).
    min_tokens_restorable: frozenset[int] = frozenset()
    # Row -> its allowed token ids ([n] int64), for rows with allowed_token_ids.
    allowed_token_ids: dict[int, torch.Tensor] = field(default_factory=dict)
    # Row -> its bad words as token-id sequences; output_token_ids (every row's, only when some row has bad
    # words) tells which sequences the next token would complete.
    bad_words_token_ids: dict[int, list[list[int]]] = field(default_factory=dict)
    output_token_ids: list[list[int]] = field(default_factory=list)
    # Row -> (token ids [n] int64, biases [n] float32), for rows with a logit_bias.
    logit_bias: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # Row -> the token ids ([n] int64) whose logprobs it reports in place of its top n (logprob_token_ids).
    logprob_token_ids: dict[int, torch.Tensor] = field(default_factory=dict)
    penalties: PenaltyMetadata | None = None
    # Row -> the token it must sample (a thinking_token_budget spent: sample/thinking_budget.py).
    forced_token_ids: dict[int, int] = field(default_factory=dict)
