"""Iterate a checkpoint's tensors as ``(hf_name, tensor)`` pairs, one at a time."""

import glob
import json
import os
from collections.abc import Container, Iterator

import torch
from safetensors import safe_open

from pagedllm.models.gguf_loader import gguf_weights_iterator


SAFETENSORS_INDEX = "model.safetensors.index.json"


def safetensors_files(directory: str) -> list[str]:
    """The checkpoint's ``*.safetensors`` files in an HF directory: with an index (sharded checkpoints), only the
    files its weight_map names, as vLLM takes them (a directory may hold the same weights in another layout beside
    them: Mistral's ``consolidated.safetensors``), and each of them, else a ValueError naming those missing."""
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    index = os.path.join(directory, SAFETENSORS_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            named = set(json.load(f).get("weight_map", {}).values())
        files = [file for file in files if os.path.basename(file) in named]
        absent = sorted(named - {os.path.basename(file) for file in files})
        if absent:  # a download cut short: name the shards, not each parameter they held
            raise ValueError(f"{SAFETENSORS_INDEX} in {directory!r} names shards that are not there: {absent}")
    if not files:
        raise FileNotFoundError(f"No *.safetensors files in {directory!r}")
    return files


def safetensors_weights_iterator(directory: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of the checkpoint's ``*.safetensors`` files in an HF directory (safetensors_files)."""
    files = safetensors_files(directory)
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def weights_iterator(path: str, packed_modules: Container[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Pick the reader for a ``.gguf`` file or an HF safetensors directory.

    ``packed_modules``: modules whose GGUF Q4_0/Q4_1/Q4_K or Q8_0 weights stay packed (see ``gguf_weights_iterator``).
    """
    if path.endswith(".gguf"):
        return gguf_weights_iterator(path, packed_modules)
    return safetensors_weights_iterator(path)


def default_weight_loader(param: torch.nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """Copy a whole tensor into a parameter that is not split across ranks."""
    if param.shape != loaded_weight.shape:
        raise ValueError(f"weight shape mismatch: expected {tuple(param.shape)}, got {tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)
