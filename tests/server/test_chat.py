"""/v1/chat/completions through the official openai client: streaming equals non-streaming, usage, n, logprobs,
stop strings, seeded sampling."""
from __future__ import annotations

import json

import pytest

from tests.server.conftest import MAX_MODEL_LEN, RemoteServer

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server):
    return server.get_client()


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def stream_text(stream) -> tuple[dict[int, str], dict[int, str], list]:
    """Concatenated content and the finish reason per choice index, and all chunks."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    return texts, finish, chunks


def test_models(client, model):
    models = client.models.list().data
    assert [m.id for m in models] == ["smollm2-135m-instruct"]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_streamed_deltas_equal_the_greedy_answer(client, model, tokenizer):
    full = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=24)
    choice = full.choices[0]
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    prompt_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
    assert full.usage.prompt_tokens == len(prompt_ids)
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    stream = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=24,
                                            stream=True, stream_options={"include_usage": True})
    texts, finish, chunks = stream_text(stream)
    first = chunks[0].choices[0].delta
    assert (first.role, first.content) == ("assistant", "")
    assert texts == {0: choice.message.content}
    assert finish == {0: choice.finish_reason}
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_usage_counts_every_generated_token(client, model):
    full = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=7,
                                          extra_body={"ignore_eos": True}, logprobs=True)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 7 == len(full.choices[0].logprobs.content)


def test_n_choices(client, model):
    full = client.chat.completions.create(model=model, messages=MESSAGES, n=2, max_tokens=8, seed=3,
                                          temperature=1.0)
    assert [c.index for c in full.choices] == [0, 1]
    stream = client.chat.completions.create(model=model, messages=MESSAGES, n=2, max_tokens=8, seed=3,
                                            temperature=1.0, stream=True, stream_options={"include_usage": True})
    texts, finish, chunks = stream_text(stream)
    assert texts == {c.index: c.message.content for c in full.choices}
    assert set(finish) == {0, 1}
    assert chunks[-1].usage == full.usage


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", {"messages": MESSAGES}),
                                        ("/v1/completions", {"prompt": "The capital of France is"})])
def test_only_the_usage_chunk_has_a_usage_key(server, path, body):
    """As vLLM's (chunks sent with exclude_unset): with include_usage the last chunk carries the usage and no other
    chunk has a "usage" key, not even a null one; without it, none has."""
    def chunks(**extra) -> list[dict]:
        with server.http() as http, http.stream("POST", path, json={
                **body, "max_tokens": 3, "ignore_eos": True, "stream": True, **extra}) as response:
            return [json.loads(line[len("data: "):]) for line in response.iter_lines()
                    if line.startswith("data: ") and line != "data: [DONE]"]
    with_usage = chunks(stream_options={"include_usage": True})
    assert with_usage[-1]["usage"]["completion_tokens"] == 3 and with_usage[-1]["choices"] == []
    assert len(with_usage) > 2 and not any("usage" in chunk for chunk in with_usage[:-1])
    assert not any("usage" in chunk for chunk in chunks())


def test_continuous_usage_stats_count_each_choice(client, model):
    """With stream_options.continuous_usage_stats every chunk carries its choice's usage so far (vLLM's); the last
    chunk the request's."""
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, n=2, max_tokens=5, seed=3, temperature=1.0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True})
    _, _, chunks = stream_text(stream)
    per_choice: dict[int, list[int]] = {}
    for chunk in chunks[:-1]:
        per_choice.setdefault(chunk.choices[0].index, []).append(chunk.usage.completion_tokens)
    assert all(counts[0] == 0 and counts == sorted(counts) and counts[-1] == 5 for counts in per_choice.values())
    assert set(per_choice) == {0, 1} and chunks[-1].usage.completion_tokens == 10


def test_top_logprobs_0_needs_no_logprobs(client, model):
    """As vLLM: only a top_logprobs that asks for some needs logprobs on."""
    full = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, top_logprobs=0)
    assert full.choices[0].logprobs is None


def test_a_count_of_logprobs_given_as_text_is_refused(server):
    """As vLLM's check_logprobs: top_logprobs and prompt_logprobs (completions' logprobs too) are JSON numbers; "2"
    is a 400 naming the field, not read as 2."""
    requests = [("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": "2"}, "top_logprobs"),
                ("/v1/chat/completions", {"messages": MESSAGES, "prompt_logprobs": "1"}, "prompt_logprobs"),
                ("/v1/completions", {"prompt": "Hi", "logprobs": "2"}, "logprobs")]
    with server.http() as http:
        for path, body, param in requests:
            response = http.post(path, json={**body, "max_tokens": 1})
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == param


