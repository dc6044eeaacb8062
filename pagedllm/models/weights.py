"""Iterate a checkpoint's tensors as ``(hf_name, tensor)`` pairs, one at a time."""

import glob
import json
import os
from collections.abc import Container, Iterator

import torch
from safetensors import safe_open

from pagedllm.models.gguf_loader import gguf_weights_iterator


SAFETENSORS_INDEX = "model.safetensors.index.json"
_SAFETENSORS, _PT = ("*.safetensors", SAFETENSORS_INDEX), ("*.pt", None)
_AUTO = (_SAFETENSORS, ("*.bin", "pytorch_model.bin.index.json"), _PT)
# vLLM's load_format values that read an HF directory's weight files, and the files each takes, in order: the first
# pattern that matches any file wins (with "auto" a directory with safetensors never reads its .bin beside them),
# each with the index that may name its shards. "hf" is "auto" (vLLM's "auto" is "mistral" for a directory with
# consolidated*.safetensors, a layout not loaded here); "pt" takes *.pt files only, as vLLM 0.32 globs them.
WEIGHT_FILES = {"auto": _AUTO, "hf": _AUTO, "safetensors": (_SAFETENSORS,), "pt": (_PT,)}
# transformers' Trainer state, saved beside a checkpoint's weights and not weights (vLLM's
# filter_files_not_needed_for_inference).
_TRAINER_FILES = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt")


def hf_weights_files(directory: str, load_format: str = "auto") -> list[str]:
    """The checkpoint's weight files in an HF directory that ``load_format`` takes (WEIGHT_FILES): with "auto" its
    ``*.safetensors``, else (transformers' ``safe_serialization=False``) its ``*.bin``, else its ``*.pt``; the
    Trainer's state left out. With an index (sharded checkpoints), only the files its weight_map names, as vLLM
    takes them (a directory may hold the same weights in another layout beside them: Mistral's
    ``consolidated.safetensors``), and each of them, else a ValueError naming those missing."""
    patterns = WEIGHT_FILES[load_format]
    for pattern, index_name in patterns:
        files = sorted(file for file in glob.glob(os.path.join(directory, pattern))
                       if os.path.basename(file) not in _TRAINER_FILES)
        if files:
            break
    else:
        raise FileNotFoundError(f"No {' or '.join(pattern for pattern, _ in patterns)} weight files in {directory!r} "
                                f"(load_format={load_format!r})")
    index = os.path.join(directory, index_name) if index_name else None
    if index and os.path.isfile(index):
        with open(index) as f:
            named = set(json.load(f).get("weight_map", {}).values())
        files = [file for file in files if os.path.basename(file) in named]
        absent = sorted(named - {os.path.basename(file) for file in files})
        if absent:  # a download cut short: name the shards, not each parameter they held
            raise ValueError(f"{index_name} in {directory!r} names shards that are not there: {absent}")
    return files


def hf_weights_iterator(directory: str, load_format: str = "auto") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of the checkpoint's weight files in an HF directory (hf_weights_files). A pickled file is
    read as vLLM reads it: torch.load with weights_only=True (tensors and plain containers, no code run), whole."""
    for file in hf_weights_files(directory, load_format):
        if file.endswith(".safetensors"):
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        else:
            state = torch.load(file, map_location="cpu", weights_only=True)
            yield from state.items()
            del state  # before the next file loads: a rank holds one file's tensors at a time


def weights_iterator(path: str, packed_modules: Container[str] = frozenset(), load_format: str = "auto"
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Pick the reader for a ``.gguf`` file (whatever ``load_format``) or an HF directory (its ``load_format``).

    ``packed_modules``: modules whose GGUF Q4_0/Q4_1/Q4_K or Q8_0 weights stay packed (see ``gguf_weights_iterator``).
    """
    if path.endswith(".gguf"):
        return gguf_weights_iterator(path, packed_modules)
    return hf_weights_iterator(path, load_format)


def default_weight_loader(param: torch.nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """Copy a whole tensor into a parameter that is not split across ranks."""
    if param.shape != loaded_weight.shape:
        raise ValueError(f"weight shape mismatch: expected {tuple(param.shape)}, got {tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)
