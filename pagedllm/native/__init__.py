"""Native CPU kernels: C sources next to this file, compiled at first use (native/build.py) and called through typed
wrappers (native/attention.py, native/gemms.py, native/fused.py). pagedllm/native/README.md describes each kernel.

The functions here hand out a library's typed kernels, or None where the library is off, cannot be built (see
``PAGEDLLM_NATIVE_KERNELS`` in build.py) or has no body for this CPU; callers then take their torch path. Each
library is loaded once per process (and per set of extra flags, which exist for tests: ``-mno-avx512f`` builds
the AVX2 bodies, ``-mno-avx2`` the portable ones, ``-mno-amx-tile`` gemm_bf16.c's vdpbf16ps body).
"""

import ctypes
import functools

import torch

from pagedllm.native import build
from pagedllm.native.attention import SIGNATURES as _ATTENTION_SIGNATURES
from pagedllm.native.attention import MergeAttnStates, PagedAttentionLibrary, PagedDecode, PagedPrefill, PagedPrefix
from pagedllm.native.fused import FUSED_SIGNATURES
from pagedllm.native.gemms import (
    GEMM_BF16,
    GEMM_BF16_SIGNATURES,
    GEMM_BF16_SILU_MUL,
    GEMM_PACKED,
    GEMM_QUANT,
    GEMM_INT8_SIGNATURES,
    GEMM_SIGNATURES,
    GEMM_W8A8,
    GEMM_W8A8_SILU_MUL,
    DequantBf16,
    Gemm,
)
from pagedllm.native.graph import GRAPH_REPLAY_SIGNATURES
from pagedllm.native.lora_ops import LORA_SIGNATURES

_build = build.build  # (library, extra_flags) -> path or None; tests call it directly

# The attention library's build per cache dtype (paged_attention.h): float32, bf16, and the one-byte kv_cache_dtypes.
_KV_FLAGS = {torch.float32: (), torch.bfloat16: ("-DKV_BF16",), torch.float8_e4m3fn: ("-DKV_FP8_E4M3",),
             torch.float8_e5m2: ("-DKV_FP8_E5M2",), torch.int8: ("-DKV_INT8",)}


@functools.cache
def paged_attention(kv_dtype: torch.dtype = torch.float32,
                    extra_flags: tuple[str, ...] = ()) -> PagedAttentionLibrary | None:
    """The paged-attention library for a KV cache of any dtype in _KV_FLAGS, or None."""
    flags = _KV_FLAGS.get(kv_dtype)
    if flags is None:
        return None
    lib = build.load("paged_attention", _ATTENTION_SIGNATURES, flags + extra_flags)
    return None if lib is None else PagedAttentionLibrary(lib, kv_dtype)


def paged_decode(kv_dtype: torch.dtype = torch.float32, extra_flags: tuple[str, ...] = ()) -> PagedDecode | None:
    """Decode rows over a KV cache of any dtype in _KV_FLAGS (paged_decode_f32), or None."""
    library = paged_attention(kv_dtype, extra_flags)
    return None if library is None else library.decode


def paged_prefill(kv_dtype: torch.dtype = torch.float32, extra_flags: tuple[str, ...] = ()) -> PagedPrefill | None:
    """Prefill tiles over a KV cache of any dtype in _KV_FLAGS (paged_prefill_f32), or None, also where the CPU has
    neither AVX-512 nor AVX2 with FMA."""
    library = paged_attention(kv_dtype, extra_flags)
    return None if library is None else library.prefill


def paged_prefill_pairs(kv_dtype: torch.dtype = torch.float32) -> bool:
    """Whether the prefill tiles (and cascade attention's shared part) over a cache of this dtype multiply in bf16
    pairs, queries and softmax weights rounded to bf16 (a bf16 or one-byte cache on a CPU with AVX512-BF16; a
    one-byte cache's rows widened to bf16 first)."""
    library = paged_attention(kv_dtype)
    return library is not None and library.prefill_pairs


def cascade(kv_dtype: torch.dtype = torch.float32) -> tuple[PagedPrefix, MergeAttnStates] | None:
    """Cascade attention's shared part and its merge (paged_prefix_f32, merge_attn_states_f32) for a float32 or
    bf16 KV cache, or None, also where the CPU has neither AVX-512 nor AVX2 with FMA."""
    library = paged_attention(kv_dtype)
    if library is None or library.prefix is None:
        return None
    return library.prefix, library.merge


def prebuild() -> None:
    """Builds every library the engine loads here by default (the attention builds for the caches kv_cache_dtype
    "auto" gives: float32 and bf16) at the same time, so that an empty cache fills in about the time of the slowest
    one; the doctor's first step. A one-byte cache's build is made when an engine first asks for it."""
    if build.mode() != "0":
        build.build_all([(library, ()) for library in build.LIBRARIES]
                        + [("paged_attention", _KV_FLAGS[torch.bfloat16])])


@functools.cache
def fused_ops() -> ctypes.CDLL | None:
    """The library of fused_ops.c (called through pagedllm.native.fused), or None."""
    return build.load("fused_ops", FUSED_SIGNATURES)


