"""Hidden states -> float32 logits over the full vocabulary."""

import torch
from torch import nn

from pagedllm.layers.communication import tensor_model_parallel_all_gather
from pagedllm.layers.vocab_embedding import VocabParallelEmbedding


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, lm_head: VocabParallelEmbedding, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = lm_head.project(hidden_states)
        logits = tensor_model_parallel_all_gather(logits, lm_head.tp_size)
        # Drop the zero rows that pad the last vocab shard.
        return logits[..., : self.vocab_size].float()
