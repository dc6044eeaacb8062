"""Offline throughput and single-stream decode speed of pagedllm on the shared benchmark workloads.

W1: 64 requests x (256 prompt + 128 output tokens); W2: 1 request x (32 prompt + 256 output tokens).
Greedy, ignore_eos, exact output lengths; prompts from ../shared/bench/workloads.py (seed 0).
One warm-up run, then the median of --repeats timed runs, the prefix cache reset before each.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from pagedllm import LLM, SamplingParams


def load_workloads(bench_dir: str):
    sys.path.insert(0, bench_dir)
    import workloads  # noqa: E402  (the shared generator, so every engine sees the same token ids)
    return workloads.all_workloads()


def timed_run(llm: LLM, workload) -> tuple[float, float]:
    """(wall seconds, time to first token of the first request) for one run of the workload."""
    params = SamplingParams(temperature=0.0, max_tokens=workload.max_tokens, ignore_eos=True)
    engine = llm.llm_engine
    llm.reset_prefix_cache()
    start = time.perf_counter()
    first_token = None
    for i, prompt in enumerate(workload.prompts):
        engine.add_request(f"bench-{i}", {"prompt_token_ids": prompt}, params)
    finished = 0
    while engine.has_unfinished_requests():
        outputs = engine.engine_core.step()
        if first_token is None and any(o.new_token_ids for o in outputs.outputs):
            first_token = time.perf_counter() - start
        for out in engine.output_processor.process_outputs(outputs.outputs).request_outputs:
            assert len(out.outputs[0].token_ids) == workload.max_tokens
            finished += 1
    assert finished == workload.num_requests
    return time.perf_counter() - start, first_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bench-dir", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "bench"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", default="W1,W2")
    args = parser.parse_args()
    workloads = load_workloads(args.bench_dir)
    llm = LLM(dtype=args.dtype, max_model_len=2048)
    print(f"{'workload':<10}{'wall s':>10}{'out tok/s':>12}{'TTFT ms':>10}{'decode tok/s':>14}")
    for name in args.workloads.split(","):
        workload = workloads[name]
        timed_run(llm, workload)  # warm-up
        runs = [timed_run(llm, workload) for _ in range(args.repeats)]
        wall = statistics.median(r[0] for r in runs)
        ttft = statistics.median(r[1] for r in runs)
        decode = (workload.max_tokens - 1) / (wall - ttft) if workload.num_requests == 1 else float("nan")
        print(f"{name:<10}{wall:>10.2f}{workload.output_tokens / wall:>12.1f}{ttft * 1000:>10.1f}{decode:>14.1f}")


if __name__ == "__main__":
    main()
