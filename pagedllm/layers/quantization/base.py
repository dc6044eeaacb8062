"""How a layer stores its weight and multiplies by it, so quantized formats plug into the same layers.

A layer asks its ``QuantizationConfig`` for a ``QuantizeMethodBase`` by its module name (``prefix``),
lets the method create the parameters the checkpoint fills, and calls ``apply`` in ``forward``. After all
weights are loaded the loader calls ``process_weights_after_loading`` once, with the engine's WeightLayout
(layers/gemm_layout.py), to repack them for the kernel.
"""

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch import nn

from pagedllm.layers.gemm_layout import WeightLayout


class QuantizeMethodBase(ABC):
    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_size_per_partition: int,
                       params_dtype: torch.dtype, weight_loader: Callable) -> None:
        """Register the layer's weight parameters, each with ``weight_loader`` attached."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T + bias`` in ``x``'s dtype."""

    def process_weights_after_loading(self, layer: nn.Module, layout: WeightLayout | None = None) -> None:
        """Turn the loaded parameters into the kernel's layout, as ``layout`` says; nothing to do by default."""

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """``silu(gate) * up`` of a ``[gate | up]`` projection in one kernel, or None where this method has none
        (the default): the caller then applies the activation to ``apply``'s output."""
        return None


def checkpoint_modules(prefix: str, stacked_params_mapping: list[tuple[str, str, object]]) -> list[str]:
    """The checkpoint module names behind the model module ``prefix``: a fused layer (``qkv_proj``) stands for the
    ones it stacks (``q_proj``, ``k_proj``, ``v_proj``), as the model's ``stacked_params_mapping`` says."""
    fused = [prefix[: -len(f)] + original for f, original, _ in stacked_params_mapping if prefix.endswith(f)]
    return fused or [prefix]


class QuantizationConfig(ABC):
    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The method for ``layer`` named ``prefix``; None keeps the layer unquantized."""

    def int8_rows_block(self, prefix: str) -> int | None:
        """Where the embedding (or LM head) named ``prefix`` keeps the checkpoint's int8 codes: their inputs per
        scale. None (by default) keeps it dense."""
        return None

    def packed_modules(self, model: nn.Module) -> set[str]:
        """Checkpoint modules whose GGUF weights must load still quantized (codes and scales); none by default."""
        return set()