def test_logprobs(client, model):
    full = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=6,
                                          logprobs=True, top_logprobs=3)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens
    assert "".join(c.token for c in content) == full.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        top = [t.logprob for t in entry.top_logprobs]
        assert top == sorted(top, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.logprob == pytest.approx(top[0])
        assert bytes(entry.bytes).decode() == entry.token


def test_logprob_token_ids_list_the_chosen_token_then_those_ids(client, model):
    """vLLM's logprob_token_ids: each token's top_logprobs are the chosen token and the ids asked for, in their order,
    with the logprobs the model gives them (here checked against its top 5 at the first token)."""
    ask = dict(model=model, messages=MESSAGES, temperature=0, max_tokens=3, logprobs=True)
    as_ids = {"return_tokens_as_token_ids": True}
    top = client.chat.completions.create(**ask, top_logprobs=5, extra_body=as_ids).choices[0].logprobs.content
    ranked = [int(t.token.removeprefix("token_id:")) for t in top[0].top_logprobs]
    ids = [ranked[3], ranked[1], 40000]
    full = client.chat.completions.create(**ask, extra_body={**as_ids, "logprob_token_ids": ids})
    content = full.choices[0].logprobs.content
    assert [c.token for c in content] == [c.token for c in top]
    for entry in content:
        asked = [f"token_id:{i}" for i in ids]
        assert [t.token for t in entry.top_logprobs] == [entry.token] + [t for t in asked if t != entry.token]
    first = {t.token: t.logprob for t in content[0].top_logprobs}
    for i in ids[:2]:
        assert first[f"token_id:{i}"] == pytest.approx(top[0].top_logprobs[ranked.index(i)].logprob, abs=1e-4)
    assert first["token_id:40000"] < first[f"token_id:{ids[0]}"]


def test_return_token_ids_and_tokens_as_token_ids(client, model):
    """vLLM's return_token_ids: the answer carries the prompt's token ids and each choice its generated ones (a
    stream: the prompt's in the first chunk, each chunk its new ones, joining to the whole); with
    return_tokens_as_token_ids logprobs name each token "token_id:<id>"."""
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    full = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=6,
                                          logprobs=True, top_logprobs=2, extra_body=extra)
    token_ids = full.choices[0].token_ids
    assert len(token_ids) == full.usage.completion_tokens and len(full.prompt_token_ids) == full.usage.prompt_tokens
    content = full.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in token_ids]
    assert content[0].top_logprobs[0].token == f"token_id:{token_ids[0]}"
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=6,
                                                 stream=True, extra_body=extra))
    assert chunks[0].prompt_token_ids == full.prompt_token_ids and not hasattr(chunks[1], "prompt_token_ids")
    assert [t for c in chunks for choice in c.choices for t in getattr(choice, "token_ids", None) or []] == token_ids


def test_each_choices_first_chunk_carries_the_prompt_token_ids(client, model):
    """As vLLM's: a stream with return_token_ids and n > 1 sends the prompt's token ids in each choice's first chunk
    (its role's), and in no other."""
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3, n=2, stream=True,
                                                 extra_body={"return_token_ids": True}))
    carrying = [chunk for chunk in chunks if getattr(chunk, "prompt_token_ids", None)]
    assert [chunk.choices[0].index for chunk in carrying] == [0, 1]
    assert carrying[0].prompt_token_ids == carrying[1].prompt_token_ids


def test_return_prompt_text_is_the_rendered_chat_template(client, model, tokenizer):
    """vLLM's return_prompt_text: the answer carries the prompt's text as the chat template rendered it (a stream: in
    each choice's first chunk); without it, none."""
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ask = dict(model=model, messages=MESSAGES, max_tokens=2)
    assert client.chat.completions.create(**ask, extra_body={"return_prompt_text": True}).prompt_text == text
    assert client.chat.completions.create(**ask).model_extra.get("prompt_text") is None
    chunks = list(client.chat.completions.create(**ask, n=2, stream=True, extra_body={"return_prompt_text": True}))
    assert [(chunk.choices[0].index, chunk.prompt_text) for chunk in chunks if getattr(chunk, "prompt_text", None)] \
        == [(0, text), (1, text)]


