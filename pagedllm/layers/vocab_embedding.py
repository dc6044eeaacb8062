"""Token embedding and LM head split over tensor-parallel ranks by vocab rows.

Each rank holds rows ``[vocab_start_index, vocab_end_index)``; the last shard is
zero-padded when the vocab does not divide evenly. With a GGUF quantization
config and a Q8_0 checkpoint tensor the rows stay Q8_0 codes and scales
(``q8``): lookups dequantize the rows they fetch, and the LM head multiplies by
the codes in the native kernel's panels (1.06 bytes a weight instead of 4). A
Q6_K tensor's rows stay codes too (int8 q - 32, a scale per 16: 1.25 bytes a
weight).
"""

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.communication_op import tensor_model_parallel_all_reduce
from pagedllm.layers.gemm_layout import DenseWeight, QuantizedWeight, WeightLayout, native_applies
from pagedllm.layers.quantization.base import QuantizationConfig
from pagedllm.lora.punica import add_lora
from pagedllm.native import fused

# Rows up to which a bf16-panel model's LM head multiplies by its Q8_0 codes instead of its bf16 panels: gemm.c's
# register tile (its MR). Up to that many rows the Q8 kernel dequantizes as it reads, so the LM head costs the
# reading of its weight (1.06 bytes a weight against the panels' 2); beyond, it first dequantizes whole panels into
# scratch and the bf16 panels win. The head's precision so depends on the step's rows: float32 rows times the exact
# codes up to this many, bf16-rounded rows and weights above (as every other GEMM of a bf16-panel model).
Q8_HEAD_MAX_ROWS = 6


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: torch.dtype | None = None,
                 tp_size: int = 1, tp_rank: int = 0, quant_config: QuantizationConfig | None = None,
                 prefix: str = "", embed_scale: float = 1.0):
        """``embed_scale``: looked-up rows come multiplied by it (Gemma's sqrt(hidden_size); not the LM head's
        projection, which reads the rows as they are)."""
        super().__init__()
        self.embed_scale = embed_scale
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.prefix = prefix  # the checkpoint module it loads (a tied LM head on a later stage: the embedding)
        self.num_embeddings_per_partition = -(-num_embeddings // tp_size)
        self.vocab_start_index = tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = min(self.vocab_start_index + self.num_embeddings_per_partition, num_embeddings)
        self.dtype = params_dtype or torch.get_default_dtype()
        # inputs per scale where the rows are int8 codes (Q8_0: 32, Q6_K: 16), else None
        self.scale_block = None if quant_config is None else quant_config.int8_rows_block(prefix)
        rows = self.num_embeddings_per_partition
        if self.q8:
            self._add_param("qweight", torch.empty(rows, embedding_dim, dtype=torch.int8))
            self._add_param("scales", torch.empty(rows, embedding_dim // self.scale_block, dtype=torch.float32))
        else:
            self._add_param("weight", torch.empty(rows, embedding_dim, dtype=self.dtype))
        self._projection: DenseWeight | QuantizedWeight | None = None
        self.lora = None  # the token embedding's adapter slots (lora/layers.EmbeddingLoRA), attached by the worker
        self._few_rows_projection: QuantizedWeight | None = None  # see Q8_HEAD_MAX_ROWS

    @property
    def q8(self) -> bool:
        """Whether the rows are int8 codes (Q8_0 or Q6_K) and scales rather than a dense weight."""
        return self.scale_block is not None

    def _add_param(self, name: str, data: torch.Tensor) -> None:
        param = nn.Parameter(data, requires_grad=False)
        param.weight_loader = self.weight_loader
        self.register_parameter(name, param)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        expected = (self.num_embeddings, param.shape[1])
        if loaded_weight.shape != expected:
            raise ValueError(f"embedding shape mismatch: expected {expected}, got {tuple(loaded_weight.shape)}")
        rows = self.vocab_end_index - self.vocab_start_index
        param.data[:rows].copy_(loaded_weight[self.vocab_start_index : self.vocab_end_index])
        param.data[rows:].zero_()

    def project(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_states @ weight.T``: this shard's logits, as the LM head computes them."""
        if self._projection is None:
            return F.linear(hidden_states, self._rows())
        if self._few_rows_projection is not None and hidden_states.shape[0] <= Q8_HEAD_MAX_ROWS:
            return self._few_rows_projection.linear(hidden_states)
        return self._projection.linear(hidden_states)

    def prepare_projection(self, layout: WeightLayout | None = None) -> None:
        """Lay the LM head's weight out for its GEMM as ``layout`` says (layers/gemm_layout.py): Q8_0 panels for
        Q8_0 rows; under bf16 panels the LM head joins the other dense weights, and Q8_0 rows keep their panels
        too, for steps of up to Q8_HEAD_MAX_ROWS rows. An embedding tied to the LM head keeps its rows for lookups,
        so where the layout differs it holds a copy in each layout besides (Q8_0 under bf16 panels: three)."""
        q8 = (QuantizedWeight.q8(self.qweight.data, self.scales.data, layout, bf16_steps=False)
              if self.q8 and native_applies("gemm_q8", self.dtype, self.qweight.device) else None)
        if q8 is not None and not (layout is not None and layout.bf16_panels):
            self._projection = q8
        else:
            self._projection = DenseWeight(self._rows().data, layout=layout)
            self._few_rows_projection = q8

    def _rows(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The rows ``ids`` (all rows if None) in the model's dtype."""
        if not self.q8:
            return self.weight if ids is None else F.embedding(ids, self.weight)
        codes, scales = (self.qweight, self.scales) if ids is None else (
            F.embedding(ids, self.qweight), F.embedding(ids, self.scales))
        return (codes.float() * scales.repeat_interleave(self.scale_block, dim=-1)).to(self.dtype)  # exact for Q8_0, one rounding for Q6_K

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return add_lora(self.lora, self._lookup(input_ids), input_ids)

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The base model's rows of ``input_ids``, times embed_scale."""
        if self.tp_size == 1:
            native = None
            if self.dtype == torch.float32:  # the native lookups give float32 rows
                native = (fused.embedding(input_ids, self.qweight, self.scales, self.embed_scale) if self.q8
                          else fused.embedding(input_ids, self.weight, scale=self.embed_scale))
            return self._scaled(self._rows(input_ids)) if native is None else native
        # Ids owned by other ranks embed as zeros here; the all-reduce fills them in.
        in_shard = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local_ids = torch.where(in_shard, input_ids - self.vocab_start_index, 0)
        out = self._scaled(self._rows(local_ids)) * in_shard.unsqueeze(-1).to(self.dtype)
        return tensor_model_parallel_all_reduce(out)

    def _scaled(self, rows: torch.Tensor) -> torch.Tensor:
        """Looked-up rows times ``embed_scale`` (in their dtype, as transformers' Gemma scales them)."""
        return rows if self.embed_scale == 1.0 else rows * torch.tensor(self.embed_scale, dtype=rows.dtype)

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
            f"tp_size={self.tp_size}, tp_rank={self.tp_rank}"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection sharded like the embedding; used through ``LogitsProcessor``.

    Models with tied embeddings use their ``VocabParallelEmbedding`` instead.
    """

    def prepare_projection(self, layout: WeightLayout | None = None) -> None:
        super().prepare_projection(layout)
        # No lookups: only the GEMMs' layouts.
        if isinstance(self._projection, QuantizedWeight) or self._few_rows_projection is not None:
            del self.qweight, self.scales
        elif not self.q8:
            self.weight.data = self._projection.panels if self._projection.data is None else self._projection.data

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead computes logits through LogitsProcessor, not forward()")
