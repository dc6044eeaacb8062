"""Penalties, logit_bias, allowed_token_ids and bad_words through the OpenAI API (their 400s are in test_errors)."""
from __future__ import annotations

from tests.server.test_errors import post

MODEL = "smollm2-135m-instruct"
PROMPT = "The capital of France is"  # greedy: " Paris." (see tests/e2e/test_sampling_controls.py)


def test_logit_bias_forces_a_token_with_penalties_set(server, tokenizer):
    banana = tokenizer.encode(" banana", add_special_tokens=False)[0]
    completion = server.get_client().completions.create(
        model=MODEL, prompt=PROMPT, temperature=0, max_tokens=3, logit_bias={str(banana): 100},
        presence_penalty=0.5, frequency_penalty=0.5, extra_body={"repetition_penalty": 1.2, "ignore_eos": True})
    assert completion.choices[0].text == " banana" * 3


def test_bad_words_and_allowed_token_ids(server, tokenizer):
    client = server.get_client()
    banned = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=8,
                                       extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in banned.choices[0].text
    allowed = tokenizer.encode(" yes no", add_special_tokens=False)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                          seed=0, extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    words = chat.choices[0].message.content.split()
    assert len(words) == 6 and set(words) <= {"yes", "no"}


def test_biases_past_the_bounds_are_clamped_infinities_and_nan_included(server, tokenizer):
    """As vLLM's: a bias is clamped to [-100, 100], an infinite one (JSON's Infinity, as Python writes it) too; NaN,
    which no comparison in vLLM's clamp holds for, is -100."""
    banana, paris = (tokenizer.encode(word, add_special_tokens=False)[0] for word in (" banana", " Paris"))

    def first_token(logit_bias: dict) -> str:
        with server.http() as http:
            response = post(http, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "temperature": 0,
                                                      "max_tokens": 1, "logit_bias": logit_bias})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    assert first_token({}) == tokenizer.decode([paris])
    assert first_token({str(banana): float("inf")}) == tokenizer.decode([banana])
    for ban in (float("-inf"), float("nan")):
        assert first_token({str(paris): ban}) != tokenizer.decode([paris])
