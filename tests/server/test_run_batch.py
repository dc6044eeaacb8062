"""`pagedllm run-batch`: a batch file's results equal the server's answers to the same requests, in input order,
with an error record for each bad line."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedllm.entrypoints.openai.run_batch import run_request
from pagedllm.models.resolve import DEFAULT_MODEL
from tests.server.conftest import SERVER_ARGS

BAD_LINES = {7: '{"custom_id": "broken", "method": "POST", "url": ',  # not JSON
             30: json.dumps({"custom_id": "no-messages", "method": "POST", "url": "/v1/chat/completions",
                             "body": {"model": DEFAULT_MODEL, "max_tokens": 4}})}


def batch_requests(count: int) -> list[dict]:
    """Greedy chat and completion requests, alternating, each with its own prompt."""
    requests = []
    for i in range(count):
        if i % 2:
            url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"Name a colour, {i}."}]}
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


def test_run_batch_equals_server(server, tmp_path):
    requests = batch_requests(48)
    lines = [json.dumps(r) for r in requests]
    for index, line in sorted(BAD_LINES.items()):
        lines.insert(index, line)
    assert len(lines) == 50
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    batch = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "run-batch", "-i",
                            str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), *SERVER_ARGS],
                           capture_output=True, text=True, timeout=300)
    assert batch.returncode == 0, batch.stderr
    assert "Running batch" in batch.stderr  # the progress bar
    outputs = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
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
