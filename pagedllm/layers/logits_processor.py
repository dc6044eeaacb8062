"""Hidden states -> float32 logits over the full vocabulary, on TP rank 0 (the rank that samples)."""
from typing import Optional

import torch
from torch import nn

from pagedllm.distributed.communication_op import tensor_model_parallel_gather
from pagedllm.layers.vocab_embedding import VocabParallelEmbedding


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, lm_head: VocabParallelEmbedding, hidden_states: torch.Tensor) -> Optional[torch.Tensor]:
        """Every TP rank calls it (the gather is collective); only TP rank 0 gets the logits, the others None."""
        logits = lm_head.project(hidden_states)
        if lm_head.tp_size > 1:
            logits = tensor_model_parallel_gather(logits)
            if logits is None:
                return None
        # Drop the zero rows that pad the last vocab shard.
        return logits[..., : self.vocab_size].float()
