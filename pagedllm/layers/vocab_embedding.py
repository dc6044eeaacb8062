"""Token embedding and LM head split over tensor-parallel ranks by vocab rows.

Each rank holds rows ``[vocab_start_index, vocab_end_index)``; the last shard is
zero-padded when the vocab does not divide evenly.
"""

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.communication import tensor_model_parallel_all_reduce
from pagedllm.layers.gemm_layout import DenseWeight


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: torch.dtype | None = None,
                 tp_size: int = 1, tp_rank: int = 0):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.num_embeddings_per_partition = -(-num_embeddings // tp_size)
        self.vocab_start_index = tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = min(self.vocab_start_index + self.num_embeddings_per_partition, num_embeddings)
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        self._projection: DenseWeight | None = None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if loaded_weight.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"embedding shape mismatch: expected {(self.num_embeddings, self.embedding_dim)}, "
                f"got {tuple(loaded_weight.shape)}"
            )
        rows = self.vocab_end_index - self.vocab_start_index
        param.data[:rows].copy_(loaded_weight[self.vocab_start_index : self.vocab_end_index])
        param.data[rows:].zero_()

    def project(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_states @ weight.T``: this shard's logits, as the LM head computes them."""
        if self._projection is None:
            return F.linear(hidden_states, self.weight)
        return self._projection.linear(hidden_states)

    def prepare_projection(self) -> None:
        """Lay the LM head's weight out for its GEMM (layers/gemm_layout.py). An embedding tied to the LM head
        keeps its rows for lookups, so where the layout differs it holds a second copy."""
        self._projection = DenseWeight(self.weight.data, large_batches=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # Ids owned by other ranks embed as zeros here; the all-reduce fills them in.
        in_shard = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local_ids = torch.where(in_shard, input_ids - self.vocab_start_index, 0)
        out = F.embedding(local_ids, self.weight) * in_shard.unsqueeze(-1).to(self.weight.dtype)
        return tensor_model_parallel_all_reduce(out, self.tp_size)

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
            f"tp_size={self.tp_size}, tp_rank={self.tp_rank}"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection sharded like the embedding; used through ``LogitsProcessor``.

    Models with tied embeddings use their ``VocabParallelEmbedding`` instead.
    """

    def prepare_projection(self) -> None:
        super().prepare_projection()
        # No lookups: one copy, in the GEMM's layout.
        self.weight.data = self._projection.panels if self._projection.data is None else self._projection.data

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead computes logits through LogitsProcessor, not forward()")
