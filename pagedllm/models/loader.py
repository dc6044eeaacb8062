"""Build a model from its config and fill it from a checkpoint."""

import contextlib

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.models.registry import get_model_architecture
from pagedllm.models.resolve import resolve_model
from pagedllm.models.weights import weights_iterator


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    # Layers create their parameters in the default dtype.
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def get_model(model_path: str, hf_config: PretrainedConfig, dtype: torch.dtype) -> nn.Module:
    """Return the model for ``hf_config`` with weights from ``model_path``, in eval mode."""
    model_class = get_model_architecture(hf_config)
    with _default_dtype(dtype):
        model = model_class(hf_config)
    loaded = model.load_weights(weights_iterator(resolve_model(model_path)))
    missing = {name for name, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(f"Checkpoint {model_path!r} lacks weights for: {sorted(missing)}")
    return model.eval().requires_grad_(False)
