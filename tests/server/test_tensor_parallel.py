"""`pagedllm serve -tp 3` (three worker processes behind the engine) answers the openai client as one rank does,
and a worker killed mid-stream ends every request with an error naming the rank within seconds, leaving no
worker process and no shared-memory segment behind."""
from __future__ import annotations

import time
from itertools import islice

import psutil

from tests.e2e.parallel_helpers import command_line, shm_segments, wait_until
from tests.server.conftest import RemoteServer
from tests.server.test_lifecycle import KEEP_ALIVE, LONG_STREAM, sse_events

PROMPTS = ["The capital of France is", "def fibonacci(n):", "A short poem about the sea:\n"]


def completions(server: RemoteServer) -> list[str]:
    """The greedy completions of PROMPTS, asked for in one request (one batch: a tp=3 step is slow on 2 cores)."""
    client = server.get_client()
    response = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPTS, max_tokens=24,
                                         temperature=0)
    return [choice.text for choice in sorted(response.choices, key=lambda c: c.index)]


def test_serve_tp3_matches_one_rank_then_survives_no_dead_rank(server, tmp_path):
    before = shm_segments()
    tp_server = RemoteServer(tmp_path / "server.log", extra_args=["-tp", "3"], env=KEEP_ALIVE)  # /health 503 then
    try:
        workers = [p for p in psutil.Process(tp_server.proc.pid).children(recursive=True)
                   if "pagedllm.executor.worker_proc" in command_line(p)]
        assert len(workers) == 3
        assert completions(tp_server) == completions(server)

        with tp_server.http(timeout=10) as http, http.stream("POST", "/v1/completions", json=LONG_STREAM) as stream:
            events = sse_events(stream)
            assert len(list(islice(events, 2))) == 2
            next(w for w in workers if command_line(w)[-1] == "2").kill()
            start = time.monotonic()
            rest = list(events)  # the read timeout (10 s) fails the test rather than hanging
            assert time.monotonic() - start < 10
            assert rest[-1] == "[DONE]"
            assert rest[-2]["error"]["code"] == 503
            assert "worker rank 2" in rest[-2]["error"]["message"]
            assert http.get("/health").status_code == 503
        assert wait_until(lambda: not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers),
                          10), "workers outlived their engine"
        assert shm_segments() <= before
    finally:
        tp_server.stop()
