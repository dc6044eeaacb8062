"""`pagedllm bench serve`: streaming /v1/completions load at fixed concurrencies (or a Poisson request rate).

Reports time to first token and inter-token latency (p50/p90/p99) and output tokens/s for each concurrency.
Token-id prompts from the shared workload recipe, greedy, ignore_eos, exact output lengths. Each concurrency gets
prompts of its own, so that no level is served from the prefix cache another one filled.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import httpx
import numpy as np

from pagedllm.benchmarks.workloads import random_workload


def serve_prompts(count: int, input_len: int, level_index: int) -> list[list[int]]:
    """Prompts for one load level, drawn apart from every other level's and from W1-W3's."""
    return random_workload("serve", count, input_len, 0, seed_key=100 + level_index).prompts


def add_serve_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--api-key")
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated fixed concurrencies")
    parser.add_argument("--request-rate", type=float, help="Poisson arrivals per second instead of concurrency")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)


async def _sse_data(response: httpx.Response):
    """The data payloads of an SSE stream, "[DONE]" left out. Lines end at "\n" only: httpx's aiter_lines also
    splits at U+2028, U+0085 and the like, which a server's JSON may carry unescaped inside generated text."""
    buffer = ""
    async for text in response.aiter_text():
        *lines, buffer = (buffer + text).split("\n")
        for line in lines:
            line = line.rstrip("\r")
            if line.startswith("data: ") and line != "data: [DONE]":
                yield line[len("data: "):]


async def _one_request(client: httpx.AsyncClient, args, prompt: list[int]) -> dict:
    body = {"model": args.model, "prompt": prompt, "max_tokens": args.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    token_times, output_tokens = [], None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for data in _sse_data(response):
            chunk = json.loads(data)
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                token_times.append(time.perf_counter())
            if chunk.get("usage"):
                output_tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    if output_tokens != args.output_len:
        raise RuntimeError(f"the server returned {output_tokens} tokens for max_tokens={args.output_len} "
                           "with ignore_eos (or reported no usage)")
    ttft = token_times[0] - start if token_times else float("nan")
    return {"ttft": ttft, "itl": list(np.diff(token_times)), "latency": end - start, "output_tokens": output_tokens}


async def run_level(args, prompts: list[list[int]], concurrency: int | None) -> dict:
    """Streams every prompt, at most `concurrency` at once (all at once at args.request_rate, or when None)."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=(concurrency or len(prompts)) + 4)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=600, limits=limits) as client:
        semaphore = asyncio.Semaphore(concurrency or len(prompts))

        async def limited(prompt):
            async with semaphore:
                return await _one_request(client, args, prompt)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if args.request_rate:
                await asyncio.sleep(random.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    ttfts = [r["ttft"] for r in results]
    itls = [x for r in results for x in r["itl"]]

    def pct(values, q):
        return float(np.percentile(values, q)) * 1000 if values else float("nan")

    return {"concurrency": concurrency, "request_rate": args.request_rate, "num_requests": len(results),
            "wall_s": wall, "output_tok_s": sum(r["output_tokens"] for r in results) / wall,
            **{f"ttft_p{q}_ms": pct(ttfts, q) for q in (50, 90, 99)},
            **{f"itl_p{q}_ms": pct(itls, q) for q in (50, 90, 99)}}


def run_serve_bench(args: argparse.Namespace) -> dict:
    levels = [None] if args.request_rate else [int(c) for c in args.concurrency.split(",")]
    rows = []
    for index, level in enumerate(levels):
        count = args.num_prompts if level is None else max(args.num_prompts, level)
        prompts = serve_prompts(count, args.input_len, index)
        rows.append(asyncio.run(run_level(args, prompts, level)))
    print(f"{'concurrency':>11}{'requests':>9}{'out tok/s':>11}{'TTFT p50':>10}{'p90':>8}{'p99':>8}"
          f"{'ITL p50':>9}{'p90':>8}{'p99':>8}  (ms)")
    for r in rows:
        print(f"{str(r['concurrency'] or 'rate'):>11}{r['num_requests']:>9}{r['output_tok_s']:>11.1f}"
              f"{r['ttft_p50_ms']:>10.1f}{r['ttft_p90_ms']:>8.1f}{r['ttft_p99_ms']:>8.1f}"
              f"{r['itl_p50_ms']:>9.1f}{r['itl_p90_ms']:>8.1f}{r['itl_p99_ms']:>8.1f}")
    return {"results": rows, "args": vars(args)}
