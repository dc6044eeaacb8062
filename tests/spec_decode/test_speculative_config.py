"""speculative_config as vLLM takes it: defaults, and every bad value a ValueError naming the field before any
engine starts (the CLI's JSON a usage error)."""
import argparse

import pytest

from pagedllm.config import SpeculativeConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.openai.cli_args import engine_args_from, make_arg_parser


def test_ngram_bounds_default_as_vllms():
    assert (SpeculativeConfig(num_speculative_tokens=3).prompt_lookup_min,
            SpeculativeConfig(num_speculative_tokens=3).prompt_lookup_max) == (5, 5)
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)


@pytest.mark.parametrize("values, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of ngram"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "'draft_model' is not supported yet"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min \\(4\\) must not exceed prompt_lookup_max \\(2\\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown keys \\['lookahead'\\]"),
])
def test_bad_values_are_value_errors_naming_the_field(values, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(values)


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
