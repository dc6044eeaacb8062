"""SamplingMetadata: the batch's sampling settings as tensors, built once per step by the model runner."""
from __future__ import annotations

from dataclasses import dataclass

import torch


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
