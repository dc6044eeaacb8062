"""Native CPU kernels: C sources next to this file, compiled at first use and loaded with ctypes.

pip installs no compiled code. A kernel is built once by the system C compiler (``$CC``, else ``cc``) into the
cache directory, under a key of its source and the headers beside it, the flags and this CPU's feature flags
(``-march=native``), and renamed into place whole so concurrent processes never load half a file. Its OpenMP loop
binds to the ``libgomp.so.1`` torch has already loaded (same soname), so it runs on torch's worker threads.
Without a compiler, on a build failure, or with ``PAGEDLLM_NATIVE_KERNELS=0``, the loaders return None and
callers use the torch path.
"""

import ctypes
import functools
import glob
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

import torch  # noqa: F401  (loads torch's libgomp.so.1 before any kernel binds to that soname)

from pagedllm.cache_dir import cache_root

logger = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]
_HERE = os.path.dirname(os.path.abspath(__file__))


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build(name: str, extra_flags: tuple[str, ...] = ()) -> str | None:
    """Path of the built shared library for ``name.c``, building it if needed; None if it cannot be built."""
    source = os.path.join(_HERE, f"{name}.c")
    code = b""
    for path in [source, *sorted(glob.glob(os.path.join(_HERE, "*.h")))]:  # the headers it may include
        with open(path, "rb") as f:
            code += f.read()
    compiler = os.environ.get("CC", "cc")
    flags = [*FLAGS, *extra_flags]
    key = hashlib.sha256(code + "\0".join([compiler, *flags, _cpu_flags()]).encode()).hexdigest()[:16]
    target = os.path.join(cache_root(), "kernels", f"{name}-{key}.so")
    if os.path.exists(target):
        return target
    if shutil.which(compiler) is None:
        logger.info("No C compiler (%s): native %s kernel off, using the torch path", compiler, name)
        return None
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=f".{name}-", suffix=".so")
        os.close(fd)
        try:
            subprocess.run([compiler, *flags, source, "-o", tmp, "-lm"], check=True, capture_output=True,
                           timeout=120)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except (OSError, subprocess.SubprocessError) as e:
        detail = (getattr(e, "stderr", None) or b"").decode(errors="replace")[-2000:]
        logger.warning("Building the native %s kernel failed (%s) %s; using the torch path", name, e, detail)
        return None
    return target


_P, _I32, _I64, _F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
# Every GEMM's arguments: x, ldx, packed weight, bias, y, ldy, M, N, K, threads.
_GEMM_ARGS = [_P, _I64, _P, _P, _P, _I64, _I32, _I32, _I32, _I32]


def _load(name: str, signatures: dict[str, tuple[list, object]], extra_flags: tuple[str, ...] = ()):
    """``name.c`` built and loaded with the given ``{function: (argtypes, restype)}``, or None (no compiler, a
    failed build, or ``PAGEDLLM_NATIVE_KERNELS=0``)."""
    if os.environ.get("PAGEDLLM_NATIVE_KERNELS", "1") == "0":
        return None
    path = _build(name, extra_flags)
    if path is None:
        return None
    lib = ctypes.CDLL(path)
    for function, (argtypes, restype) in signatures.items():
        getattr(lib, function).argtypes = argtypes
        getattr(lib, function).restype = restype
    return lib


@functools.cache
def _paged_attention(extra_flags: tuple[str, ...]):
    """The library of paged_decode.c, loaded once for both of its kernels, or None."""
    return _load("paged_decode", {
        "paged_decode_f32": (
            [_P, _I64, _P, _P, _P, _I64, _P, _I32, _P, _P, _I32, _I32, _I32, _I32, _I32, _F32, _I32], _I32),
        "paged_prefill_available": ([], _I32),
        "paged_prefill_pairs": ([], _I32),
        "paged_prefill_f32": (
            [_P, _P, _P, _P, _I64, _P, _P, _P, _I32, _P, _P, _I32, _I32, _I32, _I32, _I32, _F32, _I32], _I32),
        "paged_prefix_f32": (
            [_P, _I64, _P, _P, _P, _I32, _I32, _P, _P, _I32, _I32, _I32, _I32, _F32, _I32], _I32),
        "merge_attn_states_f32": ([_P, _P, _P, _P, _P, _I64, _I32], None),
    }, extra_flags)


_KV_FLAGS = {torch.float32: (), torch.bfloat16: ("-DKV_BF16",)}  # paged_decode.c's build per KV cache dtype


def _paged_attention_for(kv_dtype: torch.dtype, extra_flags: tuple[str, ...]):
    flags = _KV_FLAGS.get(kv_dtype)
    return None if flags is None else _paged_attention(flags + extra_flags)


@functools.cache
def paged_decode(kv_dtype: torch.dtype = torch.float32, extra_flags: tuple[str, ...] = ()):
    """The C function ``paged_decode_f32`` (see paged_decode.c) for a float32 or bf16 KV cache, or None.
    ``extra_flags`` exist for tests (``-mno-avx512f`` builds the AVX2 body)."""
    lib = _paged_attention_for(kv_dtype, extra_flags)
    return None if lib is None else lib.paged_decode_f32


@functools.cache
def paged_prefill(kv_dtype: torch.dtype = torch.float32, extra_flags: tuple[str, ...] = ()):
    """The C function ``paged_prefill_f32`` (see paged_decode.c) for a float32 or bf16 KV cache, or None, also
    where the CPU has no AVX-512."""
    lib = _paged_attention_for(kv_dtype, extra_flags)
    return lib.paged_prefill_f32 if lib is not None and lib.paged_prefill_available() else None


