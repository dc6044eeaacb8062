"""Presence, frequency and repetition penalties (vLLM's apply_penalties), batched over the rows that use them."""
from __future__ import annotations

import torch

from pagedllm.sample.metadata import PenaltyMetadata


def apply_penalties(logits: torch.Tensor, penalties: PenaltyMetadata) -> torch.Tensor:
    """Penalise the rows in penalties.rows. In place; the other rows are untouched, bit for bit.

    repetition_penalty divides positive logits (multiplies the others) of tokens seen in the prompt or the
    output; frequency_penalty subtracts per output occurrence; presence_penalty once per token in the output.
    """
    rows = penalties.rows
    penalised = logits[rows]
    num_rows, vocab_size = penalised.shape
    prompt_mask = get_token_bin_counts(penalties.prompt_token_ids, vocab_size, num_rows) > 0
    output_counts = get_token_bin_counts(penalties.output_token_ids, vocab_size, num_rows)
    output_mask = output_counts > 0
    repetition = torch.where(prompt_mask | output_mask, penalties.repetition_penalties.unsqueeze(1), 1.0)
    penalised = torch.where(penalised > 0, penalised / repetition, penalised * repetition)
    penalised -= penalties.frequency_penalties.unsqueeze(1) * output_counts
    penalised -= penalties.presence_penalties.unsqueeze(1) * output_mask
    logits[rows] = penalised
    return logits


def get_token_bin_counts(token_ids: torch.Tensor, vocab_size: int, num_rows: int) -> torch.Tensor:
    """[N, L] token ids padded with vocab_size -> [N, vocab_size] occurrence counts (the padding column dropped)."""
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.int64)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids))
    return counts[:, :vocab_size]