def raw_stream(server, body: dict) -> list[dict]:
    """The chunks of a streamed chat completion as JSON objects, every field as the server wrote it."""
    with server.http() as http:
        lines = http.post("/v1/chat/completions", json={"messages": MESSAGES, "stream": True, **body}
                          ).text.splitlines()
    return [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: {")]


def test_a_streams_role_chunks_carry_the_prompt_fields_null_when_not_asked_for(server, model):
    """As vLLM's: each choice's first chunk (its role) sets prompt_token_ids and prompt_text, null unless asked for,
    so that a client reads them there whatever it asked; no other chunk has them."""
    chunks = raw_stream(server, {"model": model, "max_tokens": 2, "n": 2})
    prompt_fields = [{key: chunk[key] for key in ("prompt_token_ids", "prompt_text") if key in chunk}
                     for chunk in chunks]
    assert [chunk["choices"][0]["delta"].get("role") for chunk in chunks[:2]] == ["assistant", "assistant"]
    assert prompt_fields[:2] == [{"prompt_token_ids": None, "prompt_text": None}] * 2
    assert len(chunks) > 2 and prompt_fields[2:] == [{}] * (len(chunks) - 2)


@pytest.mark.parametrize("return_token_ids", [False, True])
def test_streamed_chunks_set_token_ids_each_and_stop_reason_last(server, model, return_token_ids):
    """As vLLM's stream: a role chunk has no token_ids; each generated chunk sets token_ids (its new ids with
    return_token_ids, else null), and only the last one sets stop_reason."""
    chunks = raw_stream(server, {"model": model, "max_tokens": 4, "ignore_eos": True,
                                 "return_token_ids": return_token_ids})
    role, generated = chunks[0]["choices"][0], [chunk["choices"][0] for chunk in chunks[1:]]
    assert "token_ids" not in role and "stop_reason" not in role
    assert ["stop_reason" in choice for choice in generated] == [False] * (len(generated) - 1) + [True]
    token_ids = [choice["token_ids"] for choice in generated]
    if return_token_ids:
        assert sum(len(ids) for ids in token_ids) == 4
    else:
        assert token_ids == [None] * len(generated)


def test_stop_string(client, model):
    text = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0,
                                          max_tokens=24).choices[0].message.content
    stop = "Paris"
    stopped = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=24,
                                             stop=[stop]).choices[0]
    assert stopped.message.content == text[:text.index(stop)]
    assert (stopped.finish_reason, stopped.model_extra["stop_reason"]) == ("stop", stop)
    texts, finish, _ = stream_text(client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, max_tokens=24, stop=[stop], stream=True))
    assert (texts, finish) == ({0: stopped.message.content}, {0: "stop"})
    kept = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=24, stop=stop,
                                          extra_body={"include_stop_str_in_output": True}).choices[0]
    assert kept.message.content == text[:text.index(stop) + len(stop)]


def test_seeded_sampling_repeats(client, model):
    def sample():
        return client.chat.completions.create(model=model, messages=MESSAGES, temperature=1.0, top_p=0.9,
                                              max_tokens=16, seed=1234).choices[0].message.content

    first = sample()
    assert sample() == first


def test_echo_starts_an_answer_that_continues_the_last_message_with_it(client, model):
    """vLLM's echo: when the answer continues the last message (their roles are the same), it starts with that
    message's text, streamed or not; an answer in a new message echoes nothing."""
    messages = [*MESSAGES, {"role": "assistant", "content": "The capital of France is"}]
    ask = dict(model=model, messages=messages, temperature=0, max_tokens=4)
    continued = {"add_generation_prompt": False, "continue_final_message": True}
    plain = client.chat.completions.create(**ask, extra_body=continued).choices[0].message.content
    response = client.chat.completions.create(**ask, extra_body={**continued, "echo": True})
    echoed = response.choices[0].message
    assert echoed.role == "assistant" and echoed.content == "The capital of France is" + plain
    # As vLLM's, echo asks for the prompt's logprobs too (top_logprobs of them, 0 by default: each token's own).
    prompt_logprobs = response.model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and all(len(entry) == 1 for entry in prompt_logprobs[1:])
    texts, _, _ = stream_text(client.chat.completions.create(**ask, extra_body={**continued, "echo": True},
                                                             stream=True))
    assert texts == {0: echoed.content}
    new_message = dict(model=model, messages=MESSAGES, temperature=0, max_tokens=4)
    assert client.chat.completions.create(**new_message, extra_body={"echo": True}).choices[0].message.content == \
        client.chat.completions.create(**new_message).choices[0].message.content


@pytest.fixture(scope="module")
def flags_server(tmp_path_factory):
    """A server of its own for the flags below: --max-logprobs -1, --enable-prompt-tokens-details,
    --tool-call-parser hermes and --disable-fastapi-docs."""
    srv = RemoteServer(tmp_path_factory.mktemp("flags") / "server.log",
                       extra_args=["--max-logprobs", "-1", "--enable-prompt-tokens-details",
                                   "--tool-call-parser", "hermes", "--disable-fastapi-docs"])
    yield srv
    srv.stop()


def test_disable_fastapi_docs_serves_no_openapi_pages(flags_server, server):
    """vLLM's --disable-fastapi-docs: no /openapi.json, /docs or /redoc, which the shared server serves."""
    for path in ("/openapi.json", "/docs", "/redoc"):
        with server.http() as http:
            assert http.get(path).status_code == 200, path
        with flags_server.http() as http:
            assert http.get(path).status_code == 404, path


