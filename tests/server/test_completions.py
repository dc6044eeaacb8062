"""/v1/completions, /tokenize and /detokenize: streaming equals non-streaming, batches of prompts, echo, logprobs."""
from __future__ import annotations

import asyncio
import json

import openai
import pytest

from tests.server.conftest import MAX_MODEL_LEN

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(server):
    return server.get_client()


def test_streamed_deltas_equal_the_greedy_completion(client, tokenizer):
    full = client.completions.create(model="smollm2-135m-instruct", prompt=PROMPT, temperature=0, max_tokens=12)
    assert full.object == "text_completion"
    assert full.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    stream = list(client.completions.create(model="smollm2-135m-instruct", prompt=PROMPT, temperature=0,
                                            max_tokens=12, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in stream if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == full.choices[0].finish_reason
    assert stream[-1].usage == full.usage
    # an empty stream_options without stream is as none (vLLM's check reads the object's truth)
    unstreamed = client.completions.create(model="smollm2-135m-instruct", prompt=PROMPT, temperature=0, max_tokens=12,
                                           stream_options={})
    assert unstreamed.choices[0].text == full.choices[0].text


def test_stream_interval_sends_fewer_chunks_of_the_same_text(client):
    """vLLM's stream_interval request field: the first token at once, then a chunk every 4 tokens, the text and
    finish the same; 0 is a 400 naming it."""
    full = client.completions.create(model="smollm2-135m-instruct", prompt=PROMPT, temperature=0, max_tokens=12,
                                     extra_body={"ignore_eos": True})
    stream = list(client.completions.create(model="smollm2-135m-instruct", prompt=PROMPT, temperature=0,
                                            max_tokens=12, stream=True,
                                            extra_body={"ignore_eos": True, "stream_interval": 4}))
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == full.choices[0].text
    # 1, 4, 4, then the last 3 with the finish; fewer where the stream fell behind and merged them
    assert len(chunks) <= 4 and chunks[-1].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="stream_interval"):
        client.completions.create(model="smollm2-135m-instruct", prompt=PROMPT, max_tokens=2,
                                  extra_body={"stream_interval": 0})


def test_return_token_ids_and_tokens_as_token_ids(client, tokenizer):
    """vLLM's return_token_ids: the choice carries the prompt's and the generated token ids (a stream: the prompt's
    in the first chunk, each chunk its new ones, joining to the whole); return_tokens_as_token_ids: logprobs name
    each token "token_id:<id>"."""
    body = dict(model="smollm2-135m-instruct", prompt=PROMPT, temperature=0, max_tokens=6, logprobs=1,
                extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True})
    [choice] = client.completions.create(**body).choices
    assert choice.prompt_token_ids == tokenizer.encode(PROMPT) and len(choice.token_ids) == 6
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in choice.token_ids]
    assert all(key.startswith("token_id:") for top in choice.logprobs.top_logprobs for key in top)
    chunks = [c.choices[0] for c in client.completions.create(**body, stream=True) if c.choices]
    assert chunks[0].prompt_token_ids == choice.prompt_token_ids and chunks[1].prompt_token_ids is None
    assert [t for c in chunks for t in c.token_ids] == choice.token_ids
    plain = client.completions.create(model="smollm2-135m-instruct", prompt=PROMPT, temperature=0, max_tokens=6,
                                      logprobs=1).choices[0]
    assert plain.token_ids is None and plain.logprobs.tokens[0] == tokenizer.decode(choice.token_ids[:1])


def test_echo_with_return_token_ids_echoes_the_prompt_by_its_token_ids_alone(client, tokenizer):
    """As vLLM's: echo with return_token_ids sends the prompt as prompt_token_ids (a stream: in the first chunk) and
    its tokens in the logprobs, not its text in front of the answer's, streamed or not."""
    body = dict(model="smollm2-135m-instruct", prompt=PROMPT, temperature=0, max_tokens=4, echo=True, logprobs=0,
                extra_body={"return_token_ids": True})
    prompt_ids = tokenizer.encode(PROMPT)
    [choice] = client.completions.create(**body).choices
    assert choice.prompt_token_ids == prompt_ids and choice.text == tokenizer.decode(choice.token_ids)
    assert len(choice.logprobs.tokens) == len(prompt_ids) + 4
    chunks = [c.choices[0] for c in client.completions.create(**body, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == choice.text and chunks[0].prompt_token_ids == prompt_ids


def test_streamed_choices_carry_the_token_id_fields_null_when_not_asked_for(server):
    """As vLLM's: every chunk's choice sets token_ids and prompt_token_ids, null unless return_token_ids asks for
    them, so that a client reads them from any chunk whatever it asked."""
    with server.http() as http:
        lines = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "stream": True}).text.splitlines()
    choices = [json.loads(line.removeprefix("data: "))["choices"][0] for line in lines if line.startswith("data: {")]
    assert choices and [(choice["token_ids"], choice["prompt_token_ids"]) for choice in choices] == \
        [(None, None)] * len(choices)