def paged_prefill_pairs(kv_dtype: torch.dtype = torch.float32) -> bool:
    """Whether the prefill tiles (and cascade attention's shared part) over a cache of this dtype multiply in bf16
    pairs, queries and softmax weights rounded to bf16 (a bf16 cache on a CPU with AVX512-BF16)."""
    lib = _paged_attention_for(kv_dtype, ())
    return lib is not None and bool(lib.paged_prefill_available()) and bool(lib.paged_prefill_pairs())


@functools.cache
def cascade(kv_dtype: torch.dtype = torch.float32):
    """``(paged_prefix_f32, merge_attn_states_f32)`` (see paged_decode.c) for a float32 or bf16 KV cache:
    cascade attention's shared part and its merge, or None, also where the CPU has no AVX-512."""
    lib = _paged_attention_for(kv_dtype, ())
    if lib is None or not lib.paged_prefill_available():
        return None
    return lib.paged_prefix_f32, lib.merge_attn_states_f32


@functools.cache
def fused_ops():
    """The library of fused_ops.c (used through pagedllm.native.fused), or None."""
    return _load("fused_ops", {
        "add_rms_norm_f32": ([_P, _P, _P, _P, _P, _I64, _I32, _F32], None),
        "silu_and_mul_f32": ([_P, _P, _I64, _I32], None),
        "rotary_neox_f32": ([_P, _I64, _P, _P, _I64, _I64, _I32, _I32, _I32], _I32),
        "embedding_f32": ([_P, _P, _P, _I64, _I32, _I64], _I32),
        "embedding_q8_f32": ([_P, _P, _P, _P, _I64, _I32, _I64], _I32),
        "write_kv_f32": ([_P, _P, _I64, _P, _P, _I64, _P, _I64, _I32], _I32),
        "write_kv_bf16": ([_P, _P, _I64, _P, _P, _I64, _P, _I64, _I32], _I32),
        "argmax_rows_f32": ([_P, _I64, _I64, _P], None),
    })


@functools.cache
def _gemm_lib(extra_flags: tuple[str, ...] = ()):
    """The library of gemm.c, or None, also where the CPU has neither AVX-512 nor AVX2 with FMA."""
    lib = _load("gemm", {"gemm_available": ([], _I32), "gemm_quant_available": ([], _I32),
                         "gemm_packed_f32": (_GEMM_ARGS, _I32), "gemm_q4_f32": (_GEMM_ARGS, _I32),
                         "gemm_q8_f32": (_GEMM_ARGS, _I32)}, extra_flags)
    return lib if lib is not None and lib.gemm_available() else None


def gemm(extra_flags: tuple[str, ...] = ()):
    """The C function ``gemm_packed_f32`` (see gemm.c), or None. ``extra_flags`` exist for tests
    (``-mno-avx512f`` builds the AVX2 body)."""
    lib = _gemm_lib(extra_flags)
    return None if lib is None else lib.gemm_packed_f32


def _gemm_quant_lib():
    """The library of gemm.c where it has the quantized kernels (AVX-512), or None."""
    lib = _gemm_lib()
    return lib if lib is not None and lib.gemm_quant_available() else None


def gemm_q4():
    """The C function ``gemm_q4_f32`` (see gemm.c): the same GEMM over GGUF Q4 panels, or None."""
    lib = _gemm_quant_lib()
    return None if lib is None else lib.gemm_q4_f32


def gemm_q8():
    """The C function ``gemm_q8_f32`` (see gemm.c): the same GEMM over GGUF Q8_0 panels, or None."""
    lib = _gemm_quant_lib()
    return None if lib is None else lib.gemm_q8_f32


@functools.cache
def _gemm_bf16_lib(extra_flags: tuple[str, ...] = ()):
    """The library of gemm_bf16.c where this CPU has AVX512-BF16 (AMX too, where it has it), or None."""
    lib = _load("gemm_bf16", {"gemm_bf16_available": ([], _I32), "gemm_bf16_uses_amx": ([], _I32),
                              "gemm_bf16": (_GEMM_ARGS, _I32), "gemm_bf16_silu_mul": (_GEMM_ARGS, _I32)},
                extra_flags)
    return lib if lib is not None and lib.gemm_bf16_available() else None


def gemm_bf16(extra_flags: tuple[str, ...] = ()):
    """The C function ``gemm_bf16`` (see gemm_bf16.c): float32 rows times bf16 weight panels, on AMX tiles where
    the CPU has them, else with vdpbf16ps; or None. ``extra_flags`` exist for tests (``-mno-amx-tile`` builds the
    vdpbf16ps body)."""
    lib = _gemm_bf16_lib(extra_flags)
    return None if lib is None else lib.gemm_bf16


def gemm_bf16_silu_mul(extra_flags: tuple[str, ...] = ()):
    """The C function ``gemm_bf16_silu_mul`` (see gemm_bf16.c): the gate_up projection over gated bf16 panels with
    silu(gate) * up applied as it is written; or None."""
    lib = _gemm_bf16_lib(extra_flags)
    return None if lib is None else lib.gemm_bf16_silu_mul


def gemm_bf16_uses_amx(extra_flags: tuple[str, ...] = ()) -> bool:
    """Whether gemm_bf16 multiplies on AMX tiles here (built for them, and the OS lets the process use them)."""
    lib = _gemm_bf16_lib(extra_flags)
    return lib is not None and bool(lib.gemm_bf16_uses_amx())
