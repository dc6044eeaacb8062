"""Many concurrent streams, clients that go away mid-request, and the Prometheus metrics that show both."""
from __future__ import annotations

import asyncio
import time

import httpx

N_STREAMS = 64
STREAM_TOKENS = 32


def wait_until_idle(server, kv_usage: float, timeout: float = 5.0) -> dict:
    """The metrics once no request runs and the KV cache is back to kv_usage; fails after timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        idle = (metrics["pagedllm:num_requests_running"] == 0 and metrics["pagedllm:num_requests_waiting"] == 0
                and metrics["pagedllm:kv_cache_usage_perc"] == kv_usage)
        if idle:
            return metrics
        assert time.monotonic() < deadline, f"not idle after {timeout} s: {metrics}"
        time.sleep(0.1)


def test_concurrent_streams_all_complete(server):
    client = server.get_async_client()

    async def one(i: int) -> tuple[int, str, int]:
        stream = await client.completions.create(
            model="smollm2-135m-instruct", prompt=f"Request {i}: tell me a story about the number {i}.",
            max_tokens=STREAM_TOKENS, temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        finish, usage, text = None, None, ""
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.text
                finish = choice.finish_reason or finish
            usage = chunk.usage or usage
        return usage.completion_tokens, finish, len(text)

    async def run_all():
        return await asyncio.gather(*(one(i) for i in range(N_STREAMS)))

    before = server.metrics()
    results = asyncio.run(run_all())
    assert [(tokens, finish) for tokens, finish, _ in results] == [(STREAM_TOKENS, "length")] * N_STREAMS
    assert all(length > 0 for _, _, length in results)
    after = wait_until_idle(server, 0.0)
    assert after["pagedllm:generation_tokens_total"] - before["pagedllm:generation_tokens_total"] == (
        N_STREAMS * STREAM_TOKENS)
    assert after["pagedllm:request_success_total{finished_reason=length}"] - before[
        "pagedllm:request_success_total{finished_reason=length}"] == N_STREAMS
    assert after["pagedllm:time_to_first_token_seconds_count"] >= N_STREAMS
    assert after["pagedllm:e2e_request_latency_seconds_count"] >= N_STREAMS


def test_disconnect_mid_stream_aborts_the_request(server):
    kv_usage = wait_until_idle(server, 0.0)["pagedllm:kv_cache_usage_perc"]
    body = {"prompt": "Count to one thousand:", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        # Held, so that leaving the loop does not close the generator: closing it closes the connection, and
        # the server could abort the request before the metrics below are read.
        lines = response.iter_lines()
        events = 0
        for line in lines:
            events += line.startswith("data: ")
            if events == 3:
                break
        assert events == 3
        assert server.metrics()["pagedllm:num_requests_running"] == 1
    wait_until_idle(server, kv_usage)  # the request was aborted, its blocks freed


def test_disconnect_while_waiting_for_a_full_answer_aborts_it(server):
    kv_usage = wait_until_idle(server, 0.0)["pagedllm:kv_cache_usage_perc"]
    body = {"messages": [{"role": "user", "content": "Write a long essay."}], "max_tokens": 500,
            "ignore_eos": True}
    try:
        with server.http(timeout=2.0) as http:
            http.post("/v1/chat/completions", json=body)
        raise AssertionError("500 tokens arrived within 2 s; the test needs a slower request")
    except httpx.ReadTimeout:
        pass  # the client gave up and closed the connection
    wait_until_idle(server, kv_usage)


def test_prefix_cache_counters(server):
    before = server.metrics()
    client = server.get_client()
    prompt = "A long shared prefix for the cache. " * 8
    for _ in range(2):
        client.completions.create(model="smollm2-135m-instruct", prompt=prompt, max_tokens=1)
    after = server.metrics()
    assert after["pagedllm:prefix_cache_queries_total"] > before["pagedllm:prefix_cache_queries_total"]
    assert after["pagedllm:prefix_cache_hits_total"] >= before["pagedllm:prefix_cache_hits_total"] + 16
    assert after["pagedllm:prompt_tokens_total"] > before["pagedllm:prompt_tokens_total"]
