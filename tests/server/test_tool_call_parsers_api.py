"""--tool-call-parser mistral through the server: a tiny Llama built to answer with Mistral's
[TOOL_CALLS]get_weather[ARGS]{...} (tests/server/chain_model.py) gives the call, with a 9-character id, as the
message's tool_calls and finish_reason "tool_calls", streamed or not; and the call sent back in the conversation is
taken."""
from __future__ import annotations

import json

import pytest

from tests.server.chain_model import save_chain_model
from tests.server.conftest import RemoteServer

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
ARGUMENTS = '{"city": "Paris"}'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def mistral_server(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("mistral-calls")
    tags = ["[TOOL_CALLS]", "get_weather", "[ARGS]", ARGUMENTS]
    save_chain_model(path, tokenizer, MESSAGES, tags, ["Sure", *tags])
    srv = RemoteServer(path / "server.log", extra_args=[str(path), "--tool-call-parser", "mistral"])
    yield srv
    srv.stop()


def test_a_mistral_call_is_read_out_of_the_answer_streamed_or_not(mistral_server):
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 16}
    with mistral_server.http() as http:
        answer = http.post("/v1/chat/completions", json=body).json()["choices"][0]
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
            chunks = [json.loads(line[len("data: "):]) for line in response.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
    [call] = answer["message"]["tool_calls"]
    assert (call["function"], answer["message"]["content"], answer["finish_reason"]) == (
        {"name": "get_weather", "arguments": ARGUMENTS}, "Sure", "tool_calls")
    assert len(call["id"]) == 9 and call["id"].isalnum()
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    streamed = [call for delta in deltas for call in delta.get("tool_calls") or []]
    assert "".join(delta.get("content") or "" for delta in deltas) == "Sure"
    assert streamed[0]["function"]["name"] == "get_weather" and len(streamed[0]["id"]) == 9
    assert "".join(call["function"].get("arguments") or "" for call in streamed) == ARGUMENTS
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks if chunk["choices"]][-1] == "tool_calls"
    with mistral_server.http() as http:  # the call and its result go back to the model
        followed = http.post("/v1/chat/completions", json={**body, "messages": [
            *MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]})
    assert followed.status_code == 200, followed.text
