"""Read a GGUF file as HF-named float32 tensors.

Weights are dequantized once at load time (the models compute in float32 or
bfloat16), so a GGUF checkpoint feeds the same ``load_weights`` as safetensors.
With ``quantization="gguf"`` (or ``"gguf_int4"``), the Q4_0/Q4_1/Q4_K and Q8_0 weights
of the layers that keep them packed come out as codes and per-block scales
(and zeros) instead.
"""

import functools
import mmap
import re
import struct
from collections.abc import Container, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from pagedllm.layers.quantization.gguf_int4 import Q4_TYPES

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
    "attn_q_norm": "self_attn.q_norm",  # Qwen3's per-head norms
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Mixture-of-experts blocks, by GGUF architecture (Mixtral's files say "llama"). The ``_exps`` tensors stack every
# expert (``[experts, rows, cols]``); ``{expert}`` in a name stands for each expert's index.
_MOE_BLOCK_NAMES = {
    "llama": {
        "ffn_gate_inp": "block_sparse_moe.gate",
        "ffn_gate_exps": "block_sparse_moe.experts.{expert}.w1",
        "ffn_down_exps": "block_sparse_moe.experts.{expert}.w2",
        "ffn_up_exps": "block_sparse_moe.experts.{expert}.w3",
    },
    "qwen2moe": {
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_exps": "mlp.experts.{expert}.gate_proj",
        "ffn_down_exps": "mlp.experts.{expert}.down_proj",
        "ffn_up_exps": "mlp.experts.{expert}.up_proj",
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj",
    },
}
_MOE_BLOCK_NAMES["qwen3moe"] = _MOE_BLOCK_NAMES["qwen2moe"]
# Per architecture, its own block names: phi3 keeps HF's fused q/k/v and gate/up ([gate; up] rows in ffn_up); Gemma's
# four norms a layer (its ffn_norm is the MLP's pre-norm, the attention's output has a norm of its own).
_GEMMA_BLOCK_NAMES = {**_BLOCK_NAMES, "post_attention_norm": "post_attention_layernorm",
                      "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_ARCH_BLOCK_NAMES = {
    "phi3": {**_BLOCK_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gemma2": _GEMMA_BLOCK_NAMES,
    "gemma3": _GEMMA_BLOCK_NAMES,
}
# llama.cpp's converter stores Gemma's RMS norm weights as the scale itself (1 + HF's weight); the models take HF's
# offset from one (gemma2.py), so it comes back out, as transformers' GGUF reading does.
_NORMS_PLUS_ONE = {"gemma2", "gemma3"}
# llama.cpp's per-dimension rope frequency divisors (Llama 3's rope scaling): the config carries them
# (gguf_config.py), not the model's weights. (Phi-3's longrope factors, rope_factors_long/short, are refused:
# transformers' GGUF config does not carry the longrope they belong to.)
_IGNORED = {"rope_freqs"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)")


@functools.cache
def _block_names(arch: str) -> dict[str, str]:
    """GGUF block tensor name -> HF module name for files of architecture ``arch`` (built once per architecture:
    every tensor name is looked up in it)."""
    return {**_ARCH_BLOCK_NAMES.get(arch, _BLOCK_NAMES), **_MOE_BLOCK_NAMES.get(arch, {})}


def gguf_to_hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """Map e.g. ``blk.3.attn_q.weight`` to ``model.layers.3.self_attn.q_proj.weight`` (a stacked experts tensor to
    a name with ``{expert}`` in it) for a file of ``general.architecture`` ``arch``.

    Returns None for tensors the models do not use; raises on unknown names.
    """
    base, suffix = gguf_name.rsplit(".", 1)
    if base in _IGNORED:
        return None
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    match = _BLOCK_RE.fullmatch(base)
    if match:
        block_names = _block_names(arch)
        if match.group(2) in block_names:
            return f"model.layers.{match.group(1)}.{block_names[match.group(2)]}.{suffix}"
    raise ValueError(f"Unsupported GGUF tensor {gguf_name!r} (general.architecture {arch!r})")


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
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_TYPED_ARRAYS = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64,
}


def _read_value(buf: mmap.mmap, pos: int, value_type: int) -> tuple[object, int]:
    """The metadata value at ``pos`` (None for arrays, which are skipped) and the offset just past it."""
    if value_type == GGUFValueType.STRING:
        (length,) = struct.unpack_from("<Q", buf, pos)
        return buf[pos + 8 : pos + 8 + length].decode(errors="replace"), pos + 8 + length
    if value_type == GGUFValueType.ARRAY:
        item_type, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item_type in _SCALAR_SIZES:
            return None, pos + count * _SCALAR_SIZES[item_type]
        for _ in range(count):
            pos = _read_value(buf, pos, item_type)[1]
        return None, pos
    fmt = _SCALAR_FORMATS[value_type]
    return struct.unpack_from(fmt, buf, pos)[0], pos + _SCALAR_SIZES[value_type]


@dataclass
class GGUFTensorInfo:
    name: str
    tensor_type: GGMLQuantizationType
    # numpy order (GGUF lists dimensions innermost first).
    shape: tuple[int, ...]
    # Absolute byte offset of the data in the file.
    offset: int


def read_gguf_header(path: str) -> tuple[dict[str, object], list[GGUFTensorInfo]]:
    """Scalar and string metadata, and every tensor's name, type, shape and data offset, from the header alone.

    gguf's GGUFReader turns every metadata item (the whole 49k-token vocabulary) into numpy views up front,
    seconds of start-up; the weights need none of it, and this walk over the header takes milliseconds.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version, n_tensors, n_kv = struct.unpack_from("<IIQQ", buf, 0)
        if magic != GGUF_MAGIC or version not in (2, 3):
            raise ValueError(f"{path!r} is not a little-endian GGUF v2/v3 file")
        pos = 24
        metadata = {}
        for _ in range(n_kv):
            key, pos = _read_value(buf, pos, GGUFValueType.STRING)
            value, pos = _read_value(buf, pos + 4, struct.unpack_from("<I", buf, pos)[0])
            if value is not None:
                metadata[key] = value
        tensors = []
        for _ in range(n_tensors):
            name, pos = _read_value(buf, pos, GGUFValueType.STRING)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            pos += 4 + 8 * n_dims
            tensor_type, offset = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            tensors.append(GGUFTensorInfo(name, GGMLQuantizationType(tensor_type), tuple(reversed(dims)), offset))
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-pos // alignment) * alignment
    for tensor in tensors:
        tensor.offset += data_start
    return metadata, tensors


@functools.cache
def _dequantizes(tensor_type: GGMLQuantizationType) -> bool:
    """Whether a weight of ``tensor_type`` loads: gguf-py dequantizes it (asked with one block of zeros; it has no
    public list, and lacks some types, such as llama.cpp's Q8_K)."""
    type_size = GGML_QUANT_SIZES[tensor_type][1]
    try:
        dequantize_fast(np.zeros((1, type_size), dtype=np.uint8), tensor_type)
    except NotImplementedError:
        return False
    return True


def check_gguf_tensors(metadata: dict[str, object], tensors: list[GGUFTensorInfo]) -> None:
    """A ValueError naming the first tensor of a GGUF file (read_gguf_header's) that its weights cannot load from: a
    name no model here takes (gguf_to_hf_name), or a type gguf-py does not dequantize. From the header alone, so the
    file fails as its config loads, before any process starts or weight is read, not midway through the load."""
    arch = metadata["general.architecture"]
    for tensor in tensors:
        if gguf_to_hf_name(tensor.name, arch) is not None and not _dequantizes(tensor.tensor_type):
            supported = [t.name for t in GGMLQuantizationType if _dequantizes(t)]
            raise ValueError(f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which is not "
                             f"supported; supported: {', '.join(supported)}")


def gguf_tensor_types(path: str) -> dict[str, GGMLQuantizationType]:
    """HF weight name -> GGUF type of every model tensor (cheap: checks engine arguments against the file)."""
    metadata, tensors = read_gguf_header(path)
    return {hf_name: t.tensor_type for t in tensors
            if (hf_name := gguf_to_hf_name(t.name, metadata["general.architecture"])) is not None}


def read_gguf_tensor(path: str, tensor: GGUFTensorInfo) -> np.ndarray:
    """One tensor of the file (read_gguf_header's entry for it), as GGUFReader presents it (a copy)."""
    return np.array(_tensor_data(np.memmap(path, mode="r"), tensor))


def _tensor_data(file: np.memmap, tensor: GGUFTensorInfo) -> np.ndarray:
    """The tensor's bytes as GGUFReader presents them: float and integer types as typed arrays, quantized ones as uint8
    rows of blocks (what gguf.quants.dequantize takes)."""
    block_size, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
    *rows, row_elems = tensor.shape
    num_bytes = int(np.prod(rows, dtype=np.int64)) * row_elems // block_size * type_size
    raw = file[tensor.offset : tensor.offset + num_bytes]
    if tensor.tensor_type in _TYPED_ARRAYS:
        return raw.view(_TYPED_ARRAYS[tensor.tensor_type]).reshape(tensor.shape)
    return raw.reshape(*rows, row_elems // block_size * type_size)


def _fp16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte ``at`` of each block, as float32."""
    return np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32)


def unpack_q4(data: np.ndarray, tensor_type: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_0/Q4_1/Q4_K rows -> codes ``[N, K]`` uint8 in [0, 16), scales and zeros ``[N, K / 32]`` float32, each
    weight ``code * scale + zero`` for its block of 32 along K, as gguf dequantizes it (the product is exact, so
    the weight rounds once, at the add).

    A Q4_0/Q4_1 block is an fp16 ``d`` (Q4_1: then an fp16 min ``m``) and 16 bytes whose low nibbles are weights
    0-15 and high nibbles weights 16-31: Q4_0 ``d (q - 8)``, Q4_1 ``d q + m``. A Q4_K super-block of 256 is fp16
    ``d`` and ``dmin``, 12 bytes of eight 6-bit scales ``sc`` and mins ``m`` (one each per 32), and 128 bytes of
    codes, each 32 holding two blocks (low nibbles, then high): ``(d sc) q - dmin m``, where ``d sc`` is not an
    fp16 value.
    """
    if tensor_type not in Q4_TYPES:
        raise ValueError(f"expected a Q4_0, Q4_1 or Q4_K tensor, got {tensor_type.name}")
    rows = data.shape[0]
    if tensor_type == GGMLQuantizationType.Q4_K:
        blocks = data.reshape(rows, -1, 144)
        qs = blocks[..., 16:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
        return ((qs & 0x0F).reshape(rows, -1), *_k_quant_scales_and_zeros(blocks))
    header = 4 if tensor_type == GGMLQuantizationType.Q4_1 else 2
    blocks = data.reshape(rows, -1, header + 16)
    d = _fp16(blocks, 0)
    qs = blocks[..., header:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, -1)
    if tensor_type == GGMLQuantizationType.Q4_0:
        return codes, d, -8 * d
    return codes, d, _fp16(blocks, 2)


def _k_quant_scales_and_zeros(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K super-blocks ``[rows, n, bytes]`` (fp16 ``d`` and ``dmin``, then 12 bytes of eight 6-bit scales
    ``sc`` and mins ``m``, as llama.cpp's get_scale_min_k4 reads them) -> per 32 weights the scale ``d * sc`` and the
    zero ``-dmin * m``, ``[rows, n * 8]`` float32."""
    rows = blocks.shape[0]
    packed = blocks[..., 4:16].astype(np.uint8)
    sc = np.concatenate([packed[..., 0:4] & 63, (packed[..., 8:12] & 0x0F) | ((packed[..., 0:4] >> 6) << 4)], -1)
    m = np.concatenate([packed[..., 4:8] & 63, (packed[..., 8:12] >> 4) | ((packed[..., 4:8] >> 6) << 4)], -1)
    scales = (_fp16(blocks, 0)[..., None] * sc.astype(np.float32)).reshape(rows, -1)
    return scales, -(_fp16(blocks, 2)[..., None] * m.astype(np.float32)).reshape(rows, -1)


def unpack_q5_k(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q5_K rows -> codes ``[N, K]`` int8 in [0, 32), scales and zeros ``[N, K / 32]`` float32, each weight
    ``code * scale + zero`` as gguf dequantizes it (``(d sc) q - dmin m``). A super-block of 256 is Q4_K's header, 32
    bytes of the codes' fifth bits (bit i of byte l: weight l of block i) and 128 of their low nibbles (each 32 bytes
    two blocks: low nibbles, then high)."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, 176)
    low = blocks[..., 48:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    high = blocks[..., 16:48].reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
    codes = ((low & 0x0F).reshape(rows, -1, 8, 32) | ((high & 0x01) << 4)).astype(np.int8).reshape(rows, -1)
    return (codes, *_k_quant_scales_and_zeros(blocks))


def unpack_q6_k(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K rows -> codes ``[N, K]`` int8 (``q - 32``, in [-32, 31]) and scales ``[N, K / 16]`` float32 (``d * sc``);
    each weight is ``code * scale``, as gguf dequantizes it. A super-block of 256 is 128 bytes of the codes' low
    nibbles, 64 of their high two bits, 16 int8 scales ``sc`` (one per 16) and an fp16 ``d``."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, 210)
    low = blocks[..., :128].reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    high = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    q = (low & 0x0F).reshape(rows, -1, 2, 4, 32) | ((high & 0x03).reshape(rows, -1, 2, 4, 32) << 4)
    codes = (q.astype(np.int8) - np.int8(32)).reshape(rows, -1)
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    return codes, (_fp16(blocks, 208)[..., None] * sc).reshape(rows, -1)


IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


IQ4_TYPES = (GGMLQuantizationType.IQ4_NL, GGMLQuantizationType.IQ4_XS)


def unpack_iq4(data: np.ndarray, tensor_type: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray]:
    """IQ4_NL/IQ4_XS rows -> indices ``[N, K]`` uint8 in [0, 16) into IQ4_NL_VALUES and scales ``[N, K / 32]``
    float32, each weight ``IQ4_NL_VALUES[index] * scale`` as gguf dequantizes it: IQ4_NL's fp16 ``d`` (2 + 16 bytes a
    block, low nibbles weights 0-15), IQ4_XS's ``d (ls - 32)`` (a super-block of 256: fp16 ``d``, the 6-bit ``ls``
    as 2 high bits in a uint16 and 4 low in 4 bytes, then 16 bytes a block of 32)."""
    rows = data.shape[0]
    if tensor_type == GGMLQuantizationType.IQ4_NL:
        blocks = data.reshape(rows, -1, 18)
        qs = blocks[..., 2:].reshape(rows, -1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
        return (qs & 0x0F).reshape(rows, -1), _fp16(blocks, 0)
    blocks = data.reshape(rows, -1, 136)
    high = np.ascontiguousarray(blocks[..., 2:4]).view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))
    low = blocks[..., 4:8, None] >> np.array([0, 4], dtype=np.uint8)
    ls = (low.reshape(rows, -1, 8) & 0x0F) | ((high & 0x03).astype(np.uint8) << 4)
    scales = _fp16(blocks, 0)[..., None] * (ls.astype(np.float32) - 32)
    qs = blocks[..., 8:].reshape(rows, -1, 8, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    return (qs & 0x0F).reshape(rows, -1), scales.reshape(rows, -1)


def unpack_q8(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 rows -> codes ``[N, K]`` int8 and scales ``[N, K / 32]`` float32; each weight is ``code * scale``
    (exact in float32). A block is an fp16 ``d`` and 32 int8 codes."""
    blocks = data.reshape(data.shape[0], -1, 2 + 32)
    codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(data.shape[0], -1)
    return codes, _fp16(blocks, 0)


def _two_bit_runs(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K code bytes ``[rows, n, 64]`` -> their 2-bit fields ``[rows, n * 16, 16]``: each 32 bytes hold four
    runs of 32 codes, at bits 0-1, 2-3, 4-5, 6-7."""
    rows = qs.shape[0]
    fields = qs.reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    return (fields & 0x03).reshape(rows, -1, 16)


def unpack_q3_k(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q3_K rows -> codes ``[N, K]`` int8 in [-4, 4) and scales ``[N, K / 16]`` float32 (``d (sc - 32)``), each weight
    ``code * scale`` as gguf dequantizes it. A super-block of 256 is 32 bytes of the codes' high bits (a code is its
    2 low bits, less 4 where its high bit is clear), 64 of their low bits, 12 of sixteen 6-bit scales (4 low bits in
    bytes 0-7, two halves; 2 high bits in bytes 8-11, four quarters) and an fp16 ``d``."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, 110)
    low = blocks[..., 96:104, None] >> np.array([0, 4], dtype=np.uint8)  # [rows, n, 8, 2]
    high = blocks[..., 104:108, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)  # [rows, n, 4, 4]
    sc = (low.transpose(0, 1, 3, 2).reshape(rows, -1, 16) & 0x0F) | (
        (high.transpose(0, 1, 3, 2).reshape(rows, -1, 16) & 0x03) << 4)
    scales = _fp16(blocks, 108)[..., None] * (sc.astype(np.float32) - 32)
    hbits = (blocks[..., :32].reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
    codes = _two_bit_runs(blocks[..., 32:96]).astype(np.int8) - ((hbits.reshape(rows, -1, 16) ^ 1) << 2).astype(np.int8)
    return codes.reshape(rows, -1), scales.reshape(rows, -1)


def unpack_q2_k(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q2_K rows -> codes ``[N, K]`` int8 in [0, 4), scales and zeros ``[N, K / 16]`` float32 (``d sc``,
    ``-dmin m``), each weight ``code * scale + zero`` as gguf dequantizes it. A super-block of 256 is sixteen bytes of
    4-bit ``sc`` (low) and ``m`` (high), 64 bytes of 2-bit codes, fp16 ``d`` and ``dmin``."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, 84)
    packed = blocks[..., :16]
    scales = _fp16(blocks, 80)[..., None] * (packed & 0x0F).astype(np.float32)
    zeros = -(_fp16(blocks, 82)[..., None] * (packed >> 4).astype(np.float32))
    codes = _two_bit_runs(blocks[..., 16:80]).astype(np.int8).reshape(rows, -1)
    return codes, scales.reshape(rows, -1), zeros.reshape(rows, -1)


# Each type a kernel keeps packed, and how its rows unpack: codes, then per block (of 32 or 16) the scales, then,
# where the type has them, the zeros; each weight ``code * scale (+ zero)`` (an IQ4 code indexes IQ4_NL_VALUES).
_UNPACK = {
    **{t: (lambda data, t=t: unpack_q4(data, t)) for t in Q4_TYPES},
    **{t: (lambda data, t=t: unpack_iq4(data, t)) for t in IQ4_TYPES},
    GGMLQuantizationType.Q8_0: unpack_q8,
    GGMLQuantizationType.Q6_K: unpack_q6_k,
    GGMLQuantizationType.Q5_K: unpack_q5_k,
    GGMLQuantizationType.Q3_K: unpack_q3_k,
    GGMLQuantizationType.Q2_K: unpack_q2_k,
}
PACKED_PARTS = ("qweight", "scales", "zeros")  # the names the unpacked parts load as, in _UNPACK's order


def unpack(data: np.ndarray, tensor_type: GGMLQuantizationType) -> tuple[np.ndarray, ...]:
    """The rows of a packed type (see _UNPACK): ``(codes, scales[, zeros])``; a ValueError for another type."""
    if tensor_type not in _UNPACK:
        raise ValueError(f"no packed form of {tensor_type.name}")
    return _UNPACK[tensor_type](data)


def dequantize_fast(data: np.ndarray, tensor_type: GGMLQuantizationType) -> np.ndarray:
    """Dequantize to float32: the packed types (_UNPACK) with whole-tensor numpy arithmetic on their unpacked codes,
    scales and zeros (an order of magnitude faster than gguf's loop over row groups, with the same results: the code
    times the scale, then plus the zero, each rounded as gguf rounds), other types through gguf."""
    if tensor_type not in _UNPACK or data.ndim != 2:
        return dequantize(data, tensor_type).astype(np.float32, copy=False)
    codes, scales, *zeros = unpack(data, tensor_type)
    values = IQ4_NL_VALUES[codes] if tensor_type in IQ4_TYPES else codes
    blocks = values.reshape(*scales.shape, -1).astype(np.float32)
    blocks *= scales[..., None]
    if zeros:
        blocks += zeros[0][..., None]
    return blocks.reshape(codes.shape)


def gguf_weights_iterator(path: str, packed_modules: Container[str] = frozenset()
                          ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every model tensor in a GGUF file, dequantized to float32.

    The weight of a packed type (``unpack``) of a module named in ``packed_modules`` comes instead as
    ``{module}.qweight`` (codes), ``.scales`` and, where the type has them, ``.zeros`` (a stack of experts: named
    with ``{expert}``, as gguf_to_hf_name names it, each expert's parts in turn).
    """
    metadata, tensors = read_gguf_header(path)
    file = np.memmap(path, dtype=np.uint8, mode="r")
    arch = metadata["general.architecture"]
    # Only llama-arch files are permuted by llama.cpp's converter (not qwen2).
    permute = arch == "llama"
    if permute:
        n_head = int(metadata[f"{arch}.attention.head_count"])
        n_kv_head = int(metadata[f"{arch}.attention.head_count_kv"])
    for tensor in tensors:
        data = _tensor_data(file, tensor)
        hf_name = gguf_to_hf_name(tensor.name, arch)
        if hf_name is None:
            continue
        module, suffix = hf_name.rsplit(".", 1)
        if "{expert}" in hf_name:  # each expert's slice of the stack, as the checkpoint's per-expert tensors, one
            for expert, rows in enumerate(data):  # at a time (a stack is GBs in float32), packed or dequantized
                parts = (zip(PACKED_PARTS, unpack(rows, tensor.tensor_type)) if module in packed_modules
                         else [(suffix, dequantize_fast(rows, tensor.tensor_type))])
                for part, array in parts:
                    yield (f"{module}.{part}".format(expert=expert),
                           torch.from_numpy(np.require(array, requirements=["C", "W"])))
            continue
        if suffix == "weight" and module in packed_modules:
            parts = dict(zip(PACKED_PARTS, unpack(data, tensor.tensor_type)))
        else:
            parts = {suffix: dequantize_fast(data, tensor.tensor_type)}
            if module.endswith("shared_expert_gate"):  # llama.cpp keeps its one row as a vector
                parts[suffix] = parts[suffix].reshape(1, -1)
            elif arch in _NORMS_PLUS_ONE and module.endswith("norm"):
                parts[suffix] = parts[suffix] - 1.0
        for part, array in parts.items():
            # Every part is row-major by output row, so the q/k row permutation applies to each alike.
            if permute and ".attn_q." in tensor.name:
                array = reverse_llama_permute(array, n_head)
            elif permute and ".attn_k." in tensor.name:
                array = reverse_llama_permute(array, n_kv_head)
            # Unquantized tensors come back as read-only views of the memory-mapped file.
            yield f"{module}.{part}", torch.from_numpy(np.require(array, requirements=["C", "W"]))
