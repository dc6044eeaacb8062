"""The server's processes: the EngineCore child, what happens when it dies, SIGTERM, and `pagedllm chat`."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from typing import Iterator, Union

import httpx
import psutil

LONG_STREAM = {"prompt": "Count to one thousand:", "max_tokens": 600, "ignore_eos": True, "stream": True}


def sse_events(response: httpx.Response) -> Iterator[Union[dict, str]]:
    """The SSE payloads of a stream as they arrive; "[DONE]" as the string."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            yield payload if payload == "[DONE]" else json.loads(payload)


def test_api_server_and_engine_core_processes(server):
    api_server = psutil.Process(server.proc.pid)
    assert "serve" in api_server.cmdline()
    assert server.engine.ppid() == api_server.pid and server.engine.is_running()


def test_engine_death_fails_requests_and_health(fresh_server):
    with fresh_server.http(timeout=10) as http, ThreadPoolExecutor(1) as pool:
        full = pool.submit(http.post, "/v1/completions", json={**LONG_STREAM, "stream": False})
        with http.stream("POST", "/v1/completions", json=LONG_STREAM) as stream:
            events = sse_events(stream)
            assert len(list(islice(events, 2))) == 2
            fresh_server.engine.kill()
            start = time.monotonic()
            rest = list(events)  # the read timeout (10 s) fails the test rather than hanging
        assert time.monotonic() - start < 10
        assert rest[-1] == "[DONE]"
        assert rest[-2]["error"]["code"] == 503 and rest[-2]["error"]["type"] == "ServiceUnavailableError"
        assert full.result().status_code == 503
        assert http.get("/health").status_code == 503
        response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
        assert response.status_code == 503


def test_sigterm_aborts_in_flight_requests_and_leaves_no_child(fresh_server):
    with fresh_server.http(timeout=30) as http, http.stream("POST", "/v1/completions", json=LONG_STREAM) as stream:
        events = sse_events(stream)
        assert len(list(islice(events, 2))) == 2
        fresh_server.proc.send_signal(signal.SIGTERM)
        rest = list(events)
    assert rest[-1] == "[DONE]"
    assert rest[-2]["choices"][0]["finish_reason"] == "abort"
    fresh_server.proc.wait(30)
    _, alive = psutil.wait_procs([fresh_server.engine], timeout=5)
    assert not alive


def test_chat_cli(server):
    chat = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "chat", "--url", server.url_for("v1"), "--api-key",
         server.api_key, "--max-tokens", "8"],
        input="What is the capital of France?\nAnd of Italy?\nexit\n", capture_output=True, text=True, timeout=120)
    assert chat.returncode == 0, chat.stderr
    answers = [line for line in chat.stdout.splitlines() if line.startswith("> ")]
    assert len(answers) == 3 and all(len(a) > 2 for a in answers[:2]), chat.stdout
