"""Building the native kernels: C sources beside this file, compiled at first use and loaded with ctypes.

pip installs no compiled code. A library (LIBRARIES: its name and C files) is built once by the system C compiler
(``$CC``, else ``cc``) into the cache directory, under a key of its sources and every header beside them, the flags
and this CPU's feature flags (``-march=native``), and renamed into place whole, so that concurrent processes never
load half a file. Its OpenMP loops bind to the ``libgomp.so.1`` torch has already loaded (same soname), so they run
on torch's worker threads.

What happens without a library is set by ``PAGEDLLM_NATIVE_KERNELS``: unset or ``1``, callers fall back to their
torch path (with a warning naming the reason, once per process); ``0``, no library is built or loaded; ``require``,
a library that cannot be built is an error (NativeKernelError). A failed build is remembered per key in a
``.failed`` file holding the compiler's message, so later processes do not retry it (delete the file, or change the
compiler, flags or sources, to try again). What each library's build did in this process is in ``STATUS``, which
``python -m pagedllm.native`` prints.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch  # noqa: F401  (loads torch's libgomp.so.1 before any kernel binds to that soname)

from pagedllm.cache_dir import cache_root

logger = logging.getLogger(__name__)

# -fno-trapping-math: no kernel reads the floating-point exception flags, and without it GCC will not vectorise a
# loop holding a float comparison (exp_poly's clamp: every exp, SiLU and GeGLU loop stayed scalar). It changes no
# value computed (unlike -ffast-math).
FLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared")
HERE = os.path.dirname(os.path.abspath(__file__))

# Each library and the C files it is built from (the headers beside them are part of every build's key).
LIBRARIES = {
    "paged_attention": ("paged_decode.c", "paged_prefill.c", "paged_cascade.c"),
    "fused_ops": ("fused_ops.c", "write_kv.c", "fused_moe.c"),
    "gemm": ("gemm.c", "gemm_quant_q4.c", "gemm_quant_q8_iq4.c", "gemm_quant_q6k.c", "gemm_quant_q5k.c",
             "gemm_quant_q2k_q3k.c", "moe_quant.c"),
    "gemm_bf16": ("gemm_bf16.c", "moe_bf16.c"),
    "gemm_int8": ("gemm_int8.c",),
    "lora": ("lora.c",),
    "graph_replay": ("graph_replay.c",),
}


class NativeKernelError(RuntimeError):
    """A kernel library could not be built while ``PAGEDLLM_NATIVE_KERNELS=require``."""


@dataclass
class BuildStatus:
    """What loading one library (with some extra flags) did in this process."""

    library: str
    extra_flags: tuple[str, ...]
    state: str  # "built", "cached", "failed", "no compiler" or "disabled"
    path: str | None = None  # the shared library, or the .failed file
    detail: str = ""  # the compiler's message for a failed build
    seconds: float = 0.0  # how long the build took ("built" only)


STATUS: dict[tuple[str, tuple[str, ...]], BuildStatus] = {}


def mode() -> str:
    """``PAGEDLLM_NATIVE_KERNELS``: "0" (off), "require", or "1" (the default: fall back to torch)."""
    value = os.environ.get("PAGEDLLM_NATIVE_KERNELS", "1")
    if value not in ("0", "1", "require"):
        raise ValueError(f"PAGEDLLM_NATIVE_KERNELS must be 0, 1 or require; got {value!r}")
    return value


def cpu_flags_line() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _sources(library: str) -> list[str]:
    return [os.path.join(HERE, name) for name in LIBRARIES[library]]


def _headers() -> list[str]:
    return sorted(glob.glob(os.path.join(HERE, "*.h")))


def _key(library: str, compiler: str, flags: list[str]) -> str:
    code = b""
    for path in [*_sources(library), *_headers()]:
        with open(path, "rb") as f:
            code += f.read()
    return hashlib.sha256(code + "\0".join([compiler, *flags, cpu_flags_line()]).encode()).hexdigest()[:16]


def build(library: str, extra_flags: tuple[str, ...] = ()) -> str | None:
    """Path of the built shared library, building it if needed; None if it cannot be built (NativeKernelError
    instead under ``require``). Records what it did in STATUS."""
    compiler = os.environ.get("CC", "cc")
    flags = [*FLAGS, *extra_flags]
    key = _key(library, compiler, flags)
    target = os.path.join(cache_root(), "kernels", f"{library}-{key}.so")
    failed = target[: -len(".so")] + ".failed"
    if os.path.exists(target):
        return _record(BuildStatus(library, extra_flags, "cached", target))
    if shutil.which(compiler) is None:
        return _record(BuildStatus(library, extra_flags, "no compiler", None, f"no C compiler {compiler!r} found"))
    if os.path.exists(failed):
        with open(failed, errors="replace") as f:
            return _record(BuildStatus(library, extra_flags, "failed", failed, f.read()))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(dir=os.path.dirname(target), prefix=f".{library}-") as work:
        tmp = os.path.join(work, os.path.basename(target))
        try:
            _compile_and_link(compiler, flags, _sources(library), work, tmp)
            os.replace(tmp, target)
        except _CompileError as e:
            with open(failed, "w") as f:
                f.write(str(e))
            return _record(BuildStatus(library, extra_flags, "failed", failed, str(e)))
    return _record(BuildStatus(library, extra_flags, "built", target, seconds=time.monotonic() - start))


class _CompileError(Exception):
    """A compiler or linker run that failed; its text is the command, the error and the compiler's output."""


