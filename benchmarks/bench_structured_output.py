"""Structured-output cost: 32 concurrent JSON-schema requests vs the same 32 requests unconstrained, and the time
to first token when a new schema must be compiled.

The constrained run goes first; the unconstrained run then generates exactly as many tokens per request (ignore_eos,
max_tokens = the constrained output's length), so both runs schedule identical batches and only the grammar work
(compiling, filling and applying bitmasks, advancing matchers) differs. Each figure is the best of --repeats.

    python benchmarks/bench_structured_output.py [--num-requests 32] [--repeats 2]
"""
from __future__ import annotations

import argparse
import os
import time
import uuid

os.environ.setdefault("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")  # time the engine, not the IPC

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.structured_output.params import StructuredOutputsParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 20},
    "pets": {"type": "array", "maxItems": 3, "items": {"enum": ["cat", "dog", "fish"]}}},
    "required": ["name", "age", "city", "pets"]}
SUBJECTS = ["a person", "a friend", "a teacher", "a doctor", "an artist", "a pilot", "a chef", "a farmer"]


def timed(llm: LLM, conversations, params) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    llm = LLM(dtype=args.dtype, max_model_len=1024, max_num_seqs=max(64, args.num_requests))
    conversations = [[{"role": "user", "content": f"Describe {SUBJECTS[i % len(SUBJECTS)]} (#{i}) as JSON."}]
                     for i in range(args.num_requests)]
    constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=128,
                                  structured_outputs=StructuredOutputsParams(json=SCHEMA))
                   for i in range(args.num_requests)]

    # Time to first token: a schema never seen before (compiled on arrival) vs the cached one vs none.
    one = [[{"role": "user", "content": "Describe a person as JSON."}]]
    fresh = dict(SCHEMA, title=uuid.uuid4().hex)  # a new spec: a cache miss
    ttft_new, _ = timed(llm, one, [SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(
        json=fresh))])
    ttft_cached, _ = timed(llm, one, [SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(
        json=fresh))])
    ttft_free, _ = timed(llm, one, [SamplingParams(max_tokens=1)])

    timed(llm, conversations, constrained)  # warm-up; compiles SCHEMA
    best_constrained = best_free = float("inf")
    lengths = None
    for _ in range(args.repeats):
        seconds, outputs = timed(llm, conversations, constrained)
        best_constrained = min(best_constrained, seconds)
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        free = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True)
                for i, n in enumerate(lengths)]
        seconds, _ = timed(llm, conversations, free)
        best_free = min(best_free, seconds)
    num_tokens = sum(lengths)
    print(f"{args.num_requests} concurrent requests, {num_tokens} output tokens in each run (same per request)")
    print(f"| run | wall s | output tok/s |\n|---|---|---|")
    print(f"| unconstrained | {best_free:.2f} | {num_tokens / best_free:.1f} |")
    print(f"| JSON schema (cached) | {best_constrained:.2f} | {num_tokens / best_constrained:.1f} |")
    print(f"constrained / unconstrained throughput: {best_free / best_constrained:.3f}")
    print(f"time to first token (1 request, 1 token): new schema {ttft_new * 1000:.0f} ms, "
          f"cached schema {ttft_cached * 1000:.0f} ms, unconstrained {ttft_free * 1000:.0f} ms")


if __name__ == "__main__":
    main()
