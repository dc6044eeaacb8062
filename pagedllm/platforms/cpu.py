"""Facts about the CPU that change how we run (native bf16 matmul support), and the process settings it wants."""
from __future__ import annotations

import ctypes
import functools
import sys


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
    fp32 and runs several times slower than plain fp32 (measured on an Ice Lake Xeon: 66 vs 264 GFLOP/s).
    """
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory() -> None:
    """Have glibc's malloc keep freed memory for reuse instead of handing it back to the OS at once.

    By default a block above the mmap threshold (128 KiB, adapting up to 32 MiB) is unmapped when freed and the
    heap's free top trimmed, so each eager step (a prefill chunk: 25 MB of MLP intermediate a layer at 2048
    rows) faults its activations in again, page by page: ~45k minor faults in W3's prefill step, ~500k in a W1
    run; with these settings 2-17k in a process's first run, none after. The cost is the RSS of the largest step, kept. vLLM's CPU backend gets the
    same from the tcmalloc it preloads."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    libc.mallopt(_M_MMAP_THRESHOLD, 256 << 20)
    libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
