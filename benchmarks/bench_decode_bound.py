"""Single-stream decode (W2) against the bound that reading the weights sets on this machine.

A decode step of one request reads every weight the forward uses once (the linear layers' panels and the LM
head's; an embedding lookup reads one row), so memory bandwidth / bytes read per token is the fastest any engine
can decode one stream. This prints, from one run:

- the memory read bandwidth: the best of --bandwidth-repeats torch sums over --bandwidth-gib GiB of float32 (all
  of torch's threads, as the engine has), measured before and after the engine run, the higher taken;
- the bytes a decode step reads: the engine's own weight layouts (bf16 panels, Q4/Q8 panels, W8A8 panels or
  dense float32), each storage counted once;
- W2 decode tok/s (``pagedllm bench``'s timed run: one warm-up, median of --repeats) and its fraction of the
  bound.

The engine runs in this process (PAGEDLLM_ENABLE_MULTIPROCESSING=0) so its weights can be counted; the step loop
is the one `pagedllm bench latency` drives.

    python benchmarks/bench_decode_bound.py [--dtype bfloat16] [--quantization gguf_int4] [--repeats 5]
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from pagedllm import LLM
from pagedllm.benchmarks.offline import bench_workload
from pagedllm.benchmarks.workloads import shared_workloads
from pagedllm.layers.gemm_layout import DenseWeight, QuantizedWeight
from pagedllm.platforms.cpu import cpu_flags, has_native_bf16

SHOWN_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")


def read_bandwidth(gib: float, repeats: int) -> float:
    """Bytes/s of the fastest of ``repeats`` sums over ``gib`` GiB (touched once first, so no page faults count)."""
    data = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    data.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def weight_bytes_per_token(model: torch.nn.Module) -> tuple[int, int]:
    """Bytes of the weight layouts the forward multiplies by (each storage once) and how many layouts there are."""
    seen, total, layouts = set(), 0, 0
    for module in model.modules():
        # A layout hangs off its module (the LM head's) or off the module's quant_method (a linear layer's).
        holders = [module, *(v for v in vars(module).values() if hasattr(v, "__dict__")
                             and not isinstance(v, (torch.nn.Module, torch.Tensor)))]
        for value in (v for holder in holders for v in vars(holder).values()):
            if not isinstance(value, (DenseWeight, QuantizedWeight)):
                continue
            layouts += 1
            stored = value.panels if value.panels is not None else value.data
            if stored.data_ptr() not in seen:
                seen.add(stored.data_ptr())
                total += stored.numel() * stored.element_size()
    return total, layouts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16" if has_native_bf16() else "float32")
    parser.add_argument("--quantization", choices=["gguf", "gguf_int4", "int8"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bandwidth-gib", type=float, default=1.0)
    parser.add_argument("--bandwidth-repeats", type=int, default=10)
    args = parser.parse_args()

    flags = cpu_flags()
    print("CPU flags: " + " ".join(f if f in flags else f"no-{f}" for f in SHOWN_FLAGS)
          + f"; {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}")
    bandwidth = read_bandwidth(args.bandwidth_gib, args.bandwidth_repeats)
    os.environ["PAGEDLLM_ENABLE_MULTIPROCESSING"] = "0"  # the model must live in this process to be counted
    llm = LLM(dtype=args.dtype, quantization=args.quantization, max_model_len=2048)
    model = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.model
    weight_bytes, layouts = weight_bytes_per_token(model)
    result = bench_workload(llm, shared_workloads()["W2"], args.repeats)
    del llm, model
    bandwidth = max(bandwidth, read_bandwidth(args.bandwidth_gib, args.bandwidth_repeats))

    bound = bandwidth / weight_bytes
    print(f"memory read bandwidth {bandwidth / 1e9:.1f} GB/s (best of torch sums over {args.bandwidth_gib:g} GiB)")
    print(f"weights read per decode token {weight_bytes / 1e6:.1f} MB ({layouts} weight layouts; dtype {args.dtype}"
          f", quantization {args.quantization or 'none'})")
    print(f"weights-read bound {bound:.1f} tok/s; W2 decode {result.decode_tok_s:.1f} tok/s "
          f"= {result.decode_tok_s / bound:.0%} of it (TTFT {result.ttft_ms:.1f} ms, median of {args.repeats})")


if __name__ == "__main__":
    main()
