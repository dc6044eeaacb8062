"""bad_words, repetition_penalty, logit_bias and allowed_token_ids end to end with the real default model. ``llm``
is the package's shared float32 engine (conftest.py), in its own process as users run it. thinking_token_budget
with a tiny random model whose vocabulary has <think> and </think>."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedllm import EngineArgs, SamplingParams
from pagedllm.structured_output.params import StructuredOutputsParams
from tests.e2e.conftest import running_llm

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


@pytest.fixture(scope="module")
def thinker_path(tmp_path_factory, tokenizer) -> str:
    """A tiny random Llama with <think> and </think> in its vocabulary."""
    path = tmp_path_factory.mktemp("thinker")
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_tokens(["<think>", "</think>"])
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.5, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def thinker(thinker_path):
    """The thinking model served with vLLM's deepseek_r1 reasoning parser; prompts are chunked by a 32-token step
    budget."""
    with running_llm(thinker_path, dtype="float32", max_model_len=512, max_num_batched_tokens=32, num_kv_blocks=64,
                     reasoning_parser="deepseek_r1") as engine:
        yield engine


def test_a_thinking_token_budget_forces_the_end_of_thinking(thinker):
    """vLLM's thinking_token_budget: once a request has thought that many tokens (after the last <think> no
    </think> closed, its prompt's included) </think> is forced, greedy or random, and generation goes on as usual;
    a request without a budget, in the same batch, is untouched. A logit_bias keeps the model's own markers out,
    so the budget alone ends the thinking."""
    think, end = thinker.get_tokenizer().convert_tokens_to_ids(["<think>", "</think>"])
    prompt = [{"prompt_token_ids": list(range(200, 300)) + [think]}]  # prefilled in 4 chunks
    thought_in_prompt = [{"prompt_token_ids": [300, think, 5, end, 301, think, 6, 7]}]  # 2 of its thoughts
    common = dict(max_tokens=12, ignore_eos=True, logit_bias={think: -100, end: -100})
    greedy, random, free, prompted, none, huge = (o.outputs[0].token_ids for o in thinker.generate(
        prompt * 3 + thought_in_prompt + prompt * 2,
        [SamplingParams(temperature=0, thinking_token_budget=5, **common),
         SamplingParams(temperature=1.0, top_p=0.9, seed=1, thinking_token_budget=3, **common),
         SamplingParams(temperature=0, **common),
         SamplingParams(temperature=0, thinking_token_budget=4, **common),
         SamplingParams(temperature=0, thinking_token_budget=0, **common),
         SamplingParams(temperature=0, thinking_token_budget=10 ** 30, **common)], use_tqdm=False))
    for tokens, budget in ((greedy, 5), (random, 3), (prompted, 2), (none, 0)):
        assert tokens[budget] == end and tokens.count(end) == 1, (tokens, budget)
    assert end not in free and huge == free
    assert free == thinker.generate(prompt, SamplingParams(temperature=0, **common), use_tqdm=False
                                    )[0].outputs[0].token_ids
    assert greedy[:5] == free[:5]
    # after the forced </think>, the request samples as one whose prompt holds it
    rest = thinker.generate([{"prompt_token_ids": prompt[0]["prompt_token_ids"] + greedy[:6]}],
                            SamplingParams(temperature=0, **{**common, "max_tokens": 6}), use_tqdm=False)
    assert greedy[6:] == rest[0].outputs[0].token_ids


def test_a_reasoning_config_sets_what_a_spent_budget_forces(thinker_path):
    """vLLM's reasoning_config, without a reasoning parser: its start string opens the thinking, and its end string,
    here a phrase before </think>, is what a spent budget forces, token by token, and what ends the thinking."""
    phrase = " Time to answer.</think>"
    with running_llm(thinker_path, dtype="float32", max_model_len=512, num_kv_blocks=64,
                     reasoning_config={"reasoning_start_str": "<think>", "reasoning_end_str": phrase}) as llm:
        tokenizer = llm.get_tokenizer()
        think, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
        forced = tokenizer.encode(phrase, add_special_tokens=False)
        tokens = llm.generate([{"prompt_token_ids": [300, 301, think]}], SamplingParams(
            temperature=0, max_tokens=16, ignore_eos=True, thinking_token_budget=3,
            logit_bias={think: -100, end: -100}), use_tqdm=False)[0].outputs[0].token_ids
    assert len(forced) > 2 and tokens[3:3 + len(forced)] == forced and tokens.count(end) == 1


@pytest.mark.parametrize("kwargs, message", [
    ({"reasoning_parser": "nope"}, "^reasoning_parser 'nope' is not one of deepseek_r1, qwen3"),
    ({"reasoning_config": {"reasoning_end": "</think>"}}, r"^reasoning_config has unknown keys \['reasoning_end'\]"),
    ({"reasoning_config": {"reasoning_end_str": 5}}, "^reasoning_config reasoning_end_str must be a string")])
def test_bad_reasoning_settings_name_the_field(model_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=model_path, **kwargs).create_engine_config()


def test_every_other_setting_is_checked_before_the_reasoning_config_loads_the_tokenizer(model_path, monkeypatch):
    """The reasoning config's token ids need the tokenizer, the slowest thing the config loads: a bad setting fails
    without it."""
    import pagedllm.engine.arg_utils as arg_utils

    monkeypatch.setattr(arg_utils, "load_tokenizer", lambda path: pytest.fail("the tokenizer was loaded"))
    with pytest.raises(ValueError, match="^max_lora_rank must be one of"):
        EngineArgs(model=model_path, reasoning_parser="deepseek_r1", enable_lora=True,
                   max_lora_rank=3).create_engine_config()


def test_a_reasoning_config_without_its_strings_enforces_no_budget(model_path):
    """As vLLM's: without a parser or a start and end string it is not enabled, and a budget is refused."""
    assert EngineArgs(model=model_path, reasoning_config={}).create_engine_config().reasoning_config is None
