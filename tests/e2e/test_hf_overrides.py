"""vLLM's hf_overrides: the model config's fields replaced before the engine reads them. A tiny Llama served with
its rope overridden (linear scaling of another base) generates transformers' greedy tokens for the overridden
config, not the saved one's, and its default context follows the override; a bad override is a ValueError before
any process starts."""
from __future__ import annotations

import pytest
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

from pagedllm import LLM, SamplingParams
from tests.e2e.conftest import assert_transformers_greedy, running_llm
from tests.e2e.test_tiny_models import _save_tiny

ROPE = {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}
PROMPTS = [[1, 50, 60, 70], list(range(200, 237))]


def _greedy(path, **kwargs) -> tuple[list[list[int]], int]:
    with running_llm(str(path), dtype="float32", **kwargs) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                               SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs], llm.llm_engine.config.model_config.max_model_len


def test_overridden_rope_matches_transformers_with_the_overridden_config(tmp_path, tokenizer):
    saved = _save_tiny(tmp_path, tokenizer, LlamaConfig, LlamaForCausalLM, tie_word_embeddings=False)
    overridden, max_model_len = _greedy(tmp_path, hf_overrides={"rope_parameters": ROPE})
    assert max_model_len == 1024  # the saved 512 positions, scaled by 2
    config = AutoConfig.from_pretrained(tmp_path)
    config.rope_parameters = ROPE
    assert_transformers_greedy(LlamaForCausalLM.from_pretrained(tmp_path, config=config).eval(), PROMPTS, overridden,
                               16)
    plain, _ = _greedy(tmp_path)
    assert_transformers_greedy(saved, PROMPTS, plain, 16)
    assert plain != overridden  # the override changed what the model computes


@pytest.mark.parametrize("overrides, message", [
    ("max_position_embeddings=4096", "hf_overrides must be a dict"),
    ({"hidden_act": "swish_and_dance"}, "hidden_act"),
    (lambda config: None, "the callable returned NoneType"),
])
def test_a_bad_override_is_a_value_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        LLM(hf_overrides=overrides)
