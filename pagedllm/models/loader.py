"""Build a model from its config and fill it from a checkpoint."""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.distributed.parallel_state import ParallelRank
from pagedllm.layers.attention.selector import use_attention_backend
from pagedllm.layers.gemm_layout import WeightLayout
from pagedllm.layers.quantization import QUANTIZATION_METHODS, QuantizationConfig
from pagedllm.layers.quantization.gguf import GGUFConfig, GGUFInt4Config
from pagedllm.layers.quantization.gguf_int4 import Q4_TYPES
from pagedllm.layers.quantization.int8 import Int8Config
from pagedllm.models.gguf_loader import gguf_tensor_types
from pagedllm.models.registry import get_model_architecture
from pagedllm.models.resolve import resolve_model
from pagedllm.models.weights import weights_iterator
from pagedllm.platforms.interface import KernelChoice

if TYPE_CHECKING:  # the engine process gets a plain copy (config.HFConfigValues), not this class
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    # Layers create their parameters in the default dtype.
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def get_quant_config(quantization: str | None, path: str, model_class: type[nn.Module],
                     checkpoint_config: dict | None = None) -> QuantizationConfig | None:
    """The config for ``quantization`` on the checkpoint at ``path`` (``checkpoint_config``: the checkpoint's own
    quantization_config, for a checkpoint that ships quantized); a ValueError naming it if they do not fit."""
    if quantization is None:
        return None
    if quantization == "compressed-tensors":
        if not checkpoint_config:
            raise ValueError(f"quantization='compressed-tensors' is a quantized checkpoint's own scheme; {path!r} has "
                             f"no quantization_config")
        if model_class.expert_weight_names:
            raise ValueError(f"compressed-tensors checkpoints of mixture-of-experts models ({model_class.__name__}) "
                             f"are not supported yet: their experts run dense")
        return Int8Config.from_compressed_tensors(checkpoint_config, model_class.stacked_params_mapping)
    if quantization not in QUANTIZATION_METHODS and checkpoint_config:  # the checkpoint's own scheme, not an argument
        raise ValueError(f"{path!r} is quantized by {quantization!r} (its quantization_config's quant_method), which "
                         f"is not supported: of the checkpoints' own schemes only compressed-tensors' W8A8 int8 runs")
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be None or one of {', '.join(QUANTIZATION_METHODS)}; "
                         f"got {quantization!r}")
    if quantization == "int8":  # any checkpoint: its weights are quantized as they load
        return Int8Config()
    if not path.endswith(".gguf"):
        raise ValueError(f"quantization={quantization!r} needs a .gguf model; {path!r} is not a .gguf file")
    tensor_types = gguf_tensor_types(path)
    if quantization == "gguf":  # any GGUF: what no kernel takes is dequantized, as summary() tells
        return GGUFConfig(tensor_types, model_class.stacked_params_mapping, model_class.expert_weight_names)
    layer_types = {t for name, t in tensor_types.items() if name.startswith("model.layers.")}
    if not layer_types & Q4_TYPES:
        raise ValueError(f"quantization={quantization!r} needs Q4_0/Q4_1/Q4_K layer weights; {path!r} has "
                         f"{', '.join(sorted(t.name for t in layer_types))}")
    return GGUFInt4Config(tensor_types, model_class.stacked_params_mapping, model_class.expert_weight_names)


def get_model(model_path: str, hf_config: PretrainedConfig, kernels: KernelChoice, rank: ParallelRank = ParallelRank(),
              layer_range: tuple[int, int] | None = None, load_format: str = "auto") -> nn.Module:
    """Return the model for ``hf_config`` with weights from ``model_path``, in eval mode, computing in
    ``kernels.compute_dtype``, its weights laid out for the kernels its engine chose (with ``bf16_panels`` the
    dense GEMM weights are gemm_bf16.c's bf16 panels).

    ``rank`` and ``layer_range``: the tensor-parallel slice and pipeline stage this process holds. Each checkpoint
    tensor is read whole, cut to this rank's slice by its parameter's weight_loader, and dropped, so a rank holds
    at most one full tensor at a time (of a pickled ``.bin`` checkpoint, one whole file: torch.load reads it whole).

    The quantization method, if any, is ``hf_config.quantization_config["quant_method"]``; ``load_format``: which of
    an HF directory's weight files load (weights.WEIGHT_FILES).
    """
    model_class = get_model_architecture(hf_config)
    path = resolve_model(model_path)
    checkpoint_config = getattr(hf_config, "quantization_config", None) or {}
    quant_config = get_quant_config(checkpoint_config.get("quant_method"), path, model_class, checkpoint_config)
    with _default_dtype(kernels.compute_dtype), use_attention_backend(kernels.attention_backend):
        model = model_class(hf_config, quant_config=quant_config, rank=rank, layer_range=layer_range)
    packed_modules = quant_config.packed_modules(model) if quant_config else frozenset()
    if isinstance(quant_config, GGUFConfig):
        logger.info("quantization=%r: %s", quant_config.name, quant_config.summary(model))
    loaded = model.load_weights(weights_iterator(path, packed_modules, load_format))
    missing = {name for name, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(f"Checkpoint {model_path!r} lacks weights for: {sorted(missing)}")
    if kernels.device != "cpu":  # before the layouts are chosen: they are the CPU kernels' only on the CPU
        model.to(kernels.device)
    layout = WeightLayout(kernels.bf16_panels, kernels.fused_silu)
    for module in model.modules():
        if hasattr(module, "quant_method"):
            module.quant_method.process_weights_after_loading(module, layout)
    model.process_weights_after_loading(layout)
    return model.eval().requires_grad_(False)
