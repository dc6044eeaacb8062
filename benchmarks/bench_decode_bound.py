"""Single-stream decode (W2) against the bound that reading the weights sets on this machine.

A decode step of one request reads every weight the forward uses once (the linear layers' panels and the LM
head's; an embedding lookup reads one row), so memory bandwidth / bytes read per token is the fastest any engine
can decode one stream. This prints, from one run:

- the memory read bandwidth: the best of --bandwidth-repeats torch sums over --bandwidth-gib GiB of float32 (all
  of torch's threads, as the engine has), measured before and after the engine run, the higher taken;
- the bytes a decode step reads: the weight layouts the engine multiplies one row by (bf16 panels, Q4/Q8 panels,
  W8A8 panels or dense float32; the LM head's few-rows layout where it has one), each storage counted once;
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
from pagedllm.layers.linear import LinearBase
from pagedllm.layers.vocab_embedding import VocabParallelEmbedding
from pagedllm.platforms.cpu import cpu_flags, has_native_bf16

from compare import SHOWN_FLAGS


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


def one_row_layout(name: str, module: torch.nn.Module) -> DenseWeight | QuantizedWeight | None:
    """The weight layout a one-row step multiplies by in ``module`` (None: it multiplies by none)."""
    if isinstance(module, VocabParallelEmbedding):  # an LM head, or an embedding tied to one
        return module._few_rows_projection if module._few_rows_projection is not None else module._projection
    if isinstance(module, LinearBase):
        method = module.quant_method
        layout = getattr(method, "dense", None) or getattr(method, "packed", None)
        if layout is None:
            raise SystemExit(f"{name} runs on a torch fallback path (no native weight layout): its bytes are not "
                             "counted here")
        return layout
    return None


def weight_bytes_per_token(model: torch.nn.Module) -> tuple[int, int]:
    """Bytes of the weight layouts a one-row step multiplies by (a storage two layouts share once), and how many
    layouts there are."""
    seen, total, layouts = set(), 0, 0
    for name, module in model.named_modules():
        layout = one_row_layout(name, module)
        if layout is None:
            continue
        layouts += 1
        stored = layout.panels if layout.panels is not None else layout.data
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