@functools.cache
def lora() -> ctypes.CDLL | None:
    """The library of lora.c (called through pagedllm.native.lora_ops), or None."""
    return build.load("lora", LORA_SIGNATURES)


@functools.cache
def graph_replay() -> ctypes.CDLL | None:
    """The library of graph_replay.c (a CPU graph's calls made in C), or None, also where it does not know this
    platform's calling convention."""
    return _with_body(build.load("graph_replay", GRAPH_REPLAY_SIGNATURES), "graph_replay_available")


def _with_body(lib: ctypes.CDLL | None, available: str) -> ctypes.CDLL | None:
    """``lib`` where its ``available()`` function says the build has a body for this CPU, else None."""
    return lib if lib is not None and getattr(lib, available)() else None


def _gemm_of(lib: ctypes.CDLL | None, signature) -> Gemm | None:
    return None if lib is None else Gemm(lib, signature)


@functools.cache
def _gemm_lib(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library of gemm.c, or None, also where the CPU has neither AVX-512 nor AVX2 with FMA."""
    return _with_body(build.load("gemm", GEMM_SIGNATURES, extra_flags), "gemm_available")


@functools.cache
def gemm(extra_flags: tuple[str, ...] = ()) -> Gemm | None:
    """The float32 GEMM over packed panels (gemm_packed_f32), or None."""
    return _gemm_of(_gemm_lib(extra_flags), GEMM_PACKED)


def _gemm_quant_lib(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library of gemm.c where it has the quantized kernels (AVX-512, or AVX2 with FMA and F16C), or None."""
    return _with_body(_gemm_lib(extra_flags), "gemm_quant_available")


@functools.cache
def dequant_bf16() -> DequantBf16 | None:
    """A quantized weight's panels as gemm_bf16's (dequant_bf16_panels), where gemm.c has the quantized kernels and
    this CPU AVX512-BF16; or None."""
    lib = _gemm_quant_lib()
    return None if lib is None or _gemm_bf16_lib() is None else DequantBf16(lib)


@functools.cache
def moe_quant() -> ctypes.CDLL | None:
    """The library whose moe_quant_f32 runs a layer of quantized experts (gemms.moe_quant calls it), or None."""
    return _gemm_quant_lib()


def _quant_gemm(quant_format: str, extra_flags: tuple[str, ...]) -> Gemm | None:
    """gemm_quant_f32 over ``quant_format``'s panels (gemms.QUANT_FORMATS), or None."""
    lib = _gemm_quant_lib(extra_flags)
    return None if lib is None else Gemm(lib, GEMM_QUANT, quant_format)


@functools.cache
def gemm_q4(extra_flags: tuple[str, ...] = ()) -> Gemm | None:
    """The same GEMM over GGUF Q4 panels (gemm_q4_f32), or None."""
    return _quant_gemm("gemm_q4", extra_flags)


@functools.cache
def gemm_q4k(extra_flags: tuple[str, ...] = ()) -> Gemm | None:
    """The same GEMM over Q4 panels with float32 scales (gemm_q4k_f32: GGUF Q4_K), or None."""
    return _quant_gemm("gemm_q4k", extra_flags)


@functools.cache
def gemm_q6kc(extra_flags: tuple[str, ...] = ()) -> Gemm | None:
    """The same GEMM over bit-packed 6-bit codes whose scales are factored per super-block of 256 (gemm_q6kc_f32:
    GGUF Q6_K's and Q3_K's compact form), or None."""
    return _quant_gemm("gemm_q6kc", extra_flags)


@functools.cache
def gemm_q5kc(extra_flags: tuple[str, ...] = ()) -> Gemm | None:
    """The same GEMM over bit-packed 5-bit codes whose scales and zeros are factored per super-block of 256
    (gemm_q5kc_f32: GGUF Q5_K's compact form), or None."""
    return _quant_gemm("gemm_q5kc", extra_flags)


@functools.cache
def gemm_q2kc(extra_flags: tuple[str, ...] = ()) -> Gemm | None:
    """The same per 16 over 2-bit codes (gemm_q2kc_f32: GGUF Q2_K's compact form), or None."""
    return _quant_gemm("gemm_q2kc", extra_flags)


@functools.cache
def gemm_q3kc(extra_flags: tuple[str, ...] = ()) -> Gemm | None:
    """The same per 16 over 3-bit codes in a 3-bit plane, scales as gemm_q6kc_f32's (gemm_q3kc_f32: GGUF Q3_K's compact
    form), or None."""
    return _quant_gemm("gemm_q3kc", extra_flags)


@functools.cache
def gemm_q4kc(extra_flags: tuple[str, ...] = ()) -> Gemm | None:
    """The same GEMM over Q4 panels whose scales and zeros are factored per super-block of 256 (gemm_q4kc_f32: GGUF
    Q4_K's compact form), or None."""
    return _quant_gemm("gemm_q4kc", extra_flags)


@functools.cache
def gemm_q5k(extra_flags: tuple[str, ...] = ()) -> Gemm | None:
    """The same GEMM over GGUF Q5_K panels (gemm_q5k_f32: int8 codes, float32 scales and zeros per 32), or None."""
    return _quant_gemm("gemm_q5k", extra_flags)


@functools.cache
def gemm_q6k(extra_flags: tuple[str, ...] = ()) -> Gemm | None:
    """The same GEMM over GGUF Q6_K panels (gemm_q6k_f32: int8 codes, float32 scales per 16), or None."""
    return _quant_gemm("gemm_q6k", extra_flags)


@functools.cache
def gemm_q2k(extra_flags: tuple[str, ...] = ()) -> Gemm | None:
    """The same GEMM over GGUF Q2_K panels (gemm_q2k_f32: int8 codes, float32 scales and zeros per 16), or None."""
    return _quant_gemm("gemm_q2k", extra_flags)


@functools.cache
def gemm_iq4nl(extra_flags: tuple[str, ...] = ()) -> Gemm | None:
    """The same GEMM over IQ4 panels with fp16 scales (gemm_iq4nl_f32: GGUF IQ4_NL), or None."""
    return _quant_gemm("gemm_iq4nl", extra_flags)


@functools.cache
def gemm_iq4xs(extra_flags: tuple[str, ...] = ()) -> Gemm | None:
    """The same GEMM over IQ4 panels with float32 scales (gemm_iq4xs_f32: GGUF IQ4_XS), or None."""
    return _quant_gemm("gemm_iq4xs", extra_flags)


@functools.cache
def gemm_q8(extra_flags: tuple[str, ...] = ()) -> Gemm | None:
    """The same GEMM over GGUF Q8_0 panels (gemm_q8_f32), or None."""
    return _quant_gemm("gemm_q8", extra_flags)


@functools.cache
def _gemm_bf16_lib(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library of gemm_bf16.c where this CPU has AVX512-BF16 (AMX too, where it has it), or None."""
    return _with_body(build.load("gemm_bf16", GEMM_BF16_SIGNATURES, extra_flags), "gemm_bf16_available")


@functools.cache
def gemm_bf16(extra_flags: tuple[str, ...] = ()) -> Gemm | None:
    """float32 rows times bf16 weight panels (gemm_bf16), on AMX tiles where the CPU has them, else with vdpbf16ps;
    or None."""
    return _gemm_of(_gemm_bf16_lib(extra_flags), GEMM_BF16)


@functools.cache
def moe_bf16(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library whose moe_bf16 runs a layer of experts in bf16 panels (gemms.moe_bf16 calls it), or None."""
    return _gemm_bf16_lib(extra_flags)


def gemm_bf16_address() -> int | None:
    """gemm_bf16's address, for the C callers in other libraries that take it (moe_quant_f32), or None."""
    lib = _gemm_bf16_lib()
    return None if lib is None else ctypes.cast(lib.gemm_bf16, ctypes.c_void_p).value


@functools.cache
def gemm_bf16_silu_mul(extra_flags: tuple[str, ...] = ()) -> Gemm | None:
    """The gate_up projection over gated bf16 panels with silu(gate) * up applied as it is written
    (gemm_bf16_silu_mul); or None."""
    return _gemm_of(_gemm_bf16_lib(extra_flags), GEMM_BF16_SILU_MUL)


@functools.cache
def _gemm_int8_lib(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library of gemm_int8.c where this CPU has AVX2 and FMA (or better), or None."""
    return _with_body(build.load("gemm_int8", GEMM_INT8_SIGNATURES, extra_flags), "gemm_int8_available")


@functools.cache
def gemm_w8a8(extra_flags: tuple[str, ...] = ()) -> Gemm | None:
    """float32 rows, quantized per row as they come in, times int8 weight panels (gemm_int8.c: AMX, AVX512-VNNI,
    AVX-VNNI or AVX2); or None, also where the CPU has none of them."""
    return _gemm_of(_gemm_int8_lib(extra_flags), GEMM_W8A8)


@functools.cache
def gemm_w8a8_silu_mul(extra_flags: tuple[str, ...] = ()) -> Gemm | None:
    """The gate_up projection over gated int8 panels with silu(gate) * up applied as it is written; or None."""
    return _gemm_of(_gemm_int8_lib(extra_flags), GEMM_W8A8_SILU_MUL)


def gemm_bf16_uses_amx(extra_flags: tuple[str, ...] = ()) -> bool:
    """Whether gemm_bf16 multiplies on AMX tiles here (built for them, and the OS lets the process use them)."""
    lib = _gemm_bf16_lib(extra_flags)
    return lib is not None and bool(lib.gemm_bf16_uses_amx())


def gemm_int8_uses_amx(extra_flags: tuple[str, ...] = ()) -> bool:
    """Whether the W8A8 GEMMs multiply on AMX tiles here (built for them, and the OS lets the process use them)."""
    lib = _gemm_int8_lib(extra_flags)
    return lib is not None and bool(lib.gemm_int8_uses_amx())
