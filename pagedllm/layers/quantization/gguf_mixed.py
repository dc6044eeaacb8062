"""A fused GGUF layer whose checkpoint parts are of different packed kinds: a Q4_K_M file's qkv_proj of Q4_K q and k
with a Q6_K v (llama.cpp gives some layers' attn_v and ffn_down more bits), a gate_up_proj of Q4_K and Q8_0. Each
output shard keeps its own kind's panels (gemm_q4/q4k(c), gemm_q8, gemm_q6k(c)/q3kc, gemm_q5k(c), gemm_iq4nl/xs), and
a step writes each shard's columns of one output tensor, so the layer stays packed where it would otherwise be
dequantized whole.

While loading, the layer's weight loaders fill one layout that holds every kind: int8 codes ``[out, in]`` (a 4-bit
code or an IQ4 index is 0-15, a Q5_K code 0-31, a Q6_K one q - 32, a Q8_0 one itself), and per 16 inputs a float32
scale and zero (a part scaled per 32 has each repeated; a kind without zeros leaves 0), cut by rank like a dense
weight. Each shard is then packed by its own kind's method (``pack``).
"""

import torch
from torch import nn

from pagedllm.layers.gemm_layout import Q6K_BLOCK, QuantizedWeight, WeightLayout
from pagedllm.layers.quantization.gguf_linear import GGUFLinearMethod


class GGUFMixedLinearMethod(GGUFLinearMethod):
    """``part_methods``: the method each output shard's checkpoint part would have alone, in the layer's shard
    order (``output_shards``: q, k, v or gate, up), each a native kernel's."""

    code_dtype = torch.int8
    block_params = ("scales", "zeros")
    block = Q6K_BLOCK

    def __init__(self, part_methods: list[type[GGUFLinearMethod]]):
        super().__init__()
        self.part_methods = part_methods
        self.shards: list[tuple[int, int, QuantizedWeight, torch.Tensor | None]] = []  # offset, size, weight, bias

    def create_weights(self, layer, input_size_per_partition, output_size_per_partition, params_dtype,
                       weight_loader):
        def into_common_layout(param: nn.Parameter, loaded: torch.Tensor, *shard) -> None:
            if param is not layer.qweight and loaded.shape[1] * 2 == param.shape[1]:  # per 32 -> per 16
                loaded = loaded.repeat_interleave(2, dim=1)
            weight_loader(param, loaded.to(param.dtype), *shard)

        super().create_weights(layer, input_size_per_partition, output_size_per_partition, params_dtype,
                               into_common_layout)
        layer.zeros.data.zero_()

    def process_weights_after_loading(self, layer, layout: WeightLayout | None = None):
        for (offset, size, _), method in zip(layer.output_shards(), self.part_methods, strict=True):
            rows = slice(offset, offset + size)
            step = method.block // self.block  # a per-32 part's scales and zeros are each held twice
            parts = [layer.qweight.data[rows].to(method.code_dtype)]
            parts += [getattr(layer, name).data[rows, ::step] for name in method.block_params]
            weight = method.pack(parts, layout)
            bias = None if layer.bias is None else layer.bias.data[rows]
            self.shards.append((offset, size, weight, bias))
        for name in ("qweight", *self.block_params):
            delattr(layer, name)
        for i, (_, _, weight, _) in enumerate(self.shards):
            layer.register_parameter(f"qweight_{i}", nn.Parameter(weight.panels, requires_grad=False))

    def apply(self, layer, x, bias=None):
        rows = x.reshape(-1, x.shape[-1])
        out = rows.new_empty(rows.shape[0], layer.output_size_per_partition)
        for offset, size, weight, shard_bias in self.shards:  # (the bias passed is the layer's, cut as loaded)
            weight.linear(rows, None if bias is None else shard_bias, out=out[:, offset:offset + size])
        return out.view(*x.shape[:-1], out.shape[-1])
