"""Penalties, logit_bias, allowed_token_ids and bad_words through the OpenAI API (their 400s are in test_errors)."""
from __future__ import annotations

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
