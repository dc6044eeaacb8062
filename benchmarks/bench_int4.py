"""Decode speed of the default model with dense float32 weights vs ``quantization="gguf_int4"``.

Per-step decode time is (time for N output tokens - time for 1) / (N - 1), so prefill is
subtracted out; each figure is the best of ``--repeats`` runs (the box may be shared).

    python benchmarks/bench_int4.py [--threads 1] [--repeats 2] [--batch-output-len 64]

On a busy 2-core box use --threads 1: OpenMP threads that lose their core stall every kernel call.
"""

import argparse
import os
import time

import torch

os.environ.setdefault("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")  # time the model, not the IPC

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.benchmarks.workloads import random_workload  # noqa: E402


def _timed_generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start


def measure(llm: LLM, prompts: list[list[int]], max_tokens: int, repeats: int) -> tuple[float, float]:
    """(Seconds to prefill and sample one token, seconds per decode step) for the whole batch of ``prompts``."""
    _timed_generate(llm, prompts, 2)  # warm-up
    first = min(_timed_generate(llm, prompts, 1) for _ in range(repeats))
    full = min(_timed_generate(llm, prompts, max_tokens) for _ in range(repeats))
    return first, (full - first) / (max_tokens - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--single-output-len", type=int, default=256)
    parser.add_argument("--batch-output-len", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    single = random_workload("single", 1, 32, args.single_output_len, seed_key=2).prompts
    batch = random_workload("batch", 64, 32, args.batch_output_len, seed_key=4).prompts
    for quantization in (None, "gguf_int4"):
        llm = LLM(dtype="float32", quantization=quantization, enable_prefix_caching=False,
                  max_model_len=512, kv_cache_memory="256MiB")
        _, one = measure(llm, single, args.single_output_len, args.repeats)
        prefill, many = measure(llm, batch, args.batch_output_len, args.repeats)
        print(f"{quantization or 'dense float32':>14}: 1 sequence {one * 1e3:6.1f} ms/token ({1 / one:5.1f} tok/s); "
              f"batch 64 {many * 1e3:6.1f} ms/step ({64 / many:6.1f} tok/s); "
              f"prefill 64 x 32 tokens {prefill:5.2f} s", flush=True)
        del llm


if __name__ == "__main__":
    main()
