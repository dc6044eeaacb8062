"""Many concurrent streams, clients that go away mid-request, and the Prometheus metrics that show both."""
from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable

from tests.server.conftest import API_KEY, MAX_MODEL_LEN

N_STREAMS = 64
STREAM_TOKENS = 32
GENERATED = "pagedllm:generation_tokens_total"
FINISHED_BY_LENGTH = "pagedllm:request_success_total{finished_reason=length}"


def wait_for_metrics(server, condition: Callable[[dict], bool], what: str, timeout: float = 5.0) -> dict:
    """The first /metrics sample that meets ``condition``; fails after ``timeout`` seconds (a bound on how soon
    the server must get there, not on how fast the machine is)."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        if condition(metrics):
            return metrics
        assert time.monotonic() < deadline, f"not {what} after {timeout} s: {metrics}"
        time.sleep(0.02)


def wait_until_idle(server, kv_usage: float, timeout: float = 5.0) -> dict:
    """The metrics once no request runs and the KV cache is back to kv_usage."""
    return wait_for_metrics(
        server, lambda m: (m["pagedllm:num_requests_running"] == 0 and m["pagedllm:num_requests_waiting"] == 0
                           and m["pagedllm:kv_cache_usage_perc"] == kv_usage), "idle", timeout)


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
    assert after[GENERATED] - before[GENERATED] == N_STREAMS * STREAM_TOKENS
    assert after[FINISHED_BY_LENGTH] - before[FINISHED_BY_LENGTH] == N_STREAMS
    assert after["pagedllm:time_to_first_token_seconds_count"] >= N_STREAMS
    assert after["pagedllm:e2e_request_latency_seconds_count"] >= N_STREAMS


def test_disconnect_mid_stream_aborts_the_request(server):
    """A client that closes a stream after three events gets its request aborted and its KV blocks freed."""
    wait_until_idle(server, 0.0)
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
    wait_until_idle(server, 0.0)  # the request was aborted, its blocks freed


def test_disconnect_while_waiting_for_a_full_answer_aborts_it(server, tokenizer):
    """A client that closes its connection while a non-streaming request runs gets the request aborted in the
    engine: it stops generating (fewer tokens than max_tokens, no finish by length) and frees its KV blocks.
    Event-based: the connection closes once /metrics shows the request running and generating, so the check
    holds on a machine of any speed (the request asks for all the context it has left, far more than it makes
    while the abort reaches the engine)."""
    before = wait_until_idle(server, 0.0)
    messages = [{"role": "user", "content": "Write a long essay."}]
    max_tokens = MAX_MODEL_LEN - len(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                   tokenize=True, return_dict=False))
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "ignore_eos": True}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port)) as connection:
        connection.sendall(head + body)
        running = wait_for_metrics(server, lambda m: m["pagedllm:num_requests_running"] == 1
                                   and m[GENERATED] > before[GENERATED], "generating")
    after = wait_until_idle(server, 0.0)  # its blocks freed
    assert running[GENERATED] - before[GENERATED] <= after[GENERATED] - before[GENERATED] < max_tokens
    assert after[FINISHED_BY_LENGTH] == before[FINISHED_BY_LENGTH]


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
