"""vLLM's --reasoning-parser through the server: a thinking model's chat answer comes back with its reasoning in the
message's (or delta's) reasoning field and the rest as content, streamed or not, and usage counts the reasoning's
tokens. The model is a tiny Llama built to think (tests/server/chain_model.py): it answers the chat prompt with
"<think> Let me see</think> Paris is big" and then EOS (chain_model.save_thinking_model)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tests.server.chain_model import MESSAGES, save_thinking_model
from tests.server.conftest import RemoteServer


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("thinking-model")
    save_thinking_model(path, tokenizer)
    srv = RemoteServer(path / "server.log", extra_args=[str(path), "--reasoning-parser", "deepseek_r1"])
    yield srv
    srv.stop()


def chat(server, **extra) -> dict:
    with server.http() as http:
        response = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 16, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def test_the_reasoning_is_split_off_the_content(thinking_server):
    answer = chat(thinking_server)
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": " Paris is big",
                                               "reasoning": " Let me see"}
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == 9  # <think>, 3 words, </think>, 3 words, EOS
    assert answer["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}
    # include_reasoning false drops it; the completions endpoint gives the text as the model wrote it
    assert chat(thinking_server, include_reasoning=False)["choices"][0]["message"] == {
        "role": "assistant", "content": " Paris is big"}
    with thinking_server.http() as http:
        text = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4}).json()["choices"][0]["text"]
    assert "reasoning" not in text


def test_a_thinking_token_budget_ends_the_reasoning(thinking_server):
    """vLLM's thinking_token_budget with --reasoning-parser: after two thoughts </think> is forced where " see" would
    have come, and the model answers as after its own </think>."""
    answer = chat(thinking_server, thinking_token_budget=2)
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": " Paris is big", "reasoning": " Let me"}
    assert answer["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2}
    assert chat(thinking_server, thinking_token_budget=-1)["choices"][0]["message"]["reasoning"] == " Let me see"


def test_a_stream_splits_the_same_and_counts_the_same(thinking_server):
    with thinking_server.http() as http:
        body = http.post("/v1/chat/completions", json={
            "messages": MESSAGES, "max_tokens": 16, "stream": True, "stream_options": {"include_usage": True}}).text
    chunks = [json.loads(line.removeprefix("data: ")) for line in body.splitlines()
              if line.startswith("data: {")]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    reasoning = [d["reasoning"] for d in deltas if "reasoning" in d]
    content = [d["content"] for d in deltas if d.get("content")]
    assert "".join(reasoning) == " Let me see" and "".join(content) == " Paris is big"
    # a delta a token as it is written, or fewer where a reader that fell behind gets its deltas merged (vLLM's
    # RequestOutputCollector): the count depends on the machine's load, the text and the split do not
    assert 1 <= len(reasoning) <= 3
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning" not in d for d in deltas[first_content + 1:])  # a merged delta may hold the end of both
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}


def test_hiding_the_reasoning_hides_the_logprobs_and_token_ids_that_would_show_it(thinking_server):
    """As vLLM's: with include_reasoning false a choice carries no logprobs and no generated token ids (they would
    show the reasoning), streamed or not; the content is the answer's alone."""
    extra = {"logprobs": True, "return_token_ids": True}
    shown = chat(thinking_server, **extra)["choices"][0]
    assert len(shown["token_ids"]) == len(shown["logprobs"]["content"]) == 9
    hidden = chat(thinking_server, include_reasoning=False, **extra)["choices"][0]
    assert (hidden["logprobs"], hidden["token_ids"], hidden["message"]["content"]) == (None, None, " Paris is big")
    with thinking_server.http() as http:
        body = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 16, "stream": True,
                                                       "include_reasoning": False, **extra}).text
    choices = [json.loads(line.removeprefix("data: "))["choices"][0] for line in body.splitlines()
               if line.startswith("data: {")]
    assert [(choice.get("logprobs"), choice.get("token_ids")) for choice in choices] == [(None, None)] * len(choices)
    assert "".join(choice["delta"].get("content") or "" for choice in choices) == " Paris is big"