def _run(command: list[str]) -> None:
    try:
        subprocess.run(command, check=True, capture_output=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        stderr = (getattr(e, "stderr", None) or b"").decode(errors="replace")[-4000:]
        raise _CompileError(f"{' '.join(command)}\n{e}\n{stderr}") from e


def _compile_and_link(compiler: str, flags: list[str], sources: list[str], work: str, output: str) -> None:
    """Each source compiled to an object at the same time (one compiler process each: a library's first build
    takes as long as its slowest file, not their sum), then the objects linked into ``output``."""
    objects = [os.path.join(work, f"{i}.o") for i in range(len(sources))]
    with ThreadPoolExecutor(len(sources)) as pool:
        for done in [pool.submit(_run, [compiler, *flags, "-c", source, "-o", obj])
                     for source, obj in zip(sources, objects)]:
            done.result()
    _run([compiler, *flags, *objects, "-o", output, "-lm"])


def build_all(builds: list[tuple[str, tuple[str, ...]]]) -> None:
    """Builds (or finds cached) each ``(library, extra_flags)`` at the same time, one thread each: the compilers
    run in parallel, so an empty cache fills in about the time of its slowest library."""
    with ThreadPoolExecutor(max(1, len(builds))) as pool:
        for done in [pool.submit(build, library, flags) for library, flags in builds]:
            done.result()


def _record(status: BuildStatus) -> str | None:
    """Keeps the status; logs (once per library and flags in this process) or raises for a library that is not
    there, and returns the library's path when it is."""
    key = (status.library, status.extra_flags)
    first = key not in STATUS
    if first or not (status.state == "cached" and STATUS[key].state == "built"):  # built here stays "built"
        STATUS[key] = status
    if status.state in ("built", "cached"):
        return status.path
    reason = status.detail if status.state == "no compiler" else f"its build failed:\n{status.detail}"
    if mode() == "require":
        raise NativeKernelError(f"native {status.library} kernels required (PAGEDLLM_NATIVE_KERNELS=require) but "
                                f"{reason}" + (f"\n(remembered in {status.path})" if status.path else ""))
    if first:
        retry = f"; delete {status.path} to retry" if status.path else ""
        logger.warning("Native %s kernels off, their callers use the torch path: %s%s", status.library, reason,
                       retry)
    return None


def load(library: str, signatures, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library built and loaded, each of ``signatures`` (CFunction) declared on it; None where it is off or
    cannot be built."""
    if mode() == "0":
        STATUS[library, extra_flags] = BuildStatus(library, extra_flags, "disabled")
        return None
    path = build(library, extra_flags)
    if path is None:
        return None
    lib = ctypes.CDLL(path)
    for signature in signatures:
        signature.declare(lib)
    return lib
