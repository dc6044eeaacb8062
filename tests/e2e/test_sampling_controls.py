"""bad_words, repetition_penalty, logit_bias and allowed_token_ids end to end with the real default model. ``llm``
is the package's shared float32 engine (conftest.py), in its own process as users run it."""
from __future__ import annotations

import pytest

from pagedllm import SamplingParams
from pagedllm.structured_output.params import StructuredOutputsParams

FRANCE = "The capital of France is"
APPLES = "I like to eat apples. I like to eat"  # greedy decoding repeats " I'm a big apple." over and over


@pytest.fixture(scope="module")
def greedy(llm):
    """Each prompt's plain greedy completion (16 tokens): what the controls are compared against."""
    outputs = llm.generate([FRANCE, APPLES], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                           use_tqdm=False)
    return {FRANCE: outputs[0].outputs[0], APPLES: outputs[1].outputs[0]}


def test_bad_words_never_appear(llm, greedy):
    assert "Paris" in greedy[FRANCE].text and "big apple" in greedy[APPLES].text
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, bad_words=[word])
              for word in ("Paris", "big apple")]
    france, apples = (o.outputs[0] for o in llm.generate([FRANCE, APPLES], params, use_tqdm=False))
    assert "Paris" not in france.text
    assert "big apple" not in apples.text
    # A multi-token bad word bans only its last token, and only right after the rest of it: the output follows
    # greedy up to " big", then turns away.
    tokenizer = llm.get_tokenizer()
    big, apple = tokenizer.encode(" big apple", add_special_tokens=False)
    cut = greedy[APPLES].token_ids.index(big) + 1
    assert apples.token_ids[:cut] == greedy[APPLES].token_ids[:cut]
    assert apples.token_ids[cut] != apple


def test_too_many_bad_words_are_refused_naming_the_field(llm):
    """As vLLM (VLLM_MAX_NUM_BAD_WORDS): at most 128 token sequences, which the sampler matches every step."""
    words = [f"word{i}" for i in range(100)]  # 200 sequences: each word with and without a leading space
    with pytest.raises(ValueError, match="^bad_words makes more than 128 token sequences"):
        llm.generate(FRANCE, SamplingParams(max_tokens=4, bad_words=words), use_tqdm=False)
    stats = llm.get_stats()
    assert stats.num_running_reqs == stats.num_waiting_reqs == stats.num_skipped_waiting_reqs == 0


def test_repetition_penalty_breaks_a_loop(llm, greedy):
    loop = greedy[APPLES].token_ids
    assert len(set(loop)) < len(loop) / 2
    penalised = llm.generate(APPLES, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                    repetition_penalty=1.5), use_tqdm=False)[0].outputs[0].token_ids
    assert len(set(penalised)) > len(set(loop))


def test_logit_bias_and_allowed_token_ids_leave_other_requests_alone(llm, greedy):
    tokenizer = llm.get_tokenizer()
    forced = tokenizer.encode(" banana", add_special_tokens=False)[0]
    allowed = tokenizer.encode(" one two three four", add_special_tokens=False)
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={forced: 100}),
              SamplingParams(temperature=1.0, seed=0, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)]
    biased, restricted, free = (o.outputs[0] for o in llm.generate([FRANCE, FRANCE, APPLES], params, use_tqdm=False))
    assert biased.token_ids == [forced] * 4
    assert set(restricted.token_ids) <= set(allowed)
    assert free.token_ids == greedy[APPLES].token_ids


@pytest.mark.parametrize("bad, field", [({"logit_bias": {10 ** 6: 1.0}}, "logit_bias"),
                                        ({"allowed_token_ids": [0, -1]}, "allowed_token_ids"),
                                        ({"stop_token_ids": [49157], "min_tokens": 2}, "stop_token_ids")])
def test_out_of_vocab_ids_are_rejected_without_leaking(llm, bad, field):
    """(A stop token id past the vocabulary under min_tokens indexed the logits out of bounds in the engine.)"""
    with pytest.raises(ValueError, match=f"^{field} contains out-of-vocabulary token ids"):
        llm.generate(FRANCE, SamplingParams(max_tokens=4, **bad), use_tqdm=False)
    stats = llm.get_stats()
    assert stats.num_running_reqs == stats.num_waiting_reqs == stats.num_skipped_waiting_reqs == 0
    assert stats.kv_cache_usage == 0.0


def test_min_tokens_holds_back_eos_under_ignore_eos(llm):
    """vLLM masks EOS under min_tokens whether or not ignore_eos: a bias that makes EOS every greedy choice still
    gives min_tokens other tokens first."""
    eos = llm.get_tokenizer().eos_token_id
    params = SamplingParams(temperature=0, max_tokens=5, min_tokens=3, ignore_eos=True, logit_bias={eos: 100.0})
    tokens = llm.generate(FRANCE, params, use_tqdm=False)[0].outputs[0].token_ids
    assert eos not in tokens[:3] and tokens[3:] == [eos, eos]


def test_a_grammar_that_can_only_end_ends_under_min_tokens(llm):
    """A choice grammar done before min_tokens leaves only EOS: the request ends there with the choice (vLLM
    restores the stop tokens for structured output), instead of sampling a token the grammar forbids."""
    eos = llm.get_tokenizer().eos_token_id
    params = SamplingParams(temperature=0, max_tokens=10, min_tokens=6,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    out = llm.generate("Is Paris in France? Answer yes or no:", params, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.token_ids[-1] == eos and out.finish_reason == "stop"
