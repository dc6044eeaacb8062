"""Read a GGUF file as HF-named float32 tensors.

Weights are dequantized once at load time (the models compute in float32 or
bfloat16), so a GGUF checkpoint feeds the same ``load_weights`` as safetensors.
"""

import re
from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

# GGUF tensor name (without .weight/.bias) -> HF name, for Llama-like models.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# llama.cpp's precomputed llama3 rope factors; the model derives them from the config.
_IGNORED = {"rope_freqs"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)")


def gguf_to_hf_name(gguf_name: str) -> str | None:
    """Map e.g. ``blk.3.attn_q.weight`` to ``model.layers.3.self_attn.q_proj.weight``.

    Returns None for tensors the models do not use; raises on unknown names.
    """
    base, suffix = gguf_name.rsplit(".", 1)
    if base in _IGNORED:
        return None
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    match = _BLOCK_RE.fullmatch(base)
    if match and match.group(2) in _BLOCK_NAMES:
        return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}.{suffix}"
    raise ValueError(f"Unsupported GGUF tensor {gguf_name!r}")


def reverse_llama_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (rotary pairs interleaved per head).

    llama.cpp's converter reorders each head's rows from HF's half-split rotary
    layout to GPT-J's interleaved one; HF-layout weights need the inverse.
    """
    dim = weight.shape[0] // n_head // 2
    w = weight.reshape(n_head, dim, 2, *weight.shape[1:])
    return w.swapaxes(2, 1).reshape(weight.shape)


def _read_int(reader: GGUFReader, key: str) -> int:
    return int(reader.fields[key].contents())


def gguf_weights_iterator(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` for every model tensor in a GGUF file."""
    reader = GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    # Only llama-arch files are permuted by llama.cpp's converter (not qwen2).
    permute = arch == "llama"
    if permute:
        n_head = _read_int(reader, f"{arch}.attention.head_count")
        n_kv_head = _read_int(reader, f"{arch}.attention.head_count_kv")
    for tensor in reader.tensors:
        hf_name = gguf_to_hf_name(tensor.name)
        if hf_name is None:
            continue
        weight = dequantize(tensor.data, tensor.tensor_type)
        if permute and ".attn_q." in tensor.name:
            weight = reverse_llama_permute(weight, n_head)
        elif permute and ".attn_k." in tensor.name:
            weight = reverse_llama_permute(weight, n_kv_head)
        # Unquantized tensors come back as read-only views of the memory-mapped file.
        yield hf_name, torch.from_numpy(np.require(weight, np.float32, ["C", "W"]))
