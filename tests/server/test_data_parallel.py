"""`pagedllm serve -dp 2`: two EngineCore processes behind one server. 32 concurrent streams each get the greedy
output one engine gives, both engines take work (per-engine metrics), requests sharing a first prompt block go to
one engine, and when one engine dies /health says so, its in-flight requests fail within seconds while the other
engine keeps serving."""
from __future__ import annotations

import asyncio
import re
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from tests.e2e.parallel_helpers import wait_until
from tests.server.conftest import RemoteServer
from tests.server.test_lifecycle import LONG_STREAM, sse_events

N_STREAMS = 32
IGNORE_EOS = {"ignore_eos": True}  # every stream 16 tokens, so the engines' token counts add up to a known total


async def stream_all(client, model: str, prompts: list[str]) -> list[str]:
    async def one(prompt: str) -> str:
        text = []
        async for chunk in await client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0,
                                                           stream=True, extra_body=IGNORE_EOS):
            text.append(chunk.choices[0].text)
        return "".join(text)
    return await asyncio.gather(*(one(p) for p in prompts))


def cache_config_blocks(remote: RemoteServer) -> dict[str, int]:
    """cache_config_info's num_gpu_blocks label, by engine."""
    matches = (re.match(r"pagedllm:cache_config_info\{.*engine=(\d+),.*num_gpu_blocks=(\d+)", key)
               for key in remote.metrics())
    return {match[1]: int(match[2]) for match in matches if match}


def test_serve_dp2(server, tmp_path):
    dp = RemoteServer(tmp_path / "server.log", extra_args=["-dp", "2"])
    try:
        assert len(dp.engines) == 2
        prompts = [f"Question {i}: what is {i} plus {2 * i}? Answer:" for i in range(N_STREAMS)]
        model = dp.get_client().models.list().data[0].id
        got = asyncio.run(stream_all(dp.get_async_client(), model, prompts))
        reference = server.get_client().completions.create(model=model, prompt=prompts, max_tokens=16,
                                                           temperature=0, extra_body=IGNORE_EOS)
        expected = [choice.text for choice in sorted(reference.choices, key=lambda c: c.index)]
        assert got == expected
        metrics = dp.metrics()
        per_engine = [metrics["pagedllm:generation_tokens_total{engine=%d}" % i] for i in range(2)]
        assert all(tokens > 0 for tokens in per_engine) and sum(per_engine) == N_STREAMS * 16, per_engine
        # vLLM's cache_config_info with data parallelism: a series per engine, its num_gpu_blocks all engines' blocks.
        one_engine = cache_config_blocks(server)["0"]
        assert cache_config_blocks(dp) == {"0": 2 * one_engine, "1": 2 * one_engine}

        # Requests opening with the same long block, one after another: the engine that cached it gets them all.
        shared = "You are a careful assistant who answers in one short sentence. " * 4
        before = dp.metrics()
        client = dp.get_client()
        for i in range(4):
            client.completions.create(model=model, prompt=f"{shared}Name a colour number {i}.", max_tokens=2)
        after = dp.metrics()
        hits = [after["pagedllm:prefix_cache_hits_total{engine=%d}" % i]
                - before["pagedllm:prefix_cache_hits_total{engine=%d}" % i] for i in range(2)]
        assert sorted(hits)[0] == 0 and sorted(hits)[1] >= 3 * 48, hits

        # Engine 1 dies mid-stream: its request fails within 10 s, /health reports it, engine 0 still serves.
        engines = sorted(dp.engines, key=lambda p: p.create_time())

        def long_stream() -> list:
            with dp.http(timeout=10) as client, client.stream("POST", "/v1/completions", json=LONG_STREAM) as stream:
                return list(sse_events(stream))  # the read timeout (10 s) fails the test rather than hanging

        pool = ThreadPoolExecutor(2)
        streams = [pool.submit(long_stream) for _ in range(2)]  # one on each engine (the second sees a busier 0)
        assert wait_until(lambda: all(dp.metrics().get("pagedllm:num_requests_running{engine=%d}" % i, 0) == 1
                                      for i in range(2)), 30)
        engines[1].kill()
        start = time.monotonic()
        done, _ = wait(streams, timeout=10, return_when=FIRST_COMPLETED)
        assert time.monotonic() - start < 10 and len(done) == 1
        events = next(iter(done)).result()
        assert events[-1] == "[DONE]" and "data-parallel engine 1" in events[-2]["error"]["message"]
        with dp.http(timeout=30) as http:
            assert http.get("/health").status_code == 503
            response = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
            assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
        assert dp.metrics()["pagedllm:num_requests_running{engine=1}"] == 0  # the dead engine holds nothing
        assert "data-parallel engine 1" in dp.log() and "the other engines serve on" in dp.log()
        pool.shutdown(wait=False)  # the other stream ends (aborted) when the server stops
    finally:
        dp.stop()