def test_a_grammar_applies_once_the_reasoning_ends(thinking_server):
    """As vLLM holds a grammar back until the reasoning ends: the model thinks as it would, then answers as the
    grammar says (here it would answer " Paris is big" unconstrained)."""
    answer = chat(thinking_server, response_format={"type": "json_object"}, max_tokens=8)
    message = answer["choices"][0]["message"]
    assert message["reasoning"] == " Let me see" and message["content"].startswith("{")
    assert answer["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}


def test_a_grammar_applies_from_the_first_token_when_the_prompt_ended_the_reasoning(thinking_server):
    """As vLLM's is_reasoning_end of the prompt: a continued message that closed its think block leaves no reasoning
    to wait for, so the grammar constrains the whole answer (held back, it never applied: " Paris is big")."""
    thought = {"role": "assistant", "content": "<think> Let me see</think>"}
    answer = chat(thinking_server, messages=[*MESSAGES, thought], continue_final_message=True,
                  add_generation_prompt=False, response_format={"type": "json_object"}, max_tokens=8)
    message = answer["choices"][0]["message"]
    assert "reasoning" not in message and message["content"].startswith("{")
    assert answer["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_the_responses_api_gives_the_reasoning_as_a_reasoning_item(thinking_server):
    """vLLM's Responses output with a reasoning parser: a reasoning item (reasoning_text), then the message; streamed
    as reasoning_text deltas in an item of its own, closed before the message opens."""
    with thinking_server.http() as http:
        response = http.post("/v1/responses", json={"input": MESSAGES[0]["content"], "max_output_tokens": 16}).json()
        events = [json.loads(line.removeprefix("data: ")) for line in http.post("/v1/responses", json={
            "input": MESSAGES[0]["content"], "max_output_tokens": 16, "stream": True}).text.splitlines()
            if line.startswith("data: ")]
    reasoning, message = response["output"]
    assert (reasoning["type"], reasoning["content"], reasoning["status"]) == (
        "reasoning", [{"type": "reasoning_text", "text": " Let me see"}], "completed")
    assert message["content"][0]["text"] == " Paris is big"
    assert response["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}
    kinds = [event["type"] for event in events]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == " Let me see"
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert [e["item"]["type"] for e in events if e["type"] == "response.output_item.done"] == ["reasoning", "message"]
    assert [(item["type"], item["content"]) for item in events[-1]["response"]["output"]] == [
        (item["type"], item["content"]) for item in response["output"]]


def test_include_reasoning_false_leaves_the_reasoning_item_out(thinking_server):
    """vLLM's include_reasoning on the Responses API: false gives the answer alone, streamed or not."""
    ask = {"input": MESSAGES[0]["content"], "max_output_tokens": 16, "include_reasoning": False}
    with thinking_server.http() as http:
        response = http.post("/v1/responses", json=ask).json()
        events = [json.loads(line.removeprefix("data: ")) for line in http.post(
            "/v1/responses", json={**ask, "stream": True}).text.splitlines() if line.startswith("data: ")]
    assert [(item["type"], item["content"][0]["text"]) for item in response["output"]] == [
        ("message", " Paris is big")]
    assert not [e for e in events if e["type"].startswith("response.reasoning")]
    assert [item["type"] for item in events[-1]["response"]["output"]] == ["message"]


def test_a_responses_output_given_back_as_input_is_taken_with_its_reasoning_item(thinking_server):
    """OpenAI's clients keep a conversation by giving a response's output items back as input: its reasoning item is
    taken (as vLLM takes it), not refused as an unknown item, as its turn's reasoning, which this model's template
    (SmolLM2's) does not write: the prompt is the one previous_response_id continues (where vLLM leaves it out)."""
    with thinking_server.http() as http:
        first = http.post("/v1/responses", json={"input": MESSAGES[0]["content"], "max_output_tokens": 16}).json()
        assert [item["type"] for item in first["output"]] == ["reasoning", "message"]
        turns = [MESSAGES[0], *first["output"], {"role": "user", "content": "And of Spain?"}]
        given_back = http.post("/v1/responses", json={"input": turns, "max_output_tokens": 16})
        continued = http.post("/v1/responses", json={"input": "And of Spain?", "previous_response_id": first["id"],
                                                     "max_output_tokens": 16})
    assert given_back.status_code == 200, given_back.text
    assert given_back.json()["usage"]["input_tokens"] == continued.json()["usage"]["input_tokens"]


def test_an_unknown_reasoning_parser_is_refused_before_the_engine_starts():
    result = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--reasoning-parser", "nope"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--reasoning-parser: invalid choice: 'nope'" in result.stderr
