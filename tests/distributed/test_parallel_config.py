"""Bad tensor/pipeline/data-parallel settings fail in EngineArgs, before any process starts, naming the field and
the model's numbers (SmolLM2-135M: 9 attention heads, 3 KV heads, 30 layers, intermediate size 1536)."""
from __future__ import annotations

import sys

import pytest

from pagedllm.config import ParallelConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.openai.cli_args import engine_args_from, make_arg_parser


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_parallel_size=2), r"tensor_parallel_size \(2\) must divide the model's number of attention heads "
                                   r"\(9\)"),
    (dict(tensor_parallel_size=9), r"tensor_parallel_size \(9\) must divide the model's intermediate_size"),
    (dict(pipeline_parallel_size=31), r"pipeline_parallel_size \(31\) is larger than the model's number of layers "
                                      r"\(30\)"),
    (dict(tensor_parallel_size=0), r"tensor_parallel_size must be a positive integer"),
    (dict(tensor_parallel_size=3, distributed_executor_backend="uni"), r"'uni' runs one rank"),
    (dict(distributed_executor_backend="slurm"), r"distributed_executor_backend must be one of uni, mp, ray"),
])
def test_bad_parallel_settings_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs).create_engine_config()


def test_kv_heads_neither_divided_nor_multiple():
    class Config:  # 8 heads, 6 KV heads: tp=4 divides the heads, neither divides nor is a multiple of 6
        num_attention_heads, num_key_value_heads, num_hidden_layers, intermediate_size, hidden_size = 8, 6, 4, 64, 64
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(4\) must divide the model's number of KV heads "
                                         r"\(6\) or be a multiple of it"):
        ParallelConfig(tensor_parallel_size=4).verify_with_model(Config)


def test_ray_without_ray_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(ValueError, match=r"pip install 'pagedllm\[ray\]'"):
        EngineArgs(tensor_parallel_size=3, distributed_executor_backend="ray").create_engine_config()


def test_default_backend_and_stages():
    assert EngineArgs().create_engine_config().parallel_config.distributed_executor_backend == "uni"
    config = EngineArgs(pipeline_parallel_size=4).create_engine_config().parallel_config
    assert config.distributed_executor_backend == "mp" and config.world_size == 4
    assert [config.stage_layers(stage, 30) for stage in range(4)] == [(0, 7), (7, 14), (14, 22), (22, 30)]


def test_pp_layer_partition_from_env(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_PP_LAYER_PARTITION", "10,20")
    config = EngineArgs(pipeline_parallel_size=2).create_engine_config().parallel_config
    assert [config.stage_layers(stage, 30) for stage in range(2)] == [(0, 10), (10, 30)]
    monkeypatch.setenv("PAGEDLLM_PP_LAYER_PARTITION", "10,10")
    with pytest.raises(ValueError, match="pp_layer_partition"):
        EngineArgs(pipeline_parallel_size=2).create_engine_config()


def test_serve_flags_as_vllm():
    import argparse
    args = make_arg_parser(argparse.ArgumentParser()).parse_args(["-tp", "3", "-pp", "1", "--distributed-executor-backend",
                                                                 "mp"])
    engine_args = engine_args_from(args)
    assert (engine_args.tensor_parallel_size, engine_args.pipeline_parallel_size,
            engine_args.distributed_executor_backend) == (3, 1, "mp")