def test_batch_of_prompts_with_n(client, tokenizer):
    """Choice i * n + j is prompt i's choice j (prompt i's, as its text shows with a prompt that forces it)."""
    prompts = [PROMPT, "Once upon a time"]
    full = client.completions.create(model="smollm2-135m-instruct", prompt=prompts, n=2, temperature=1.0, seed=0,
                                     max_tokens=5, echo=True, extra_body={"ignore_eos": True})
    assert [c.index for c in full.choices] == [0, 1, 2, 3]
    assert [c.text.startswith(prompts[c.index // 2]) for c in full.choices] == [True] * 4
    assert full.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert full.usage.completion_tokens == 4 * 5


def test_echo_without_generation(client, tokenizer):
    """echo with max_tokens 0 returns the prompt and its logprobs alone (vLLM's answer, which
    lm-evaluation-harness's loglikelihood requests use), streamed or not."""
    full = client.completions.create(model="smollm2-135m-instruct", prompt=PROMPT, max_tokens=0, echo=True,
                                     logprobs=1)
    choice = full.choices[0]
    num_prompt = len(tokenizer.encode(PROMPT))
    assert choice.text == PROMPT and len(choice.logprobs.tokens) == num_prompt
    assert choice.logprobs.token_logprobs[0] is None and all(lp < 0 for lp in choice.logprobs.token_logprobs[1:])
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (num_prompt, 0)
    stream = list(client.completions.create(model="smollm2-135m-instruct", prompt=PROMPT, max_tokens=0, echo=True,
                                            logprobs=1, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in stream if c.choices) == PROMPT
    assert [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs] \
        == choice.logprobs.token_logprobs
    assert stream[-1].usage == full.usage


def test_continuous_usage_stats(client, tokenizer):
    """With stream_options.continuous_usage_stats every chunk carries its choice's usage so far (vLLM's)."""
    stream = list(client.completions.create(
        model="smollm2-135m-instruct", prompt=PROMPT, temperature=0, max_tokens=6, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    num_prompt = len(tokenizer.encode(PROMPT))
    counts = [c.usage.completion_tokens for c in stream[:-1]]
    assert counts == sorted(counts) and counts[-1] == 6
    assert all(c.usage.prompt_tokens == num_prompt for c in stream)
    assert stream[-1].choices == [] and stream[-1].usage.completion_tokens == 6


def test_token_id_prompt(client, tokenizer):
    by_text = client.completions.create(model="smollm2-135m-instruct", prompt=PROMPT, temperature=0, max_tokens=5)
    by_ids = client.completions.create(model="smollm2-135m-instruct", prompt=tokenizer.encode(PROMPT),
                                       temperature=0, max_tokens=5)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_logprobs_and_echo(client, tokenizer):
    full = client.completions.create(model="smollm2-135m-instruct", prompt=PROMPT, temperature=0, max_tokens=4,
                                     logprobs=2, echo=True)
    choice = full.choices[0]
    assert choice.text.startswith(PROMPT)
    logprobs = choice.logprobs
    num_prompt = len(tokenizer.encode(PROMPT))
    assert len(logprobs.tokens) == num_prompt + 4
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    for token, logprob, top in zip(logprobs.tokens[num_prompt:], logprobs.token_logprobs[num_prompt:],
                                   logprobs.top_logprobs[num_prompt:]):
        assert max(top.values()) == pytest.approx(logprob) and top[token] == logprob  # greedy


def test_streamed_logprobs_offsets_are_the_unstreamed_ones(client):
    """text_offset follows the tokens, also while a stream holds text back for a stop string that may begin there
    (it never matches here)."""
    ask = dict(model="smollm2-135m-instruct", prompt=PROMPT, temperature=0, max_tokens=10, logprobs=1,
               stop=["zzzzzzzzzzzzzzzz"])
    full = client.completions.create(**ask).choices[0].logprobs
    stream = [c.choices[0].logprobs for c in client.completions.create(**ask, stream=True)
              if c.choices and c.choices[0].logprobs]
    assert [o for lp in stream for o in lp.text_offset] == full.text_offset
    assert full.text_offset == [len("".join(full.tokens[:i])) for i in range(len(full.tokens))]


def test_echoed_prompt_alternatives_are_cut_to_logprobs(client):
    """prompt_logprobs asking for more alternatives than logprobs: an echoed prompt position lists logprobs + 1 of
    them, as a generated one does (vLLM's)."""
    full = client.completions.create(model="smollm2-135m-instruct", prompt=PROMPT, max_tokens=2, echo=True,
                                     logprobs=1, extra_body={"prompt_logprobs": 3})
    assert all(top is None or len(top) <= 2 for top in full.choices[0].logprobs.top_logprobs)
    assert full.choices[0].prompt_logprobs[1] is not None and len(full.choices[0].prompt_logprobs[1]) >= 3


def test_logprob_token_ids_are_every_alternative(client):
    """vLLM's logprob_token_ids: each generated token's alternatives are itself and all the ids asked for, however
    few logprobs asks for."""
    ids = [5, 300, 40000]
    full = client.completions.create(model="smollm2-135m-instruct", prompt=PROMPT, temperature=0, max_tokens=3,
                                     logprobs=0, extra_body={"logprob_token_ids": ids,
                                                             "return_tokens_as_token_ids": True})
    logprobs = full.choices[0].logprobs
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert list(top) == [token] + [f"token_id:{i}" for i in ids if f"token_id:{i}" != token]
        assert top[token] == logprob and all(v <= logprob for v in top.values())


def test_null_max_tokens_is_sixteen(client):
    """"max_tokens": null is OpenAI's default of 16 for completions (vLLM's reading), not the rest of the context."""
    full = client.completions.create(model="smollm2-135m-instruct", prompt=PROMPT, max_tokens=None,
                                     extra_body={"ignore_eos": True})
    assert full.usage.completion_tokens == 16


def test_null_echo_is_no_echo(server):
    """"echo": null (sent by clients that write every field) is no echo, as vLLM's completions read it, not a 400."""
    with server.http() as http:
        response = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "echo": None})
    assert response.status_code == 200, response.text
    assert not response.json()["choices"][0]["text"].startswith(PROMPT)


def test_tokenize_detokenize(server, tokenizer):
    with server.http() as http:
        tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()
        assert tokens["tokens"] == tokenizer.encode(PROMPT) and tokens["count"] == len(tokens["tokens"])
        assert tokens["max_model_len"] == 1024
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
        assert chat["tokens"] == tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                                               add_generation_prompt=True, tokenize=True,
                                                               return_dict=False)
        assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": PROMPT}


def test_truncate_prompt_tokens_keeps_the_last_or_first_tokens(client, tokenizer):
    """vLLM's truncate_prompt_tokens: the prompt cut to its last N tokens (truncation_side "right": its first N),
    the usage and the echoed prompt those tokens'; more than max_model_len is a 400."""
    ids = tokenizer.encode("One two three four five six seven eight nine ten")
    ask = dict(model="smollm2-135m-instruct", prompt=ids, temperature=0, max_tokens=3, echo=True)
    last = client.completions.create(**ask, extra_body={"truncate_prompt_tokens": 3})
    assert last.usage.prompt_tokens == 3 and last.choices[0].text.startswith(tokenizer.decode(ids[-3:]))
    alone = client.completions.create(**{**ask, "prompt": ids[-3:]})
    assert last.choices[0].text == alone.choices[0].text
    first = client.completions.create(**ask, extra_body={"truncate_prompt_tokens": 2, "truncation_side": "right"})
    assert first.usage.prompt_tokens == 2 and first.choices[0].text.startswith(tokenizer.decode(ids[:2]))
    whole = client.completions.create(**ask, extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**ask, extra_body={"truncate_prompt_tokens": 10 ** 6})
    assert info.value.body["param"] == "truncate_prompt_tokens"
    chat = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=2,
                                          messages=[{"role": "user", "content": "Hello there, how are you?"}],
                                          extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5


def test_truncate_prompt_tokens_minus_one_leaves_room_for_output(client, tokenizer):
    """-1 cuts a prompt longer than the context to max_model_len - 1 tokens, leaving one for the output (vLLM's
    max_truncation_tokens), rather than to max_model_len, which no request can have."""
    ids = tokenizer.encode(" one") * (MAX_MODEL_LEN + 10)
    ask = dict(model="smollm2-135m-instruct", max_tokens=5, temperature=0, extra_body={"truncate_prompt_tokens": -1})
    completion = client.completions.create(prompt=ids, **ask)
    chat = client.chat.completions.create(messages=[{"role": "user", "content": tokenizer.decode(ids)}], **ask)
    for answer in (completion, chat):
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (MAX_MODEL_LEN - 1, 1)


def test_response_id_is_the_clients(server):
    """vLLM's request ids: the response's id is "cmpl-" (chat: "chatcmpl-") and the X-Request-Id header, else the
    body's request_id; two requests at once may send the same one."""
    ask = dict(model="smollm2-135m-instruct", prompt=PROMPT, max_tokens=2)

    async def twins() -> list[str]:
        client = server.get_async_client()
        same = [client.completions.create(**ask, extra_headers={"X-Request-Id": "same"},
                                          extra_body={"request_id": "overridden"}) for _ in range(2)]
        return [completion.id for completion in await asyncio.gather(*same)]

    assert asyncio.run(twins()) == ["cmpl-same", "cmpl-same"]
    client = server.get_client()
    assert client.completions.create(**ask, extra_body={"request_id": "mine"}).id == "cmpl-mine"
    chat = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=2, extra_headers={
        "X-Request-Id": "talk"}, messages=[{"role": "user", "content": "Hi"}])
    assert chat.id == "chatcmpl-talk"
