"""What a one-byte KV cache (kv_cache_dtype fp8_e4m3 or int8) costs or buys against the model's own (bf16 where the
CPU has native bf16): one engine per cache dtype in one run, their timed runs taking turns round by round, so the
machine's drift falls on all alike. Prints per round and the medians, each as a ratio to the first dtype's:

- W3: ``pagedllm bench``'s timed run of W3 (32 requests sharing a 1024-token prefix; prefix cache reset first),
  output tokens/s;
- long-context decode: --long-requests requests of --long-context random tokens each generating --long-tokens;
  their prompts stay in the prefix cache from the warm-up, so a run is almost all decode steps over the long
  histories: tokens/s from the moment every request has its first token;
- capacity: the tokens the same --kv-cache-memory holds (the worker's own sizing).

With --kernel, only the decode kernel alone instead: one layer's call over --long-requests x --long-context
positions (SmolLM2's 9 heads over 3 KV heads of 64), ms per call (median of 7 x 30), each cache dtype after the
other, float32 and bf16 as well.

    python benchmarks/bench_kv_cache_dtype.py [--dtypes auto,fp8_e4m3,int8] [--rounds 3] [--kernel]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm import LLM, SamplingParams, native
from pagedllm.sampling_params import RequestOutputKind
from pagedllm.benchmarks.offline import timed_run
from pagedllm.benchmarks.workloads import random_workload, shared_workloads
from pagedllm.config import parse_memory_size
from pagedllm.kv_cache_dtype import kv_cache_torch_dtype, quantize_rows
from pagedllm.worker.worker import kv_cache_bytes_per_block


def decode_rate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    """Output tokens/s of the prompts' requests, counted from the step after which every request has its first."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"long-{i}", {"prompt_token_ids": prompt}, params)
    started, tokens, since = set(), 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            started.add(out.request_id)
            if since is not None:
                tokens += len(out.outputs[0].token_ids)
        if since is None and len(started) == len(prompts):
            since = time.perf_counter()
    return tokens / (time.perf_counter() - since)


def kernel_ms(cache_dtype: torch.dtype, requests: int, context: int, heads=9, kv_heads=3, head_size=64,
              block_size=16) -> float:
    """ms of one paged_decode call over a cache of ``cache_dtype`` (blocks in shuffled order)."""
    generator = torch.Generator().manual_seed(0)
    blocks = requests * context // block_size
    table = torch.randperm(blocks, generator=generator).to(torch.int32).view(requests, -1).contiguous()
    seq_lens = torch.full((requests,), context, dtype=torch.int32)
    q = torch.randn(requests, heads, head_size, generator=generator)
    k, v = (quantize_rows(torch.randn(blocks * block_size, kv_heads, head_size, generator=generator), cache_dtype)
            for _ in range(2))
    out, lse = torch.empty(requests, heads, head_size), torch.empty(requests, heads)
    decode = native.paged_decode(cache_dtype)

    def call():
        decode(q, k, v, table, seq_lens, out, lse, start_pos=0, block_size=block_size, scale=head_size**-0.5)

    call()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(30):
            call()
        times.append((time.perf_counter() - start) / 30 * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="auto,fp8_e4m3,int8", help="kv_cache_dtypes, the first the baseline")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--long-requests", type=int, default=4)
    parser.add_argument("--long-context", type=int, default=4096)
    parser.add_argument("--long-tokens", type=int, default=64)
    parser.add_argument("--kernel", action="store_true", help="time the decode kernel alone")
    args = parser.parse_args()
    dtypes = args.dtypes.split(",")
    if args.kernel:
        for cache_dtype in [torch.float32, torch.bfloat16] + [kv_cache_torch_dtype(d, torch.bfloat16)
                                                               for d in dtypes if d != "auto"]:
            print(f"{cache_dtype}: {kernel_ms(cache_dtype, args.long_requests, args.long_context):.3f} ms a call")
        return
    w3 = shared_workloads()["W3"]
    long = random_workload("long", args.long_requests, args.long_context, args.long_tokens, seed_key=4)
    engines = {d: LLM(kv_cache_dtype=d, kv_cache_memory=args.kv_cache_memory,
                      max_model_len=max(args.long_context + args.long_tokens, 2048)) for d in dtypes}
    for name, llm in engines.items():
        config = llm.llm_engine.config
        tokens = (parse_memory_size(args.kv_cache_memory) // kv_cache_bytes_per_block(config)
                  * config.cache_config.block_size)
        print(f"{name}: model {config.model_config.dtype}, {args.kv_cache_memory} holds {tokens} tokens", flush=True)
        timed_run(llm, w3)
        decode_rate(llm, long.prompts, args.long_tokens)
    w3_rates: dict[str, list[float]] = {d: [] for d in dtypes}
    long_rates: dict[str, list[float]] = {d: [] for d in dtypes}
    for i in range(args.rounds):
        order = dtypes if i % 2 == 0 else dtypes[::-1]
        for name in order:
            w3_rates[name].append(w3.output_tokens / timed_run(engines[name], w3).wall_s)
            long_rates[name].append(decode_rate(engines[name], long.prompts, args.long_tokens))
        print(f"round {i}: " + "; ".join(f"{d} W3 {w3_rates[d][-1]:.1f} tok/s, long {long_rates[d][-1]:.1f} tok/s"
                                          for d in dtypes), flush=True)
    base_w3, base_long = statistics.median(w3_rates[dtypes[0]]), statistics.median(long_rates[dtypes[0]])
    for d in dtypes:
        w3_median, long_median = statistics.median(w3_rates[d]), statistics.median(long_rates[d])
        print(f"{d}: W3 {w3_median:.1f} tok/s ({w3_median / base_w3:.3f}x), {args.long_requests} x "
              f"{args.long_context}-token decode {long_median:.1f} tok/s ({long_median / base_long:.3f}x)")


if __name__ == "__main__":
    main()
