"""What the GGUF linear methods share: a GGUF weight loads as its codes and per-block parameters, row-major like a
dense weight, and is multiplied by gemm.c's quantized panels where they apply.

A GGUF block is 32 weights along the input dim (a method's ``block``; Q6_K's scales: 16), so while loading
``qweight`` is ``[out, in]`` codes and each per-block parameter (``scales``, Q4's ``zeros``) ``[out, in / block]``
float32: the layers' tensor-parallel weight
loaders slice them as they slice a dense weight, which keeps whole blocks on a rank where ``in / 32`` divides.
"""

import torch
from torch import nn

from pagedllm.layers.gemm_layout import QBLOCK, QuantizedWeight, WeightLayout
from pagedllm.layers.quantization.base import QuantizeMethodBase


class GGUFLinearMethod(QuantizeMethodBase):
    """Creates ``qweight`` (``code_dtype``) and the ``block_params``; ``packed`` is the weight in the native
    kernel's panels once laid out, which ``apply`` then multiplies by."""

    code_dtype: torch.dtype
    block_params: tuple[str, ...]
    out_multiple = 1  # the output columns per rank must be a multiple of this (torch's int4 kernel: 16)
    block = QBLOCK  # inputs per scale

    def __init__(self):
        self.packed: QuantizedWeight | None = None

    def create_weights(self, layer, input_size_per_partition, output_size_per_partition, params_dtype,
                       weight_loader):
        if input_size_per_partition % self.block or output_size_per_partition % self.out_multiple:
            raise ValueError(f"{type(self).__name__} needs in % {self.block} == 0 and out % {self.out_multiple} == 0 "
                             f"per rank, got in={input_size_per_partition}, out={output_size_per_partition}")
        self.params_dtype = params_dtype
        parts = [("qweight", input_size_per_partition, self.code_dtype)]
        parts += [(name, input_size_per_partition // self.block, torch.float32) for name in self.block_params]
        for name, cols, dtype in parts:
            param = nn.Parameter(torch.empty(output_size_per_partition, cols, dtype=dtype), requires_grad=False)
            param.weight_loader = weight_loader
            layer.register_parameter(name, param)

    @staticmethod
    def pack(parts: list[torch.Tensor], layout: WeightLayout | None) -> QuantizedWeight:
        """The kernel's panels of ``parts``: the codes, then the ``block_params`` in their order."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer, layout: WeightLayout | None = None):
        self._keep_packed(layer, self.pack([getattr(layer, name).data for name in ("qweight", *self.block_params)],
                                           layout))

    def _keep_packed(self, layer, packed: QuantizedWeight) -> None:
        """Hold only ``packed``: its panels become the layer's ``qweight``, the loaded parts are dropped."""
        self.packed = packed
        for name in ("qweight", *self.block_params):
            delattr(layer, name)
        layer.qweight = nn.Parameter(packed.panels, requires_grad=False)

    def apply(self, layer, x, bias=None):
        return self.packed.linear(x, bias)
