"""Phi-3: the Llama architecture, its checkpoints holding q/k/v fused in one ``qkv_proj`` ([q; k; v] rows) and
gate/up in one ``gate_up_proj`` ([gate; up]), the long-context models with longrope (layers/rope_scaling.py: per
position, which matches transformers' Phi-3 generate while a sequence fits original_max_position_embeddings, not
past it, where that re-encodes the whole sequence with the long factors).

Its config's ``resid_pdrop``, ``embd_pdrop`` and ``attention_dropout`` act only in training. Its
``sliding_window`` is refused where it binds (registry), as for every model here: Phi-3-mini-4k's 2047 does.
"""

from __future__ import annotations

from pagedllm.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    # The checkpoint's fused tensors are named as the fused parameters here: nothing to stack. Their weight
    # loaders, given no shard id, cut them into q, k, v (gate, up) and each rank's slice of each (layers/linear.py).
    stacked_params_mapping = []
