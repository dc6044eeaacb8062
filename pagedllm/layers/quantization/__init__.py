"""Weight quantization methods, selected by the ``quantization`` engine argument."""

from pagedllm.layers.quantization.base import QuantizationConfig, QuantizeMethodBase

QUANTIZATION_METHODS = ("gguf", "gguf_int4", "int8")

__all__ = ["QUANTIZATION_METHODS", "QuantizationConfig", "QuantizeMethodBase"]
