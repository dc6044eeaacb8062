"""Read a GGUF file as HF-named float32 tensors.

Weights are dequantized once at load time (the models compute in float32 or
bfloat16), so a GGUF checkpoint feeds the same ``load_weights`` as safetensors.
With ``quantization="gguf_int4"``, Q4_0/Q4_1 weights of the layers that keep
them 4-bit come out as codes and per-block scales/zeros instead.
"""

import mmap
import re
import struct
from collections.abc import Container, Iterator

import numpy as np
import torch
from gguf import GGUF_MAGIC, GGMLQuantizationType, GGUFReader, GGUFValueType
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


_SCALAR_SIZES = {
    GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
}


def _skip_value(buf: mmap.mmap, pos: int, value_type: int) -> int:
    """Offset just past the metadata value of ``value_type`` at ``pos``."""
    if value_type == GGUFValueType.STRING:
        return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
    if value_type == GGUFValueType.ARRAY:
        item_type, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item_type in _SCALAR_SIZES:
            return pos + count * _SCALAR_SIZES[item_type]
        for _ in range(count):
            pos = _skip_value(buf, pos, item_type)
        return pos
    return pos + _SCALAR_SIZES[value_type]


def gguf_tensor_types(path: str) -> dict[str, GGMLQuantizationType]:
    """HF weight name -> GGUF type of every model tensor, read from the header alone.

    GGUFReader parses all metadata up front (seconds for a 50k-token vocabulary);
    skipping it makes checking engine arguments against the file cheap.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version, n_tensors, n_kv = struct.unpack_from("<IIQQ", buf, 0)
        if magic != GGUF_MAGIC or version not in (2, 3):
            raise ValueError(f"{path!r} is not a little-endian GGUF v2/v3 file")
        pos = 24
        for _ in range(n_kv):
            pos += 8 + struct.unpack_from("<Q", buf, pos)[0]  # the key
            pos = _skip_value(buf, pos + 4, struct.unpack_from("<I", buf, pos)[0])
        types = {}
        for _ in range(n_tensors):
            (name_len,) = struct.unpack_from("<Q", buf, pos)
            name = buf[pos + 8 : pos + 8 + name_len].decode()
            pos += 8 + name_len
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            pos += 4 + 8 * n_dims
            (tensor_type,) = struct.unpack_from("<I", buf, pos)
            pos += 4 + 8  # type, data offset
            hf_name = gguf_to_hf_name(name)
            if hf_name is not None:
                types[hf_name] = GGMLQuantizationType(tensor_type)
    return types


def unpack_q4(data: np.ndarray, tensor_type: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_0/Q4_1 rows -> codes ``[N, K]`` uint8 in [0, 16), scales and zeros ``[N, K / 32]`` float32.

    Each weight is ``(code - 8) * scale + zero`` for its block of 32 along K.
    A block is an fp16 ``d`` (Q4_1: then an fp16 min ``m``) and 16 bytes whose
    low nibbles are weights 0-15 and high nibbles weights 16-31.
    """
    if tensor_type not in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1):
        raise ValueError(f"expected a Q4_0 or Q4_1 tensor, got {tensor_type.name}")
    header = 4 if tensor_type == GGMLQuantizationType.Q4_1 else 2
    blocks = data.reshape(data.shape[0], -1, header + 16)
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., header:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(data.shape[0], -1)
    if tensor_type == GGMLQuantizationType.Q4_0:  # w = d (q - 8)
        return codes, d, np.zeros_like(d)
    m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
    return codes, d, m + 8 * d  # w = d q + m


def _read_int(reader: GGUFReader, key: str) -> int:
    return int(reader.fields[key].contents())


def gguf_weights_iterator(path: str, packed_modules: Container[str] = frozenset()
                          ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every model tensor in a GGUF file, dequantized to float32.

    The Q4_0/Q4_1 weight of a module named in ``packed_modules`` comes instead
    as ``{module}.qweight`` (codes), ``.scales`` and ``.zeros`` (see ``unpack_q4``).
    """
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
        module, suffix = hf_name.rsplit(".", 1)
        if suffix == "weight" and module in packed_modules:
            parts = dict(zip(("qweight", "scales", "zeros"), unpack_q4(tensor.data, tensor.tensor_type)))
        else:
            parts = {suffix: dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)}
        for part, array in parts.items():
            # Every part is row-major by output row, so the q/k row permutation applies to each alike.
            if permute and ".attn_q." in tensor.name:
                array = reverse_llama_permute(array, n_head)
            elif permute and ".attn_k." in tensor.name:
                array = reverse_llama_permute(array, n_kv_head)
            # Unquantized tensors come back as read-only views of the memory-mapped file.
            yield f"{module}.{part}", torch.from_numpy(np.require(array, requirements=["C", "W"]))
