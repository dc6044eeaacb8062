"""Facts about the CPU that change how we run (native bf16 matmul support), and the process settings it wants."""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import mmap
import os
import sys

import torch

from pagedllm import native
from pagedllm.native.attention import MAX_GROUP, MAX_HEAD_SIZE
from pagedllm.platforms.interface import KernelChoice, Platform


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_native_bf16() -> bool:
    """True when bf16 matmuls run on hardware (AVX512-BF16 or AMX), not emulated.

    oneDNN reports bf16 as "supported" on any AVX-512 CPU, but without these instructions it converts to
    fp32 and runs several times slower than plain fp32.
    """
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def bf16_panels_apply() -> bool:
    """Whether a bfloat16 model can run as float32 activations times bf16 weight panels: gemm_bf16.c is built
    for this CPU (AVX512-BF16, AMX where it has it), and so are the float32 kernels around the GEMMs."""
    return native.gemm_bf16() is not None and native.fused_ops() is not None


def choose_kernels(dtype: torch.dtype, attention_backend: str = "TORCH_SDPA") -> KernelChoice:
    """This CPU's kernels for a model of ``dtype``: bf16 panels for a bfloat16 model wherever they build. Builds
    (or loads) the kernels it asks about."""
    return KernelChoice(dtype, dtype == torch.bfloat16 and bf16_panels_apply(), attention_backend=attention_backend)


def kernel_paths(kernels: KernelChoice, num_heads: int, num_kv_heads: int, head_size: int,
                 quantization: str | None = None) -> dict[str, str]:
    """Which path a model's attention, GEMMs and fused ops take under ``kernels`` here, in words (the engine logs
    them at start-up; ``python -m pagedllm.native`` prints them for the default model). Mirrors the decisions the
    layers take: native kernels need float32 activations."""
    float32 = kernels.compute_dtype == torch.float32
    attention = native.paged_attention(kernels.dtype) if float32 and kernels.attention_backend == "TORCH_SDPA" else None
    decode = prefill = "torch SDPA" if kernels.attention_backend == "TORCH_SDPA" else "Triton (interpreted)"
    if attention is not None and num_heads // num_kv_heads <= MAX_GROUP and head_size <= MAX_HEAD_SIZE:
        decode = f"native paged_decode ({attention.decode_isa}, {_name(kernels.dtype)} cache)"
    if attention is not None and attention.prefill_supports(num_heads, num_kv_heads, head_size):
        prefill = "native prefill tiles" + ((" (bf16 pairs on AMX)" if attention.prefill_amx else " (bf16 pairs)")
                                            if attention.prefill_pairs else "")
    if kernels.bf16_panels:
        gemm = "bf16 weight panels (" + ("AMX" if native.gemm_bf16_uses_amx() else "AVX512-BF16 vdpbf16ps") + ")"
    elif float32 and native.gemm() is not None:
        gemm = f"float32 panels ({'AVX-512' if 'avx512f' in cpu_flags() else 'AVX2'})"
    else:
        gemm = f"torch ({_name(kernels.compute_dtype)})"
    if quantization in ("gguf", "gguf_int4"):
        q4 = native.gemm_q4() if float32 else None
        gemm += "; GGUF Q4_0/Q4_1/Q4_K layers: " + ("torch int4 kernel" if q4 is None else "native Q4 panels" + (
            " (decode rows by block sums)" if kernels.bf16_panels and q4.for_bf16_model() is not None else ""))
    if quantization == "gguf":
        gemm += "; GGUF Q8_0 layers: " + ("native Q8_0 panels" if float32 and native.gemm_q8() is not None
                                          else "dequantized at load")
    from pagedllm.layers.gemm_layout import BF16_MIN_ROWS, quantized_steps_on_amx  # imports this module: not at the top
    if quantization in ("gguf", "gguf_int4") and float32 and quantized_steps_on_amx(kernels.bf16_panels):
        gemm += f"; packed GGUF layers in steps of {BF16_MIN_ROWS}+ rows: dequantized to bf16 panels, AMX"
    elif quantization == "int8":
        gemm = "W8A8: " + (("native int8 panels" + (" (AMX tiles from 8 rows)" if native.gemm_int8_uses_amx() else ""))
                           if float32 and native.gemm_w8a8() is not None else "torch int8 matmul")
    fused = "native" if float32 and native.fused_ops() is not None else "torch"
    return {"attention (decode)": decode, "attention (prefill)": prefill, "GEMMs": gemm, "fused ops": fused}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=1)
def linux_libc() -> ctypes.CDLL | None:
    """The C library the process runs on, for the Linux memory calls below; None elsewhere."""
    return ctypes.CDLL(None) if sys.platform.startswith("linux") else None


HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def huge_page_zeros(nbytes: int) -> torch.Tensor:
    """``nbytes`` (uint8) of fresh anonymous memory, 2 MiB-aligned, that asks for transparent huge pages before
    its first touch (granted where the system gives them to regions that ask, ``madvise`` mode): mmap, not
    malloc, which may hand back memory already faulted in 4 KiB pages (with keep_freed_memory, the loader's
    freed temporaries). The OS supplies zeros as pages are first touched, so untouched memory costs nothing."""
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    raw = torch.frombuffer(mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS),
                           dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    libc = linux_libc()
    if libc is not None:
        libc.madvise(ctypes.c_void_p(raw.data_ptr() + start), ctypes.c_size_t(size), _MADV_HUGEPAGE)
    return raw[start : start + nbytes]


class HugePageArena:
    """Copies of tensors carved from fresh, 2 MiB-aligned chunks of anonymous memory that ask for transparent
    huge pages before their first touch. For the GEMMs' packed weights, which every decode step streams from
    memory (424 MB for SmolLM2-135M in float32): with 4 KiB pages each 147 KB panel spans 36 pages, each a TLB
    miss and, in a VM, a two-level page walk; in 2 MiB pages a panel takes one TLB entry or two. A chunk is freed
    when the last tensor carved from it is."""

    CHUNK = 64 << 20

    def __init__(self):
        self._chunk: torch.Tensor | None = None
        self._offset = 0

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A new tensor of zeros (memory no tensor has had: the OS's zeros, faulted in as it is written)."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if self._chunk is None or self._offset + nbytes > self._chunk.numel():
            self._chunk, self._offset = huge_page_zeros(max(self.CHUNK, nbytes)), 0
        out = self._chunk[self._offset : self._offset + nbytes].view(dtype).view(shape)
        self._offset += -(-nbytes // 64) * 64
        return out

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.zeros(tensor.shape, tensor.dtype).copy_(tensor)


def keep_freed_memory() -> None:
    """Have glibc's malloc keep freed memory for reuse instead of handing it back to the OS at once.

    By default a block above the mmap threshold (128 KiB, adapting up to 32 MiB) is unmapped when freed and the
    heap's free top trimmed, so each eager step (a prefill chunk: 25 MB of MLP intermediate a layer at 2048
    rows) faults its activations in again, page by page, tens of thousands of minor faults a step. With these
    settings a process faults its memory in during its first steps and reuses it after. The cost is the RSS of
    the largest step, kept. vLLM's CPU backend gets the same from the tcmalloc it preloads. A C library without
    mallopt (not glibc) is left as it is."""
    libc = linux_libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return
    libc.mallopt(_M_MMAP_THRESHOLD, 256 << 20)
    libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)


def release_freed_memory() -> None:
    """Hand the memory malloc holds free back to the OS (glibc's malloc_trim): once a worker has loaded and laid out
    its model and allocated its KV cache. Under keep_freed_memory malloc would otherwise keep the loader's freed
    temporaries (the checkpoint's tensors before their layout: about the weights' size again) for the process's
    whole life; the steps' activations, freed later, are kept for reuse as before."""
    libc = linux_libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def cores_of_rank(rank: int, world_size: int) -> list[int] | None:
    """The cores rank ``rank`` of ``world_size`` binds to: an equal, disjoint share of the cores this process may
    use, so ranks on one machine do not fight over a core (None when ranks outnumber cores: they share all)."""
    cores = sorted(os.sched_getaffinity(0))
    per_rank = len(cores) // world_size
    if per_rank == 0:
        return None
    return cores[rank * per_rank:(rank + 1) * per_rank]


class CpuPlatform(Platform):
    """The CPU: native C kernels, CPU graphs for decode steps, gloo between ranks. Besides its own attention
    backend it offers the CUDA platform's Triton one where Triton's interpreter is on (TRITON_INTERPRET=1): the
    same kernels, run by numpy, for testing them and the device-generic engine path without a GPU."""

    device_type = "cpu"
    dist_backend = "gloo"
    attention_backends = ("TORCH_SDPA", "TRITON_ATTN")

    @classmethod
    def is_available(cls) -> bool:
        return True

    def default_dtype(self) -> torch.dtype:
        """bfloat16 where the CPU multiplies it natively (has_native_bf16), else float32."""
        return torch.bfloat16 if has_native_bf16() else torch.float32

    def choose_kernels(self, dtype: torch.dtype, attention_backend: str) -> KernelChoice:
        return choose_kernels(dtype, attention_backend)

    def check_attention_backend(self, name: str) -> None:
        super().check_attention_backend(name)
        if name != "TRITON_ATTN":
            return
        if importlib.util.find_spec("triton") is None:
            raise ValueError("attention_backend='TRITON_ATTN' needs the triton package (pip install triton)")
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend='TRITON_ATTN' on the CPU runs Triton's interpreter only (set "
                             "TRITON_INTERPRET=1 before the process starts); it is there to test the CUDA backend's "
                             "kernels and is many times slower than TORCH_SDPA")
