"""llama.cpp runner for benchmarks/compare.py, through llama-cpp-python; runs with the llama.cpp venv's python
(benchmarks/setup_llama_cpp.sh), which has no pagedllm.

``--model`` is a GGUF file (compare.py passes the one pagedllm loads), run as it is: its own quantized weights and
llama.cpp's own kernels, all CPUs for prompt and decode, flash attention on (llama.cpp's own default, "auto", turns
it on for a CPU; the wrapper's default turns it off). ``--dtype`` does not apply. Tokens come from
``Llama.generate`` (greedy: temp 0, top_k 1, no penalties), which never stops at EOS by itself; each request stops
after exactly ``max_tokens`` tokens, the last one timed as it is yielded.

``Llama`` serves one sequence at a time, so a workload of several requests (W1, W3, W4-8) runs them one after
another: its figures are llama-cpp-python's sequential throughput, not a batched engine's. Its only prefix cache is the
previous request's tokens, whose common prefix with the next request ``generate`` keeps (one slot): every run
starts from an empty cache (``reset``), and with --no-prefix-caching every request does.
"""
from __future__ import annotations

import argparse
import json
import os
import time

from harness import main


class LlamaCppEngine:
    def __init__(self, args: argparse.Namespace) -> None:
        import llama_cpp
        if args.speculative_config:
            raise SystemExit("the llama.cpp runner has no speculative decoding")
        with open(args.workload_file) as f:
            workload = json.load(f)
        n_ctx = max(len(p) for p in workload["prompts"]) + workload["max_tokens"]
        self.llm = llama_cpp.Llama(model_path=args.model, n_ctx=n_ctx, n_threads=os.cpu_count(),
                                   n_threads_batch=os.cpu_count(), flash_attn=True, seed=0, verbose=False)
        self.reuse_prefix = not args.no_prefix_caching
        self.info = {"system_info": llama_cpp.llama_print_system_info().decode().strip(" |\n")}

    def run(self, prompts: list[list[int]], max_tokens: int, stream: bool) -> dict:
        times: list[float] = []
        self.llm.reset()
        start = time.perf_counter()
        for prompt in prompts:
            if not self.reuse_prefix:
                self.llm.reset()
            num_tokens = 0
            for _ in self.llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
                times.append(time.perf_counter())
                num_tokens += 1
                if num_tokens == max_tokens:
                    break
            if num_tokens != max_tokens:
                raise RuntimeError(f"{num_tokens} output tokens, expected {max_tokens}")
        wall_s = times[-1] - start
        return {"wall_s": wall_s, "ttft_s": times[0] - start} if stream else {"wall_s": wall_s}


if __name__ == "__main__":
    main(LlamaCppEngine, "llama-cpp-python")
