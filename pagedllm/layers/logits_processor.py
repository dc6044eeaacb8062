"""Hidden states -> float32 logits over the full vocabulary, on TP rank 0 (the rank that samples)."""
from typing import Optional

import torch
from torch import nn

from pagedllm.distributed.communication_op import tensor_model_parallel_gather
from pagedllm.layers.vocab_embedding import VocabParallelEmbedding
from pagedllm.lora.punica import add_lora


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int, soft_cap: Optional[float] = None):
        """``soft_cap`` (vLLM's; Gemma 2's final_logit_softcapping): the logits become soft_cap * tanh(logits /
        soft_cap), as transformers' Gemma 2 returns them; None leaves them as the LM head makes them."""
        super().__init__()
        self.vocab_size = vocab_size
        self.soft_cap = soft_cap
        self.lora = None  # the LM head's adapter slots (lora/layers.LogitsLoRA), attached by the worker's LoRA manager

    def forward(self, lm_head: VocabParallelEmbedding, hidden_states: torch.Tensor) -> Optional[torch.Tensor]:
        """Every TP rank calls it (the gather is collective); only TP rank 0 gets the logits, the others None."""
        logits = lm_head.project(hidden_states)
        if lm_head.tp_size > 1:
            logits = tensor_model_parallel_gather(logits)
            if logits is None:
                return None
        # Drop the zero rows that pad the last vocab shard.
        logits = logits[..., : self.vocab_size].float()
        logits = add_lora(self.lora, logits, hidden_states)
        if self.soft_cap is not None:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        return logits
