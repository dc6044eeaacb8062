"""The rotary table holds, row for row, the cos/sin transformers' rotary embedding gives each position when it
generates one token at a time: a prompt within the original length in one forward, then one position a step."""

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.layers.rope_scaling import positions_served
from pagedllm.layers.rotary import get_rope

HEAD_DIM = 16
ORIGINAL = 16  # the original context: every type's table crosses it
LONGROPE = dict(rope_type="longrope", original_max_position_embeddings=ORIGINAL,
                short_factor=torch.linspace(1.0, 1.5, HEAD_DIM // 2).tolist(),
                long_factor=torch.linspace(1.0, 6.0, HEAD_DIM // 2).tolist())
ROPES = {
    "default": dict(rope_type="default"),
    "linear": dict(rope_type="linear", factor=2.0),
    "dynamic": dict(rope_type="dynamic", factor=3.0),
    "yarn": dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=ORIGINAL),
    "yarn-mscale": dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=ORIGINAL, mscale=1.0,
                        mscale_all_dim=0.5, beta_fast=8, beta_slow=2, truncate=False),
    "longrope": LONGROPE,
    "longrope-attention-factor": {**LONGROPE, "attention_factor": 1.25},
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=ORIGINAL),
}


def _config(rope: dict, max_position_embeddings: int) -> LlamaConfig:
    return LlamaConfig(hidden_size=4 * HEAD_DIM, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=max_position_embeddings, rope_parameters={**rope, "rope_theta": 500.0})


