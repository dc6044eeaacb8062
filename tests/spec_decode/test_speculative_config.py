"""speculative_config as vLLM takes it: defaults, and every bad value a ValueError naming the field before any
engine starts (the CLI's JSON a usage error)."""
import argparse
import re

import pytest
from transformers import LlamaConfig

from pagedllm.config import SpeculativeConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.openai.cli_args import engine_args_from, make_arg_parser


def test_ngram_bounds_default_as_vllms():
    assert (SpeculativeConfig(method="ngram", num_speculative_tokens=3).prompt_lookup_min,
            SpeculativeConfig(method="ngram", num_speculative_tokens=3).prompt_lookup_max) == (5, 5)
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)


@pytest.mark.parametrize("values, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of ngram, draft_model, suffix"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "'draft_model' needs model"),
    ({"method": "ngram", "model": "x", "num_speculative_tokens": 2}, "model and quantization are for method"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob must be in"),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth must be a"),
    ({"method": "suffix", "suffix_decoding_max_cached_requests": -1},  # 0 is vLLM's "no global tree"
     "suffix_decoding_max_cached_requests must be a non-negative integer"),
    ({"method": "suffix", "suffix_decoding_max_spec_factor": -0.5}, "max_spec_factor must be a non-negative number"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"num_speculative_tokens": 2}, "needs a method, or a model"),  # vLLM: "... but without speculative model"
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min \\(4\\) must not exceed prompt_lookup_max \\(2\\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown keys \\['lookahead'\\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "tensor_parallel_size": 1},
     "'tensor_parallel_size' is not a valid argument in the speculative_config. Please pass "
     "'draft_tensor_parallel_size' instead."),
    ({"model": "m", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 0},
     "draft_tensor_parallel_size must be a positive integer"),
    ({"model": 5, "num_speculative_tokens": 2}, "speculative_config model must be a string"),
    # vLLM's ge=1 holds for every method, also one that ignores the field
    ({"method": "suffix", "prompt_lookup_max": 0}, "prompt_lookup_max must be a positive integer"),
    ({"model": "m", "num_speculative_tokens": 2, "prompt_lookup_min": "3"}, "prompt_lookup_min must be a positive"),
    ({"model": "m", "num_speculative_tokens": 2, "max_model_len": 0}, "max_model_len must be a positive integer"),
    ({"model": "m", "num_speculative_tokens": 2, "enforce_eager": "yes"}, "enforce_eager must be True or False"),
    # vLLM's keys for what is not done here, refused by name unless at vLLM's default
    ({"model": "m", "num_speculative_tokens": 2, "draft_sample_method": "probabilistic"},
     "^speculative_config draft_sample_method \\(vLLM's\\) is not supported here; leave it out or 'greedy'$"),
    ({"model": "m", "num_speculative_tokens": 2, "revision": "main"}, "^speculative_config revision \\(vLLM's\\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "block"},
     "rejection_sample_method \\(vLLM's\\) is not supported here; leave it out or 'standard'"),
])
def test_bad_values_are_value_errors_naming_the_field(values, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(values)


def test_model_alone_means_a_draft_model_and_suffix_speculates_up_to_its_tree_depth():
    assert SpeculativeConfig.from_dict({"model": "m", "num_speculative_tokens": 2}).method == "draft_model"
    # vLLM's older spellings of the ngram method: a model named ngram, and "[ngram]".
    for values in ({"model": "ngram"}, {"model": "[ngram]"}, {"method": "[ngram]"},
                   {"method": "ngram", "model": "ngram"}):
        config = SpeculativeConfig.from_dict({**values, "num_speculative_tokens": 2})
        assert (config.method, config.model, config.prompt_lookup_min) == ("ngram", None, 5), values
    assert SpeculativeConfig.from_dict({"method": "suffix"}).num_speculative_tokens == 24
    assert SpeculativeConfig.from_dict({"method": "suffix", "suffix_decoding_max_tree_depth": 8}
                                       ).num_speculative_tokens == 8


def draft_config_dir(tmp_path, **overrides) -> str:
    """A model directory with just its config.json: all EngineArgs reads of a draft before any process starts."""
    values = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=8192)
    values.update(overrides)
    LlamaConfig(**values).save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize("overrides, extra, message", [
    ({"vocab_size": 8}, {}, "has a vocabulary of 8 tokens; the target model's has 49152"),
    ({"max_position_embeddings": 256}, {}, r"holds 256 positions \(max_position_embeddings\), fewer than the "
                                           r"target's max_model_len \(1024\)"),
    ({}, {"tensor_parallel_size": 3}, "'draft_model' is not supported with tensor_parallel_size > 1"),
    # what the layers do not compute, as for the target (it failed in the engine process)
    ({"hidden_act": "gelu"}, {}, "speculative_config model '.*': hidden_act: 'gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "foobar", "rope_theta": 1e4}}, {}, "rope_type 'foobar' is not supported"),
])
def test_a_draft_model_that_does_not_fit_the_target_is_refused_before_any_process(tmp_path, overrides, extra,
                                                                                  message):
    spec = {"model": draft_config_dir(tmp_path, **overrides), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=message):
        EngineArgs(max_model_len=1024, speculative_config=spec, **extra).create_engine_config()


def test_a_draft_model_that_is_not_there_is_a_value_error_naming_it(tmp_path):
    for model in (str(tmp_path / "missing"), str(tmp_path)):  # no such path; a directory without a config.json
        with pytest.raises(ValueError, match=f"speculative_config model '{re.escape(model)}': "):
            EngineArgs(speculative_config={"model": model, "num_speculative_tokens": 2}).create_engine_config()


def test_vllms_keys_at_their_defaults_ask_for_what_happens_here():
    values = {"model": "m", "num_speculative_tokens": 2, "draft_sample_method": "greedy",
              "rejection_sample_method": "standard", "revision": None, "parallel_drafting": False}
    assert SpeculativeConfig.from_dict(values).method == "draft_model"


def test_max_model_len_caps_the_drafts_context_within_the_draft_and_the_target(tmp_path):
    """vLLM's speculative_config max_model_len: a draft holding fewer positions than the target's max_model_len serves
    within it; it may exceed neither the draft's positions nor the target's max_model_len (vLLM's checks).
    enforce_eager is the draft's own."""
    spec = {"model": draft_config_dir(tmp_path, max_position_embeddings=256), "num_speculative_tokens": 2,
            "max_model_len": 256, "enforce_eager": True}
    draft = EngineArgs(max_model_len=1024, speculative_config=spec).create_engine_config(
        ).speculative_config.draft_model_config
    assert (draft.max_model_len, draft.enforce_eager) == (256, True)
    for max_model_len, message in ((512, r"holds 256 positions \(max_position_embeddings\), fewer than "
                                         r"speculative_config max_model_len \(512\)"),
                                   (2048, r"max_model_len \(2048\) cannot be larger than the target's max_model_len "
                                          r"\(1024\)")):
        with pytest.raises(ValueError, match=message):
            EngineArgs(max_model_len=1024, speculative_config={**spec, "max_model_len": max_model_len}
                       ).create_engine_config()


def test_draft_tensor_parallel_size_is_vllms_one_or_the_targets(tmp_path):
    """vLLM's key: 1 or the target's tensor_parallel_size for a draft model; ignored by the other methods."""
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2,
                                        "draft_tensor_parallel_size": 4}).method == "ngram"
    spec = {"model": draft_config_dir(tmp_path), "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}
    config = EngineArgs(max_model_len=1024, speculative_config=spec).create_engine_config()
    assert config.speculative_config.draft_model_config is not None
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=2 cannot be other value than 1 or target"):
        EngineArgs(max_model_len=1024, speculative_config={**spec, "draft_tensor_parallel_size": 2}
                   ).create_engine_config()


def test_a_draft_quantization_the_draft_cannot_take_is_refused(tmp_path):
    spec = {"model": draft_config_dir(tmp_path), "quantization": "gguf_int4", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="needs a .gguf model"):
        EngineArgs(max_model_len=1024, speculative_config=spec).create_engine_config()


def test_engine_args_refuse_pipeline_parallel_before_any_process():
    args = EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2}, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="not supported with pipeline_parallel_size > 1"):
        args.create_engine_config()


def test_the_flag_takes_a_json_object():
    parser = make_arg_parser(argparse.ArgumentParser())
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert engine_args_from(args).speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    for bad in ('{"method": "ngram"', '[1, 2]'):
        with pytest.raises(SystemExit):
            parser.parse_args(["--speculative-config", bad])
