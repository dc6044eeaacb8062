"""``quantization="int8"``: W8A8 as vLLM's CPU W8A8, dynamic per-token activations.

Each linear layer's weight is quantized at load, from whatever checkpoint filled it (safetensors or GGUF, dequantized),
symmetric per output channel: ``sw = max|W[n]| / 127``, codes ``round(W / sw)``. At run time each row of the input
is quantized the same way per token (``sx = max|x| / 127``), the codes multiply in int32, and the output is
``acc * sx * sw (+ bias)``. On CPUs with AVX512-VNNI the native kernel (native/gemm_int8.c) does all of it in one
call, quantizing the rows as they come in; elsewhere torch's int8 matmul (``torch._int_mm``) does the products after
the same quantization in torch, with the same results up to float rounding in the epilogue. The embedding and the LM
head stay dense (as vLLM keeps them); so do a mixture of experts' experts and router.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import native
from pagedllm.layers.gemm_layout import QuantizedWeight, WeightLayout
from pagedllm.layers.linear import LinearBase
from pagedllm.layers.quantization.base import QuantizationConfig, QuantizeMethodBase

PANEL_COLUMNS = 16  # gemm_int8.c's columns per panel
K_GROUP = 4  # consecutive inputs per vpdpbusd lane


def quantize_symmetric(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of float32 ``values`` -> int8 codes in [-127, 127] and each row's float32 scale (max|row| / 127; a row
    of zeros gets scale 0 and codes 0), by the kernel's arithmetic: codes = rint(v * (127 / max|row|))."""
    amax = values.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(values * inverse).clamp_(-127, 127).to(torch.int8)
    return codes, (amax / 127.0).squeeze(-1)


def pack_w8a8_panels(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` int8 codes and ``[N]`` scales -> gemm_w8a8_f32's panels, ``[ceil(N / 16), ceil(K / 4) * 64 + 128]``
    bytes: per panel of 16 columns, ceil(K / 4) groups of the 16 columns' 4 consecutive codes, then the columns'
    scales (float32) and 128 * their code sums (int32), which the kernel takes back off its unsigned-activation
    sums. Padding columns and inputs are zero codes."""
    n, k = codes.shape
    n_pad, k_pad = -n % PANEL_COLUMNS, -k % K_GROUP
    codes = F.pad(codes, (0, k_pad, 0, n_pad))
    panels = (n + n_pad) // PANEL_COLUMNS
    groups = codes.view(panels, PANEL_COLUMNS, -1, K_GROUP).permute(0, 2, 1, 3).reshape(panels, -1)
    scales = F.pad(scales.float(), (0, n_pad)).view(panels, PANEL_COLUMNS)
    compensation = (128 * codes.sum(dim=1, dtype=torch.int32)).view(panels, PANEL_COLUMNS)
    return torch.cat([groups.view(torch.uint8), scales.contiguous().view(torch.uint8),
                      compensation.contiguous().view(torch.uint8)], dim=1).contiguous()


class Int8LinearMethod(QuantizeMethodBase):
    """Loads a dense weight like the unquantized method (so tensor-parallel loaders slice it as usual), then keeps
    only its codes and scales: the native kernel's panels, or ``[N, K]`` codes for torch's int8 matmul."""

    def __init__(self):
        self.packed: QuantizedWeight | None = None  # the native kernel's panels, where it applies

    def create_weights(self, layer, input_size_per_partition, output_size_per_partition, params_dtype,
                       weight_loader):
        weight = nn.Parameter(torch.empty(output_size_per_partition, input_size_per_partition, dtype=params_dtype),
                              requires_grad=False)
        weight.weight_loader = weight_loader
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer, layout: WeightLayout | None = None) -> None:
        codes, scales = quantize_symmetric(layer.weight.data.float())
        del layer.weight
        if layer.params_dtype == torch.float32 and native.gemm_w8a8() is not None:
            self.packed = QuantizedWeight.w8a8(pack_w8a8_panels(codes, scales), codes.shape[0], layout)
            layer.weight = nn.Parameter(self.packed.panels, requires_grad=False)
            return
        layer.weight = nn.Parameter(codes, requires_grad=False)
        layer.weight_scale = nn.Parameter(scales, requires_grad=False)

    def apply(self, layer, x, bias=None):
        if self.packed is not None:
            return self.packed.linear(x, bias)
        rows = x.reshape(-1, x.shape[-1]).float()
        codes, row_scales = quantize_symmetric(rows)
        acc = torch._int_mm(codes, layer.weight.t())
        y = acc.float() * row_scales.unsqueeze(-1) * layer.weight_scale
        if bias is not None:
            y = y + bias
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)


class Int8Config(QuantizationConfig):
    """Every linear layer W8A8."""

    def get_quant_method(self, layer, prefix):
        return Int8LinearMethod() if isinstance(layer, LinearBase) else None
