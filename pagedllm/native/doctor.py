"""``python -m pagedllm.native`` / ``pagedllm doctor``: the CPU features seen, each kernel library's build (built now,
from cache, failed and why, not for this CPU), and the paths a model of each dtype would take here. Exits 1 when a
library failed to build, so a script (or CI) can ask whether an install has its kernels."""

from __future__ import annotations

import os
import platform
import shutil
import sys

import torch

from pagedllm import native
from pagedllm.native import build

# The CPU features that decide which kernel bodies build (see pagedllm/native/README.md).
FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16")


def _libraries() -> dict[str, str]:
    """Loads every library the engine may use; what each gives this CPU, in words (None where it is not there)."""
    native.prebuild()
    what = {}
    for kv_dtype in (torch.float32, torch.bfloat16):
        library = native.paged_attention(kv_dtype)
        if library is not None:
            what[f"paged_attention ({str(kv_dtype).removeprefix('torch.')} cache)"] = (
                f"decode rows {library.decode_isa}; prefill tiles and cascade prefix "
                + (("yes, bf16 pairs" + (" on AMX tiles" if library.prefill_amx else "") if library.prefill_pairs
                    else "yes") if library.has_prefill
                   else "no (need AVX-512, or AVX2 with FMA)"))
    if native.fused_ops() is not None:
        what["fused_ops"] = "RMSNorm, SiLU * up, rotary, embeddings, KV writes, argmax, MoE"
    if native.lora() is not None:
        what["lora"] = "multi-LoRA shrink and expand (one call per layer)"
    what["gemm"] = ("float32 panels" + ("; Q4/Q8 panels" if native.gemm_q4() is not None else "; no Q4/Q8 panels "
                                        "(need AVX-512, or AVX2 with F16C)")) if native.gemm() is not None else "not for this CPU"
    what["gemm_bf16"] = (("AMX tiles" if native.gemm_bf16_uses_amx() else "AVX512-BF16 vdpbf16ps")
                         if native.gemm_bf16() is not None else "not for this CPU (needs AVX512-BF16)")
    what["gemm_int8"] = ("W8A8" + (" on AMX tiles (8 rows or more)" if native.gemm_int8_uses_amx() else "")
                         if native.gemm_w8a8() is not None else "not for this CPU (needs AVX2 and FMA)")
    return what


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown CPU")
    except OSError:
        return platform.processor() or "unknown CPU"


def report() -> tuple[str, bool]:
    """The report's text, and whether every library that was tried built (or came from the cache)."""
    lines = [f"pagedllm native kernels: {platform.machine()}, {_cpu_model()}",
             f"  CPU features: {' '.join(f if f in build.cpu_flags_line().split() else f'-{f}' for f in FEATURES)}",
             f"  compiler: {os.environ.get('CC', 'cc')} ({shutil.which(os.environ.get('CC', 'cc')) or 'not found'})",
             f"  cache: {os.path.join(build.cache_root(), 'kernels')}",
             f"  PAGEDLLM_NATIVE_KERNELS={build.mode()}"]
    try:
        what = _libraries()
    except build.NativeKernelError as e:
        return "\n".join([*lines, f"  error: {e}"]), False
    ok = True
    lines.append("libraries:")
    for (library, flags), status in sorted(build.STATUS.items()):
        if flags not in ((), ("-DKV_BF16",)):
            continue
        name = library + (" (bf16 cache)" if flags else "")
        state = {"built": f"built ({status.seconds:.1f} s)", "cached": "from cache"}.get(status.state, status.state)
        lines.append(f"  {name:34s} {state}")
        if status.state == "failed":
            ok = False
            lines.extend("      " + line for line in status.detail.strip().splitlines()[-12:])
            lines.append(f"      (remembered in {status.path}; delete it to retry)")
        elif status.state == "no compiler":
            ok = False
    lines.append("what they give this CPU:")
    lines.extend(f"  {name:34s} {text}" for name, text in what.items())
    from pagedllm.platforms.cpu import CpuPlatform, choose_kernels, kernel_paths

    auto = str(CpuPlatform().default_dtype()).removeprefix("torch.")
    lines.append(f"paths for SmolLM2-135M (9 heads of 64 over 3 KV heads), by dtype (dtype=auto is {auto} here):")
    for dtype in (torch.float32, torch.bfloat16):
        paths = kernel_paths(choose_kernels(dtype), 9, 3, 64)
        lines.append(f"  {str(dtype).removeprefix('torch.')}: " + "; ".join(f"{k}: {v}" for k, v in paths.items()))
    return "\n".join(lines), ok


def main() -> int:
    text, ok = report()
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
