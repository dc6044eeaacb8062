"""The offline LLM samples with the generation config's defaults when generate() gets no sampling_params, as
vLLM's LLM.get_default_sampling_params(); given ones are used as they are."""
from __future__ import annotations

import json

import pytest

from pagedllm import SamplingParams
from tests.e2e.conftest import in_process_llm


def test_llm_defaults_come_from_the_generation_config(tmp_path):
    """vLLM's override_generation_config (in the generation config's names) goes over the file's values."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5,
                                                                 "repetition_penalty": 1.25}))
    llm = in_process_llm(dtype="float32", max_model_len=256, kv_cache_memory="32MiB",
                         generation_config=str(tmp_path), override_generation_config={"max_new_tokens": 4})
    try:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.max_tokens, defaults.repetition_penalty) == (0.0, 4, 1.25)
        prompt = "The capital of France is"
        by_default = llm.generate(prompt, use_tqdm=False)[0].outputs[0]
        greedy = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4, repetition_penalty=1.25),
                              use_tqdm=False)[0].outputs[0]
        assert by_default.token_ids == greedy.token_ids and len(greedy.token_ids) == 4
        assert len(llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2),
                                use_tqdm=False)[0].outputs[0].token_ids) == 2
    finally:
        llm.shutdown()


def test_every_eos_id_of_the_generation_config_ends_generation(tmp_path):
    """The generation config's eos_token_id list (Llama 3 Instruct's <|eot_id|> and <|eom_id|> beside
    <|end_of_text|>) ends generation as the tokenizer's EOS does (vLLM's update_from_generation_config): a stop token
    of every request that does not ignore EOS, which min_tokens holds back like EOS."""
    prompt = "The capital of France is"
    llm = in_process_llm(dtype="float32", max_model_len=256, kv_cache_memory="32MiB")
    try:
        tokens = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0].outputs[0]
    finally:
        llm.shutdown()
    eos = llm.get_tokenizer().eos_token_id
    end = next(t for t in tokens.token_ids[1:] if t not in tokens.token_ids[:1])  # a token that comes second
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, end]}))
    llm = in_process_llm(dtype="float32", max_model_len=256, kv_cache_memory="32MiB",
                         generation_config=str(tmp_path))
    try:
        ended = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0].outputs[0]
        at = tokens.token_ids.index(end)
        assert ended.token_ids == tokens.token_ids[:at + 1] and ended.finish_reason == "stop"
        ignoring = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0]
        assert ignoring.token_ids == tokens.token_ids
        held = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
        assert end not in held.token_ids  # min_tokens holds it back, ignore_eos or not (vLLM's all_stop_token_ids)
    finally:
        llm.shutdown()


def test_a_bad_override_generation_config_is_a_value_error_naming_it():
    for overrides, message in [("temperature=0", "override_generation_config must be a dict"),
                               ({"temperature": -1.0}, "override_generation_config .*temperature")]:
        with pytest.raises(ValueError, match=message):
            in_process_llm(override_generation_config=overrides)
