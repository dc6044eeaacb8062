"""Weight quantization methods, selected by the ``quantization`` engine argument."""

from pagedllm.layers.quantization.base import QuantizationConfig, QuantizeMethodBase

# What ``quantization`` may name: a method applied at load (gguf, gguf_int4, int8), or a quantized checkpoint's own
# (compressed-tensors), which the checkpoint's quantization_config selects even unnamed.
QUANTIZATION_METHODS = ("gguf", "gguf_int4", "int8", "compressed-tensors")

__all__ = ["QUANTIZATION_METHODS", "QuantizationConfig", "QuantizeMethodBase"]
