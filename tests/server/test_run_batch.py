"""`pagedllm run-batch`: a batch file's results equal the server's answers to the same requests, in input order,
with an error record for each bad line; the files may be http(s) URLs (GET in, PUT out) and the flags may come from
a --config file."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from pagedllm.entrypoints.openai.run_batch import read_file, run_request, write_file
from pagedllm.models.resolve import DEFAULT_MODEL
from tests.server.conftest import SERVER_ARGS

BAD_LINES = {7: '{"custom_id": "broken", "method": "POST", "url": ',  # not JSON
             30: json.dumps({"custom_id": "no-messages", "method": "POST", "url": "/v1/chat/completions",
                             "body": {"model": DEFAULT_MODEL, "max_tokens": 4}})}


def batch_requests(count: int) -> list[dict]:
    """Greedy chat and completion requests, alternating, each with its own prompt (the first chat's holds a line
    separator, U+2028, which JSON may carry unescaped: it does not end the batch file's line)."""
    requests = []
    for i in range(count):
        if i % 2:
            content = f"Name a colour,{chr(0x2028) if i == 1 else ' '}{i}."
            url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": content}]}
        else:
            url, body = "/v1/completions", {"prompt": f"The number {i} is"}
        requests.append({"custom_id": f"request-{i}", "method": "POST", "url": url,
                         "body": {**body, "model": DEFAULT_MODEL, "temperature": 0, "max_tokens": 6}})
    return requests


@pytest.mark.parametrize("line, message", [
    ("{not json", "JSON decode error"),
    (json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {}}), "url '/v1/embeddings'"),
    (json.dumps({"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}), "method"),
    (json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": 1.5}}), "prompt"),
])
def test_bad_line_is_an_error_record(line, message):
    output = asyncio.run(run_request(None, line))  # refused before any serving class is reached
    assert output.error is not None and message in output.error.message and output.error.code == 400
    assert output.custom_id == (None if line.startswith("{not") else "a")
    assert (output.response is not None) == (output.error.param == "prompt")  # the endpoint refused the body


class _FileHandler(BaseHTTPRequestHandler):
    """GET answers a stored file (404 if none), PUT stores one: server.files maps a path to its bytes."""

    def do_GET(self) -> None:
        body = self.server.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self) -> None:
        self.server.files[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(201)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def file_server():
    """A local HTTP file server (http.server): its base URL, and its files by path."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _FileHandler)
    httpd.files = {}
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", httpd.files
    httpd.shutdown()
    httpd.server_close()


def test_files_are_paths_or_urls(file_server, tmp_path):
    url, files = file_server
    asyncio.run(write_file(f"{url}/out.jsonl", "a\n"))
    asyncio.run(write_file(str(tmp_path / "out.jsonl"), "b\n"))
    assert files == {"/out.jsonl": b"a\n"} and (tmp_path / "out.jsonl").read_text() == "b\n"
    assert asyncio.run(read_file(f"{url}/out.jsonl")) == "a\n"
    assert asyncio.run(read_file(str(tmp_path / "out.jsonl"))) == "b\n"
    with pytest.raises(httpx.HTTPStatusError, match="404"):
        asyncio.run(read_file(f"{url}/missing.jsonl"))


def test_run_batch_equals_server(server, tmp_path, file_server):
    """The input by GET, the output by PUT to a URL the --config file gives, with the engine flags."""
    url, files = file_server
    requests = batch_requests(48)
    lines = [json.dumps(r, ensure_ascii=False) for r in requests]
    for index, line in sorted(BAD_LINES.items()):
        lines.insert(index, line)
    assert len(lines) == 50
    files["/in.jsonl"] = ("\n".join(lines) + "\n").encode()
    config = tmp_path / "batch.yaml"
    config.write_text("".join(f"{flag.lstrip('-')}: {value}\n" for flag, value in zip(SERVER_ARGS[::2],
                                                                                      SERVER_ARGS[1::2]))
                      + f"output-file: {url}/out.jsonl\n")
    batch = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "run-batch", "-i", f"{url}/in.jsonl",
                            "--config", str(config)], capture_output=True, text=True, timeout=300)
    assert batch.returncode == 0, batch.stderr
    assert "Running batch" in batch.stderr  # the progress bar
    outputs = [json.loads(line) for line in files["/out.jsonl"].decode().splitlines()]
    assert len(outputs) == 50

    errors = [outputs.pop(index) for index in sorted(BAD_LINES, reverse=True)][::-1]
    assert errors[0]["custom_id"] is None and errors[0]["response"] is None
    assert errors[1]["custom_id"] == "no-messages" and errors[1]["response"]["status_code"] == 400
    assert errors[1]["error"]["param"] == "messages" and errors[1]["response"]["body"] is None

    with server.http() as http, ThreadPoolExecutor(8) as pool:
        expected = list(pool.map(lambda r: http.post(r["url"], json=r["body"]).json(), requests))
    for request, output, answer in zip(requests, outputs, expected):
        assert output["custom_id"] == request["custom_id"] and output["error"] is None
        assert output["response"]["status_code"] == 200
        body = output["response"]["body"]
        assert body["object"] == answer["object"] and body["model"] == answer["model"]
        assert body["choices"] == answer["choices"] and body["usage"] == answer["usage"]