def _transformers_generation_rows(config, num_positions: int, prompt_len: int) -> torch.Tensor:
    """``[num_positions, HEAD_DIM]``: cos/sin (first halves; HF repeats them) for the prompt's positions in one
    forward, then for each later position alone, as transformers' rotary embedding gives them while generating."""
    hf = LlamaRotaryEmbedding(config)
    x = torch.zeros(1, 1, HEAD_DIM)
    steps = [torch.arange(prompt_len)] + [torch.tensor([p]) for p in range(prompt_len, num_positions)]
    rows = []
    for positions in steps:
        cos, sin = hf(x, positions[None])
        rows.append(torch.cat((cos[0, :, : HEAD_DIM // 2], sin[0, :, : HEAD_DIM // 2]), dim=-1))
    return torch.cat(rows)


@pytest.mark.parametrize("name", ROPES)
def test_table_rows_are_transformers_generation_cos_sin(name):
    config = _config(ROPES[name], max_position_embeddings=2 * ORIGINAL)
    rope = get_rope(HEAD_DIM, config)
    served = positions_served(config)
    assert rope.cos_sin_cache.shape == (served, HEAD_DIM)
    # Past the table too: the kernel's IndexError grows it by the same per-position rule.
    num_positions = served + 24
    qk = torch.randn(2, 2 * HEAD_DIM)
    rope(torch.tensor([3, num_positions - 1]), qk)
    assert rope.cos_sin_cache.shape == (num_positions, HEAD_DIM)
    expected = _transformers_generation_rows(config, num_positions, prompt_len=ORIGINAL // 2)
    torch.testing.assert_close(rope.cos_sin_cache, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("scaling, served", [
    (dict(type="linear", factor=4.0), 4 * 32),
    (dict(rope_type="dynamic", factor=2.0), 2 * 32),
    # yarn's max_position_embeddings is already the extended context (vLLM 0.32), also where factor says more
    (dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16), 32),
    (dict(rope_type="yarn", factor=1.5, original_max_position_embeddings=16), 32),  # never fewer than trained
    (LONGROPE, 32),
    (ROPES["llama3"], 32),
])
def test_positions_served_are_vllms_derived_max_model_len(scaling, served):
    assert positions_served(SimpleNamespace(max_position_embeddings=32, rope_scaling=scaling)) == served


def test_legacy_rope_scaling_configs():
    """``rope_scaling`` with ``type`` (before transformers 5), ``rope_theta`` beside it; "su" is longrope's old
    name, and Phi-3's config renames its "yarn" to longrope before the model sees it."""
    legacy = SimpleNamespace(max_position_embeddings=32, rope_theta=500.0, original_max_position_embeddings=ORIGINAL,
                             rope_scaling={**{k: v for k, v in LONGROPE.items() if k != "rope_type"}, "type": "su"})
    expected = get_rope(HEAD_DIM, _config(LONGROPE, max_position_embeddings=32)).cos_sin_cache
    assert torch.equal(get_rope(HEAD_DIM, legacy).cos_sin_cache, expected)
    linear = SimpleNamespace(max_position_embeddings=32, rope_theta=500.0, rope_scaling={"type": "linear", "factor": 2.0})
    assert torch.equal(get_rope(HEAD_DIM, linear).cos_sin_cache,
                       get_rope(HEAD_DIM, _config(ROPES["linear"], max_position_embeddings=32)).cos_sin_cache)
    phi3 = Phi3Config(hidden_size=4 * HEAD_DIM, num_attention_heads=4, max_position_embeddings=32,
                      original_max_position_embeddings=ORIGINAL, rope_theta=500.0,
                      rope_scaling={**{k: v for k, v in LONGROPE.items() if k != "rope_type"}, "type": "yarn"})
    assert torch.equal(get_rope(HEAD_DIM, phi3).cos_sin_cache, expected)


def test_unknown_rope_type_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="'mrope' is not supported"):
        get_rope(HEAD_DIM, SimpleNamespace(max_position_embeddings=32, rope_scaling={"rope_type": "mrope"}))
    # by the engine's config, before any process starts or weight is read
    _config({"rope_type": "foobar", "factor": 2.0}, max_position_embeddings=32).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="rope_scaling: rope_type 'foobar' is not supported"):
        EngineArgs(str(tmp_path)).create_engine_config()


def test_engine_serves_the_positions_the_rope_scaling_serves(tmp_path):
    _config(ROPES["linear"], max_position_embeddings=32).save_pretrained(tmp_path)
    assert EngineArgs(str(tmp_path), max_model_len=64).create_engine_config().model_config.max_model_len == 64
    with pytest.raises(ValueError, match=r"max_model_len \(65\) is larger than the model's max_position_embeddings "
                                         r"\(64, with its rope scaling\)"):
        EngineArgs(str(tmp_path), max_model_len=65).create_engine_config()


def test_yarn_serves_max_position_embeddings(tmp_path):
    """A yarn config as Qwen's model cards have one add it (factor 4 over an original context that is
    max_position_embeddings): vLLM 0.32 serves max_position_embeddings and refuses a longer max_model_len."""
    _config(dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32),
            max_position_embeddings=32).save_pretrained(tmp_path)
    assert EngineArgs(str(tmp_path)).create_engine_config().model_config.max_model_len == 32
    with pytest.raises(ValueError, match=r"max_model_len \(128\) is larger"):
        EngineArgs(str(tmp_path), max_model_len=128).create_engine_config()


def test_longrope_serves_its_original_context_unless_asked(tmp_path):
    """As vLLM's default, a longrope model's max_model_len is its original context (there its rows are transformers'
    for any prompt); a longer one, up to max_position_embeddings, when asked for."""
    _config(LONGROPE, max_position_embeddings=4 * ORIGINAL).save_pretrained(tmp_path)
    def max_model_len(path, **kwargs) -> int:
        return EngineArgs(str(path), **kwargs).create_engine_config().model_config.max_model_len

    assert max_model_len(tmp_path) == ORIGINAL
    assert max_model_len(tmp_path, max_model_len=4 * ORIGINAL) == 4 * ORIGINAL
    _config(ROPES["linear"], max_position_embeddings=ORIGINAL).save_pretrained(tmp_path / "linear")
    assert max_model_len(tmp_path / "linear") == 2 * ORIGINAL


def test_gemma3_global_table_covers_the_served_positions_only():
    """Gemma 3's global layers scale their rope 8 times (linear), but the model serves max_position_embeddings
    positions: their table stops there too (8x the rows, 1 GiB for the 4B model, before)."""
    from transformers import Gemma3TextConfig
    config = Gemma3TextConfig(max_position_embeddings=64, head_dim=16, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})
    tables = {kind: get_rope(16, config, kind).cos_sin_cache for kind in ("sliding_attention", "full_attention")}
    assert [t.shape[0] for t in tables.values()] == [64, 64]
    assert not torch.equal(tables["sliding_attention"], tables["full_attention"])
