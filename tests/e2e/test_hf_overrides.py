"""vLLM's hf_overrides: the model config's fields replaced before the engine reads them. A tiny Llama served with
its rope overridden (linear scaling of another base) generates transformers' greedy tokens for the overridden
config, not the saved one's, and its default context follows the override; a bad override is a ValueError before
any process starts."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.layers.rotary import get_rope
from pagedllm.models.hf_config import apply_hf_overrides, load_hf_config
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


@pytest.mark.parametrize("overrides", [{"rope_scaling": {"type": "linear", "factor": 2.0}}, {"rope_theta": 50.0},
                                       {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 16}}])
def test_legacy_rope_keys_override_as_a_config_json_holding_them(tmp_path, overrides):
    """vLLM's documented {"rope_scaling": ...} override keeps the checkpoint's rope_theta (transformers 5's setter
    dropped it, and the engine process failed), and {"rope_theta": ...} applies (it was ignored): the rope is the one
    transformers reads from a config.json holding those keys beside the checkpoint's."""
    LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=64,
                rope_parameters={"rope_type": "default", "rope_theta": 500.0}).save_pretrained(tmp_path)
    config = apply_hf_overrides(load_hf_config(str(tmp_path)), overrides)
    legacy = json.loads((tmp_path / "config.json").read_text())
    legacy.pop("rope_parameters")
    (tmp_path / "legacy").mkdir()
    (tmp_path / "legacy" / "config.json").write_text(json.dumps({**legacy, "rope_theta": 500.0, **overrides}))
    expected = load_hf_config(str(tmp_path / "legacy"))
    assert torch.equal(get_rope(16, config).cos_sin_cache, get_rope(16, expected).cos_sin_cache)
