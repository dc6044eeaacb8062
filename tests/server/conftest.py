"""The API server as a subprocess (`pagedllm serve`), as users run it: one shared by the module's tests, and
fresh ones for tests that kill or stop it.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.models.hf_config import load_tokenizer
from pagedllm.models.resolve import DEFAULT_MODEL, resolve_model

MAX_MODEL_LEN = 1024
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "256MiB"]
API_KEY = "test-key"
STARTUP_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """`pagedllm serve` on a free loopback port; ready once /health answers 200."""

    def __init__(self, log_path: Path, extra_args: Optional[list[str]] = None, api_key: Optional[str] = None,
                 env: Optional[dict[str, str]] = None, url_root: Optional[str] = None,
                 client_options: Optional[dict] = None) -> None:
        """url_root and client_options (httpx.Client's: a transport over a Unix socket, TLS verification) say
        how to reach a server the extra_args move off plain HTTP on the port."""
        self.port = free_port()
        self.api_key = api_key
        self.log_path = log_path
        self.client_options = client_options or {}
        args = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(self.port), *SERVER_ARGS,
                *(extra_args or []), *(["--api-key", api_key] if api_key else [])]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        self.url_root = url_root or f"http://127.0.0.1:{self.port}"
        self._wait_until_healthy()
        self.engines = self.engine_processes()  # one per data-parallel engine
        self.engine = self.engines[0]

    def _wait_until_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"The server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with self.http(timeout=1) as http:
                    if http.get("/health").status_code == 200:
                        return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"The server was not healthy within {STARTUP_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def url_for(self, *parts: str) -> str:
        return "/".join([self.url_root, *parts])

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def http(self, timeout: float = 60) -> httpx.Client:
        return httpx.Client(base_url=self.url_root, headers=self.headers, timeout=timeout, **self.client_options)

    def get_client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.api_key or "EMPTY", max_retries=0, **kwargs)

    def get_async_client(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.api_key or "EMPTY", max_retries=0,
                                  **kwargs)

    def engine_processes(self) -> list[psutil.Process]:
        children = [p for p in psutil.Process(self.proc.pid).children(recursive=True)
                    if "EngineCore" in " ".join(p.cmdline())]
        assert children
        return children

    def metrics(self) -> dict[str, float]:
        """Sample name (with its labels other than model_name and engine) -> value summed over the engines; and
        with the engine label too, each engine's own."""
        text = httpx.get(self.url_for("metrics"), timeout=10).text
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                for skip in (("model_name", "engine"), ("model_name",)):
                    labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k not in skip)
                    key = f"{sample.name}{{{labels}}}" if labels else sample.name
                    values[key] = values.get(key, 0.0) + sample.value if "engine" in skip else sample.value
        return values

    def stop(self, timeout: float = 20) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The shared server; /v1 needs the API key (the client helpers send it)."""
    srv = RemoteServer(tmp_path_factory.mktemp("server") / "server.log", api_key=API_KEY)
    yield srv
    srv.stop()


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
GENERATION_CONFIG = {"temperature": 0.0, "max_new_tokens": 6}


@pytest.fixture(scope="session")
def spec_server(tmp_path_factory):
    """`pagedllm serve --speculative-config NGRAM --generation-config DIR` (DIR's generation_config.json holds
    GENERATION_CONFIG), logging stats after every output batch: one server for test_spec_decode_api.py and
    test_generation_config.py instead of one each. The generation config's defaults apply only to the fields a
    request leaves unset, and the speculative decoding tests set every field it has (temperature, max_tokens)."""
    config_dir = tmp_path_factory.mktemp("spec_and_generation_config")
    (config_dir / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    srv = RemoteServer(config_dir / "server.log",
                       extra_args=["--speculative-config", json.dumps(NGRAM), "--generation-config", str(config_dir)],
                       env={"PAGEDLLM_LOG_STATS_INTERVAL": "0"})  # a log line every 0.1 s tick
    srv.config_dir = str(config_dir)
    yield srv
    srv.stop()


@pytest.fixture
def fresh_server(tmp_path, request):
    """A server of the test's own, for tests that kill the engine or stop the server; parametrized indirectly, its
    parameter is the server's environment."""
    srv = RemoteServer(tmp_path / "server.log", env=getattr(request, "param", None))
    yield srv
    srv.stop()
    _, alive = psutil.wait_procs(srv.engines, timeout=5)
    assert not alive, "the engine process outlived its server"


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(resolve_model(DEFAULT_MODEL))
