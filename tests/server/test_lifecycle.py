"""The server's processes: the EngineCore child, what happens when it dies, SIGTERM, and `pagedllm chat`."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from itertools import islice
from typing import Iterator, Union

import httpx
import psutil
import pytest

from tests.e2e.parallel_helpers import command_line, wait_until
from tests.server.conftest import SERVER_ARGS, RemoteServer

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
    # forked by the fork server the server started before it had its config (launch.py), titled as `python -m`
    fork_server = server.engine.parent()
    assert fork_server.ppid() == api_server.pid and "pagedllm.forkserver" in command_line(fork_server)
    assert server.engine.is_running()
    assert command_line(server.engine)[-4:-1] == ["-m", "pagedllm.engine.core_proc", "EngineCore"]


KEEP_ALIVE = {"PAGEDLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "1"}


def test_engine_death_fails_requests_then_the_server_exits(fresh_server):
    """As vLLM's: requests in flight when the engine dies end with a 503 (streamed: a last error event), then the
    server exits by itself, leaving no child (the fixture checks), so that a supervisor restarts it. It stayed up,
    answering 503 to everything for ever."""
    with fresh_server.http(timeout=10) as http:
        rest, full = _engine_killed_mid_requests(fresh_server, http)
    assert rest[-2]["error"]["code"] == 503 and rest[-1] == "[DONE]"
    assert full.status_code == 503
    fresh_server.proc.wait(30)


def _engine_killed_mid_requests(server: RemoteServer, http: httpx.Client) -> tuple[list, httpx.Response]:
    """Kills ``server``'s engine while a stream (two events in) and an unstreamed request run: the stream's events
    after the kill, which end within 10 s of it, and the unstreamed request's response. The read timeout (10 s)
    fails a test rather than hanging."""
    with ThreadPoolExecutor(1) as pool:
        full = pool.submit(http.post, "/v1/completions", json={**LONG_STREAM, "stream": False})
        with http.stream("POST", "/v1/completions", json=LONG_STREAM) as stream:
            events = sse_events(stream)
            assert len(list(islice(events, 2))) == 2
            server.engine.kill()
            start = time.monotonic()
            rest = list(events)
        assert time.monotonic() - start < 10
        return rest, full.result()


@pytest.mark.parametrize("fresh_server", [KEEP_ALIVE], indirect=True)
def test_engine_death_fails_requests_and_health(fresh_server):
    with fresh_server.http(timeout=10) as http:
        rest, full = _engine_killed_mid_requests(fresh_server, http)
        assert rest[-1] == "[DONE]"
        assert rest[-2]["error"]["code"] == 503 and rest[-2]["error"]["type"] == "ServiceUnavailableError"
        assert full.status_code == 503
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


def test_sigterm_while_the_engine_starts_stops_it_and_leaves_no_file(tmp_path):
    """As vLLM's server: SIGTERM before the server listens (the engine loading its model) unwinds the start-up, which
    stops the engine and removes its IPC directory; SIGTERM's default action ended the server at once, leaving the
    directory (and, for a second, the engine)."""
    tmp = tmp_path / "tmp"  # the server's temporary directory: where the engine's IPC directory appears
    tmp.mkdir()
    with open(tmp_path / "server.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", "0",
                                 *SERVER_ARGS], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "TMPDIR": str(tmp)})
    try:
        assert wait_until(lambda: any(tmp.glob("pagedllm-*/config.pkl")), 120), (tmp_path / "server.log").read_text()
        engines = psutil.Process(proc.pid).children(recursive=True)  # the fork server and the engine it forked
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    finally:
        proc.kill()
    _, alive = psutil.wait_procs(engines, timeout=5)
    assert not alive and not list(tmp.iterdir())


def test_chat_cli(server):
    chat = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "chat", "--url", server.url_for("v1"), "--api-key",
         server.api_key, "--max-tokens", "8"],
        input="What is the capital of France?\nAnd of Italy?\nexit\n", capture_output=True, text=True, timeout=120)
    assert chat.returncode == 0, chat.stderr
    answers = [line for line in chat.stdout.splitlines() if line.startswith("> ")]
    assert len(answers) == 3 and all(len(a) > 2 for a in answers[:2]), chat.stdout


SHUTDOWN_TIMEOUT_S = 2


def test_sigterm_drains_then_aborts_within_shutdown_timeout(tmp_path):
    """--shutdown-timeout 2: after SIGTERM new requests are refused, a request in flight with one token to go
    finishes, long ones (streamed or not; 2000 tokens, far beyond 2 s here) end with finish_reason "abort" at the
    timeout, and the server exits leaving no child."""
    # Eager steps: no CPU graph is captured mid-test for a new batch size, so the short request's speed is steady.
    server = RemoteServer(tmp_path / "server.log",
                          extra_args=["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--enforce-eager",
                                      "--max-model-len", "2048"])
    long_body = {**LONG_STREAM, "max_tokens": 2000}
    try:
        with server.http(timeout=60) as http, ThreadPoolExecutor(1) as pool, ExitStack() as streams:
            http.post("/v1/completions", json={**LONG_STREAM, "max_tokens": 3, "stream": False})  # warm-up steps
            full = pool.submit(http.post, "/v1/completions", json={**long_body, "stream": False})
            long_events = sse_events(streams.enter_context(http.stream("POST", "/v1/completions", json=long_body)))
            short_events = sse_events(streams.enter_context(
                http.stream("POST", "/v1/completions", json={**LONG_STREAM, "max_tokens": 3})))
            short_seen = list(islice(short_events, 2))
            assert len(list(islice(long_events, 2))) == 2 and len(short_seen) == 2
            server.proc.send_signal(signal.SIGTERM)
            start = time.monotonic()
            time.sleep(0.5)
            try:
                assert httpx.post(server.url_for("v1", "completions"), json=LONG_STREAM, timeout=5).status_code == 503
            except httpx.TransportError:
                pass  # refused: the listener is closed
            short_seen += list(short_events)
            assert short_seen[-1] == "[DONE]" and short_seen[-2]["choices"][0]["finish_reason"] == "length"
            long_rest = list(long_events)
            assert long_rest[-1] == "[DONE]" and long_rest[-2]["choices"][0]["finish_reason"] == "abort"
            full_choice = full.result().json()["choices"][0]
            assert full_choice["finish_reason"] == "abort" and full_choice["text"]
            assert SHUTDOWN_TIMEOUT_S - 0.5 < time.monotonic() - start < SHUTDOWN_TIMEOUT_S + 20
        server.proc.wait(30)
        _, alive = psutil.wait_procs(server.engines, timeout=5)
        assert not alive
    finally:
        server.stop()
