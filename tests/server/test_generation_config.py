"""`pagedllm serve --generation-config DIR`: the directory's generation_config.json gives the default model (a GGUF
file, which has none of its own) default sampling parameters on both endpoints; a request's own values win."""
from __future__ import annotations

import pytest

DEFAULTS = {"temperature": 0.0, "max_tokens": 6}


@pytest.fixture(scope="module")
def gen_server(spec_server):
    """The server with --generation-config DIR, DIR's generation_config.json {"temperature": 0.0,
    "max_new_tokens": 6} (GENERATION_CONFIG; the server also speculates: tests/server/conftest.py)."""
    return spec_server


def test_the_defaults_are_logged_and_listed(gen_server):
    for endpoint in ("chat", "completion"):
        assert f"Using default {endpoint} sampling params from {gen_server.config_dir}: {DEFAULTS}" in gen_server.log()
    assert gen_server.get_client().models.list().data[0].default_sampling_params == DEFAULTS


def test_chat_samples_with_the_defaults_unless_the_request_says_otherwise(gen_server):
    client = gen_server.get_client()
    messages = [{"role": "user", "content": "Tell me a story."}]
    by_default = client.chat.completions.create(model=None, messages=messages)
    greedy = client.chat.completions.create(model=None, messages=messages, temperature=0.0, max_tokens=6)
    assert by_default.usage.completion_tokens == 6 and by_default.choices[0].finish_reason == "length"
    assert by_default.choices[0].message.content == greedy.choices[0].message.content
    assert client.chat.completions.create(model=None, messages=messages, max_tokens=2).usage.completion_tokens == 2


def test_completions_max_tokens_null_is_sixteen_whatever_the_defaults(gen_server):
    """vLLM 0.32 reads a completion's "max_tokens": null as the field's default, 16 (normalize_null_max_tokens),
    so the generation config's max_tokens (6) does not apply there; a number is taken as given."""
    with gen_server.http() as http:
        body = {"prompt": "Once upon a time", "max_tokens": None, "ignore_eos": True}
        assert http.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 16
        body["max_tokens"] = 3
        assert http.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 3
