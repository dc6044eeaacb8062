"""pagedllm runner for benchmarks/compare.py: times with pagedllm.benchmarks.offline, as `pagedllm bench` does."""
from __future__ import annotations

import argparse

from harness import main

from pagedllm.benchmarks.offline import timed_run
from pagedllm.benchmarks.workloads import Workload
from pagedllm.entrypoints.llm import LLM


class PagedLLMEngine:
    def __init__(self, args: argparse.Namespace) -> None:
        self.llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=not args.no_prefix_caching,
                       quantization=args.quantization, speculative_config=args.speculative_config)

    def run(self, prompts: list[list[int]], max_tokens: int, stream: bool) -> dict:
        # timed_run resets the prefix cache, checks exact lengths, and ends when the last token arrives.
        result = timed_run(self.llm, Workload("compare", prompts, max_tokens))
        return {"wall_s": result.wall_s, "ttft_s": result.ttft_s}


if __name__ == "__main__":
    main(PagedLLMEngine, "pagedllm")