def test_top_logprobs_minus_1_lists_every_token(flags_server, tokenizer):
    """vLLM's top_logprobs -1 (chat) and logprobs -1 (completions), which a server started with --max-logprobs -1
    allows: each position lists the whole vocabulary in rank order (the engine computed it; the answers listed
    none)."""
    with flags_server.http(timeout=120) as http:
        chat = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, "temperature": 0,
                                                       "logprobs": True, "top_logprobs": -1}).json()
        completion = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1, "temperature": 0,
                                                        "logprobs": -1}).json()
    position = chat["choices"][0]["logprobs"]["content"][0]
    top = [alternative["logprob"] for alternative in position["top_logprobs"]]
    assert len(top) == len(tokenizer) and top == sorted(top, reverse=True) and top[0] == position["logprob"]
    logprobs = completion["choices"][0]["logprobs"]
    top = list(logprobs["top_logprobs"][0].values())
    # keyed by token text, which several ids can share (byte tokens decode alike, a later one's value replacing the
    # earlier's, as in vLLM): most of the vocabulary, the chosen token first
    assert len(top) > len(tokenizer) // 2 and top[0] == max(top) == logprobs["token_logprobs"][0]


def test_enable_prompt_tokens_details_reports_the_cached_prompt_tokens(flags_server):
    """vLLM's --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens counts the prompt tokens the
    prefix cache held (0 when none: the field is there whenever the flag is on), in chat and completions answers,
    streamed or not."""
    messages = [{"role": "user", "content": "Which prompt tokens did the prefix cache hold for this question?"}]
    with flags_server.http(timeout=120) as http:
        def chat(**extra):
            return http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, **extra})

        first = chat().json()["usage"]
        again = chat().json()["usage"]
        streamed = [line for line in chat(stream=True, stream_options={"include_usage": True}).text.splitlines()
                    if line.startswith("data: {")]
        prompt = list(range(1000, 1100))
        completions = [http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).json()["usage"]
                       for _ in range(2)]
    whole_blocks = (first["prompt_tokens"] - 1) // 16 * 16
    # the first time, at most the chat template's opening, which other requests to this server share
    assert (first.get("prompt_tokens_details") or {}).get("cached_tokens", 0) < whole_blocks
    assert again["prompt_tokens_details"] == {"cached_tokens": whole_blocks}
    assert json.loads(streamed[-1].removeprefix("data: "))["usage"]["prompt_tokens_details"] == \
        {"cached_tokens": whole_blocks}
    assert completions[0]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert completions[1]["prompt_tokens_details"] == {"cached_tokens": 96}


def test_cache_salt_keeps_prefix_cache_hits_among_requests_of_one_salt(flags_server):
    """vLLM's cache_salt: the salt keys the prompt's block hashes, so a request reuses the cached blocks of requests
    with the same salt only; a bad salt is a 400 naming it, on each endpoint, before any prompt runs."""
    prompt = list(range(3000, 3100))
    with flags_server.http(timeout=120) as http:
        def cached(**extra) -> int:
            usage = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, **extra}).json()["usage"]
            return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

        salted = [cached(cache_salt="tenant-a"), cached(cache_salt="tenant-a"), cached(cache_salt="tenant-b"),
                  cached(), cached(cache_salt="tenant-b")]
        messages = [{"role": "user", "content": "A question that two tenants of this server both ask, word for word."}]
        chats = [http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, "cache_salt": salt})
                 .json()["usage"] for salt in ("tenant-a", "tenant-a", "tenant-b")]
        refused = [http.post(path, json={**body, "max_tokens": 1, "cache_salt": salt})
                   for path, body in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions",
                                                                               {"messages": messages}),
                                      ("/v1/responses", {"input": "Hi"}))
                   for salt in ("", "a/b", "x" * 129)]
    assert salted == [0, 96, 0, 0, 96]
    whole_blocks = (chats[0]["prompt_tokens"] - 1) // 16 * 16
    assert [(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) == whole_blocks for usage in chats] \
        == [False, True, False]
    for response in refused:
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "cache_salt" and "cache_salt" in response.json()["error"]["message"]


def test_auto_tool_choice_keeps_special_tokens_for_the_parser(flags_server, tokenizer):
    """As vLLM's Hermes2ProToolParser.adjust_request: with tools and tool_choice auto, the answer's text keeps
    special tokens, whatever skip_special_tokens says (some tokenizers mark <tool_call> special: skipped, the parser
    would never see a call); without tools it skips them."""
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"messages": MESSAGES, "max_tokens": 1, "logit_bias": {str(special): 100}, "skip_special_tokens": True}
    with flags_server.http(timeout=120) as http:
        def content(**extra) -> str:
            return http.post("/v1/chat/completions", json={**body, **extra}).json()["choices"][0]["message"]["content"]

        assert content(tools=[tool], tool_choice="auto") == "<|im_start|>"
        assert not content()
