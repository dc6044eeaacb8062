"""use_beam_search (vLLM's extra) on the server: n beams, best first, the same as the offline LLM.beam_search."""
from __future__ import annotations

import json

import pytest

from pagedllm.sampling_params import BeamSearchParams
from tests.e2e.conftest import in_process_llm
from tests.server.conftest import MAX_MODEL_LEN

MODEL = "smollm2-135m-instruct"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of Japan?"}]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def offline_beams(tokenizer):
    """The offline beam search's best two beams for PROMPT and for the chat-templated MESSAGES."""
    llm = in_process_llm(dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory="256MiB")  # shared weights
    chat = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    outs = llm.beam_search([PROMPT, {"prompt_token_ids": list(chat)}], BeamSearchParams(beam_width=2,
                                                                                        max_tokens=MAX_TOKENS))
    llm.shutdown()
    return [[(seq.text, seq.finish_reason) for seq in out.sequences] for out in outs]


def test_completion_choices_are_the_offline_beams(server, offline_beams):
    response = server.get_client().completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=MAX_TOKENS,
                                                      extra_body={"use_beam_search": True})
    assert [c.index for c in response.choices] == [0, 1]
    assert [(c.text, c.finish_reason) for c in response.choices] == offline_beams[0]
    assert response.choices[0].text != response.choices[1].text


def test_streamed_chat_sends_each_beam_whole(server, offline_beams):
    """Beam search streams its final beams: one chunk per choice carrying all its text, then [DONE]."""
    with server.http() as http:
        lines = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": MESSAGES, "n": 2, "max_tokens": MAX_TOKENS, "use_beam_search": True,
            "stream": True}).text.splitlines()
    events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    content_chunks = [choice for event in events[:-1] for choice in json.loads(event)["choices"]
                      if choice["delta"].get("content")]
    assert [(c["delta"]["content"], c["finish_reason"]) for c in content_chunks] == offline_beams[1]


def test_logprobs_are_the_beams_candidates(server):
    """As vLLM's: each beam's tokens come with their logprobs, from the candidates its steps ranked, so a choice's
    mean token logprob is its score (length_penalty 1), best first."""
    with server.http() as http:
        completion = http.post("/v1/completions", json={
            "model": MODEL, "prompt": PROMPT, "n": 2, "max_tokens": MAX_TOKENS, "logprobs": 3,
            "use_beam_search": True}).json()
        chat = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": MESSAGES, "n": 2, "max_tokens": MAX_TOKENS, "logprobs": True,
            "top_logprobs": 2, "use_beam_search": True}).json()
    scores = []
    for choice in completion["choices"]:
        logprobs = choice["logprobs"]
        assert "".join(logprobs["tokens"]).startswith(choice["text"])
        assert [len(top) for top in logprobs["top_logprobs"]] == [4] * len(logprobs["tokens"])
        scores.append(sum(logprobs["token_logprobs"]) / len(logprobs["token_logprobs"]))
    assert scores == sorted(scores, reverse=True)
    for choice in chat["choices"]:
        content = choice["logprobs"]["content"]
        assert "".join(c["token"] for c in content).startswith(choice["message"]["content"])
        assert [len(c["top_logprobs"]) for c in content] == [2] * len(content)


@pytest.mark.parametrize("endpoint, body, param", [
    ("/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 1}, "echo"),  # no prompt logprobs (vLLM's)
    ("/v1/completions", {"prompt": PROMPT, "logprobs": -2}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": -2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "n": 11}, "n"),  # 2 * n logprobs a step, past max_logprobs (20)
    # As vLLM's: only chat streams beam search (its final beams, test_streamed_chat_sends_each_beam_whole).
    ("/v1/completions", {"prompt": PROMPT, "stream": True}, "use_beam_search"),
])
def test_bad_combinations_are_refused(server, endpoint, body, param):
    with server.http() as http:
        response = http.post(endpoint, json={"model": MODEL, "n": 2, "use_beam_search": True, **body})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_skip_special_tokens_false_keeps_them_in_the_beams_text(server):
    """A prompt that ends a turn: the beams start a new one with <|im_start|>, kept in the text when asked."""
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
    texts = {}
    for skip in (True, False):
        response = server.get_client().completions.create(
            model=MODEL, prompt=prompt, n=2, max_tokens=4,
            extra_body={"use_beam_search": True, "skip_special_tokens": skip, "ignore_eos": True})
        texts[skip] = [c.text for c in response.choices]
    assert any("<|im_start|>" in text for text in texts[False])
    assert not any("<|im_start|>" in text for text in texts[True])
