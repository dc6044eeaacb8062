"""Micro-benchmark: microseconds per schedule() + update_from_output() step, without a model.

Two shapes: 256 running requests each decoding one token per step, and 64 requests mid-prefill (chunked).
Goal (issue 2): under 1 ms per step at 256 running decode requests.
"""
from __future__ import annotations

import argparse
import time

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_cache_utils import make_block_hasher
from pagedllm.core.request import Request
from pagedllm.core.sched.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.outputs import ModelRunnerOutput


def build(num_reqs: int, prompt_len: int, max_num_batched_tokens: int, max_tokens: int,
          long_prefill_token_threshold: int = 0) -> Scheduler:
    scheduler = Scheduler(
        SchedulerConfig(max_model_len=1 << 20, max_num_seqs=num_reqs, max_num_batched_tokens=max_num_batched_tokens,
                        long_prefill_token_threshold=long_prefill_token_threshold),
        CacheConfig(block_size=16, num_blocks=num_reqs * (prompt_len + max_tokens) // 16 + num_reqs * 2))
    hasher = make_block_hasher(16)
    for i in range(num_reqs):
        prompt = [(i * 7919 + j) % 49000 + 100 for j in range(prompt_len)]
        scheduler.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                      eos_token_id=2, block_hasher=hasher))
    return scheduler


def one_step(scheduler: Scheduler) -> None:
    out = scheduler.schedule()
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        sampled.append([1234] if request.num_computed_tokens >= request.num_tokens else [])
    scheduler.update_from_output(out, ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled))


def bench_decode(num_reqs: int, steps: int) -> float:
    scheduler = build(num_reqs, prompt_len=128, max_num_batched_tokens=1 << 20, max_tokens=steps + 50)
    one_step(scheduler)  # the prefill step
    assert len(scheduler.running) == num_reqs
    start = time.perf_counter()
    for _ in range(steps):
        one_step(scheduler)
    return (time.perf_counter() - start) / steps * 1e6


def bench_prefill(num_reqs: int, steps: int) -> float:
    # Each step gives every request a 32-token chunk of its long prompt.
    scheduler = build(num_reqs, prompt_len=32 * (steps + 2), max_num_batched_tokens=32 * num_reqs, max_tokens=4,
                      long_prefill_token_threshold=32)
    one_step(scheduler)
    start = time.perf_counter()
    for _ in range(steps):
        one_step(scheduler)
    assert len(scheduler.running) == num_reqs
    assert all(r.num_computed_tokens < r.num_tokens for r in scheduler.running)
    return (time.perf_counter() - start) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    decode_us = bench_decode(256, args.steps)
    prefill_us = bench_prefill(64, args.steps)
    print(f"{'shape':<40}{'us/step':>10}")
    print(f"{'256 running, decoding':<40}{decode_us:>10.1f}")
    print(f"{'64 running, mid-prefill (32-token chunks)':<40}{prefill_us:>10.1f}")


if __name__ == "__main__":
    main()
