"""`pagedllm bench serve`'s load generator against a live server: every stream is timed and its length checked."""
from __future__ import annotations

import argparse
import asyncio
import math

import httpx
import pytest

from pagedllm.benchmarks.serve import run_level, serve_prompts


def load_args(server, output_len: int) -> argparse.Namespace:
    return argparse.Namespace(base_url=server.url_root, model="smollm2-135m-instruct", api_key=server.api_key,
                              output_len=output_len, request_rate=None)


def test_each_level_draws_prompts_of_its_own():
    first, second = serve_prompts(3, 16, 0), serve_prompts(3, 16, 1)
    assert all(len(p) == 16 for p in first + second)
    assert not {tuple(p) for p in first} & {tuple(p) for p in second}
    assert serve_prompts(3, 16, 0) == first  # the same for every server measured


def test_a_level_times_every_stream(server):
    result = asyncio.run(run_level(load_args(server, 6), serve_prompts(4, 16, 0), concurrency=2))
    assert result["num_requests"] == 4 and result["concurrency"] == 2
    assert result["output_tok_s"] > 0 and result["wall_s"] > 0
    assert 0 < result["ttft_p50_ms"] <= result["ttft_p99_ms"] < 1000 * result["wall_s"]
    assert 0 < result["itl_p50_ms"] and not math.isnan(result["itl_p99_ms"])


def test_a_failed_request_is_an_error_not_a_figure(server):
    args = load_args(server, 6)
    args.model = "no-such-model"
    with pytest.raises(httpx.HTTPStatusError):
        asyncio.run(run_level(args, serve_prompts(1, 16, 0), concurrency=1))
