"""Bad requests get OpenAI-shaped errors (400 naming the field, 404 for an unknown model, 401 without the API
key), and the server keeps serving afterwards."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.conftest import MAX_MODEL_LEN

HI = [{"role": "user", "content": "Hi"}]

BAD_REQUESTS = [
    ("/v1/chat/completions", {"messages": HI, "temperature": -0.5}, "temperature"),
    ("/v1/chat/completions", {"messages": HI, "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"messages": HI, "top_p": 1.01}, "top_p"),
    ("/v1/chat/completions", {"messages": HI, "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": HI, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": HI, "stream": True, "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"temperature": 0}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages[0].role"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "stop": [""]}, "stop"),
    # At most 4 stop strings, as OpenAI's and vLLM's.
    ("/v1/completions", {"prompt": "Hi", "stop": list("abcde")}, "stop"),
    ("/v1/chat/completions", {"messages": HI, "stop": list("abcde")}, "stop"),
    ("/v1/responses", {"input": "Hi", "stop": list("abcde")}, "stop"),
    ("/v1/completions", {"prompt": "Hi", "bad_words": [" "]}, "bad_words"),  # banned nothing, silently
    # null where vLLM's field is not Optional: a completion's n (chat's may be null, read as 1) and bad_words.
    ("/v1/completions", {"prompt": "Hi", "n": None}, "n"),
    ("/v1/completions", {"prompt": "Hi", "bad_words": None}, "bad_words"),
    ("/v1/chat/completions", {"messages": HI, "bad_words": None}, "bad_words"),
    ("/v1/completions", {"prompt": "hello " * MAX_MODEL_LEN}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": -1}, "max_tokens"),
    # More than the context holds, whatever the prompt: vLLM's 400 (not cut to what is left, as one that fits is).
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": MAX_MODEL_LEN + 1}, "max_tokens"),
    ("/v1/chat/completions", {"messages": HI, "max_completion_tokens": 10 ** 6}, "max_completion_tokens"),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 10 ** 6}, "max_output_tokens"),
    ("/v1/completions", {"prompt": [1, 2, 3], "stop_token_ids": [10 ** 6]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [10 ** 9]}, "prompt"),
    ("/v1/completions", {"prompt": ["Hi"] * 1025, "max_tokens": 1}, "prompt"),  # vLLM's 1024 prompts at most
    # Fill-in-the-middle, which vLLM refuses for a model without a FIM renderer rather than ignore the suffix.
    ("/v1/completions", {"prompt": "def f(", "suffix": "    return x\n"}, "suffix"),
    ("/v1/chat/completions", {"messages": HI, "frequency_penalty": 2.5}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"banana": 5}}, "logit_bias"),
    # Checked against the vocabulary by the engine's Processor.
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {str(10 ** 6): 5}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": HI, "allowed_token_ids": [-1]}, "allowed_token_ids"),
    ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "xml"}}, "response_format.type"),
    # vLLM's limits: n at most 16384 (each choice a request of its own), one choice when greedy, temperature in
    # [0, 2], finite numbers, integers that fit the 64 bits the engine's messages carry.
    ("/v1/completions", {"prompt": "Hi", "n": 10 ** 9}, "n"),
    ("/v1/completions", {"prompt": "Hi", "n": 3, "temperature": 0}, "n"),
    ("/v1/completions", {"prompt": "Hi", "temperature": 2.5}, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "temperature": float("nan")}, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "repetition_penalty": float("inf")}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "Hi", "seed": 2 ** 70}, "seed"),
    ("/v1/completions", {"prompt": "Hi", "top_k": 2 ** 70}, "top_k"),
    ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [2 ** 70]}, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": HI, "priority": 2 ** 70}, "priority"),
    ("/tokenize", {}, "prompt"),  # the first member of the request union, not its class, is named
    # Stream-only options, and a prompt that both continues its last message and opens a new one.
    ("/v1/completions", {"prompt": "Hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "Hi", "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": HI, "continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message"),
    ("/tokenize", {"messages": HI, "continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message"),
    # A chat template of the request's own, which vLLM refuses without --trust-request-chat-template.
    ("/v1/chat/completions", {"messages": HI, "chat_template": "{{ messages }}"}, "chat_template"),
    ("/v1/chat/completions", {"messages": HI, "tools": []}, "tools"),
    # vLLM's logprob_token_ids: only with logprobs, at most 128 ids of the vocabulary, no beam search, and something
    # generated for them.
    ("/v1/chat/completions", {"messages": HI, "logprob_token_ids": [5]}, "logprob_token_ids"),
    ("/v1/completions", {"prompt": "Hi", "logprob_token_ids": [5]}, "logprob_token_ids"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 0, "logprob_token_ids": [10 ** 6]}, "logprob_token_ids"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 0, "logprob_token_ids": list(range(129))}, "logprob_token_ids"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 0, "logprob_token_ids": []}, "logprob_token_ids"),
    ("/v1/chat/completions", {"messages": HI, "logprobs": True, "logprob_token_ids": []}, "logprob_token_ids"),
    ("/v1/chat/completions", {"messages": HI, "logprobs": True, "logprob_token_ids": [5], "use_beam_search": True},
     "logprob_token_ids"),
    ("/v1/completions", {"prompt": "Hi", "echo": True, "max_tokens": 0, "logprobs": 0, "logprob_token_ids": [5]},
     "logprob_token_ids"),
    # vLLM's thinking_token_budget: refused rather than ignored by a server without --reasoning-parser, as vLLM's.
    ("/v1/chat/completions", {"messages": HI, "thinking_token_budget": 16}, "thinking_token_budget"),
    ("/v1/completions", {"prompt": "Hi", "thinking_token_budget": True}, "thinking_token_budget"),
]


def post(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    """``body`` as JSON, NaN and Infinity included (as Python's json writes them, and servers' parsers read them)."""
    return http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("path, body, param", BAD_REQUESTS, ids=[f"{p}:{param}" for p, _, param in BAD_REQUESTS])
def test_bad_request_names_the_field(server, path, body, param):
    with server.http() as http:
        response = post(http, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", param, 400)
    assert param.split(".")[0] in error["message"] or "context length" in error["message"]


def test_context_length_messages(server, tokenizer):
    """A prompt that fills the context is a 400, and so is a max_tokens past the context (vLLM 0.32's TokenizeParams);
    a max_tokens past only what the prompt leaves is cut to it (vLLM 0.32's get_max_tokens)."""
    with server.http() as http:
        too_long = http.post("/v1/completions", json={"prompt": "hello " * MAX_MODEL_LEN}).json()["error"]
        too_many = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": MAX_MODEL_LEN + 1}).json()["error"]
        clamped = http.post("/v1/completions", json={"prompt": list(range(100, 100 + MAX_MODEL_LEN - 8)),
                                                     "max_tokens": MAX_MODEL_LEN, "min_tokens": 8}).json()
    num_tokens = len(tokenizer.encode("hello " * MAX_MODEL_LEN))
    assert too_long["message"] == (f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your "
                                   f"prompt contains {num_tokens} input tokens, which exceeds this limit even without "
                                   "any output tokens. Please reduce the length of the input prompt.")
    assert too_many["message"] == (f"max_tokens={MAX_MODEL_LEN + 1} cannot be greater than max_model_len="
                                   f"{MAX_MODEL_LEN}. Please request fewer output tokens.")
    assert clamped["usage"]["completion_tokens"] == 8
    assert clamped["choices"][0]["finish_reason"] == "length"


def test_empty_text_prompt_is_vllms_400(server):
    """An empty text prompt is refused with vLLM's words, whether or not the tokenizer would give it a BOS token."""
    with server.http() as http:
        error = http.post("/v1/completions", json={"prompt": ""}).json()["error"]
    assert (error["message"], error["param"]) == (
        "Either prompt or prompt_embeds must be provided and non-empty.", "prompt")


def test_malformed_json_is_400(server):
    with server.http() as http:
        response = http.post("/v1/chat/completions", content=b'{"messages": [', headers={
            "Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "BadRequestError"


def test_openai_client_raises_bad_request(server):
    client = server.get_client()
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="smollm2-135m-instruct", messages=HI, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="smollm2-135m-instruct", messages=HI, temperature=-1, stream=True)


def test_unknown_model_is_404(server):
    with pytest.raises(openai.NotFoundError) as info:
        server.get_client().chat.completions.create(model="gpt-17", messages=HI, max_tokens=2)
    assert info.value.body["type"] == "NotFoundError"


def test_api_key_is_required_for_v1(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(server.url_for("v1", "completions"), json={"prompt": "Hi"}, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == 401
    assert httpx.get(server.url_for("v1", "models")).status_code == 401
    assert httpx.get(server.url_for("health")).status_code == 200
    assert httpx.get(server.url_for("ping")).status_code == httpx.post(server.url_for("ping")).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url_for("v1"), api_key="wrong", max_retries=0).models.list()


def test_api_key_scheme_is_case_insensitive():
    """HTTP's auth schemes are case-insensitive (RFC 7235), and vLLM reads "bearer" so: the key is what counts, any of
    --api-key's several."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.openai.auth import AuthenticationMiddleware

    app = FastAPI()
    app.get("/v1/models")(lambda: {})
    app.add_middleware(AuthenticationMiddleware, api_keys=["key", "other"])
    with TestClient(app) as client:
        for authorization, status in (("Bearer key", 200), ("bearer key", 200), ("BEARER key", 200),
                                      ("bearer other", 200), ("Basic key", 401), ("bearer wrong", 401), ("key", 401),
                                      ("", 401)):
            assert client.get("/v1/models", headers={"Authorization": authorization}).status_code == status


def test_server_answers_after_bad_requests(server):
    for path, body, _ in BAD_REQUESTS:
        with server.http() as http:
            post(http, path, body)
    reply = server.get_client().chat.completions.create(model="smollm2-135m-instruct", messages=HI, max_tokens=4)
    assert reply.choices[0].message.content
