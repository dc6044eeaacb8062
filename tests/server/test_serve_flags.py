"""vLLM's operational flags of `pagedllm serve`: one server takes them all at once (HTTPS with client certificates
on a Unix socket under a root path, CORS for one origin, request logs, max_logprobs, response role, its own
tokenizer); the flags' parsing, their checks before the engine starts and their match with EngineArgs are checked
without a server."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import shutil
import socket
import ssl
import subprocess
import time

import httpx
import psutil
import pytest

from pagedllm.config import SERVE_MAX_PREFILL_TOKENS_WITH_DECODES
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.processor import Processor
from pagedllm.entrypoints import cli
from pagedllm.entrypoints.openai.api_server import api_keys_from
from pagedllm.entrypoints.openai.cli_args import ENGINE_FLAGS, engine_args_from, make_arg_parser, serve_engine_args
from pagedllm.sampling_params import SamplingParams
from tests.server.conftest import API_KEY, RemoteServer

GOOD_ORIGIN = "http://good.example"
ROOT_PATH = "/api"
MAX_LOG_LEN = 7
MAX_LOGPROBS = 3
# The --tokenizer's own chat template: the bare message contents, so its use shows in /tokenize.
PLAIN_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def _parse(*argv: str) -> argparse.Namespace:
    return make_arg_parser(argparse.ArgumentParser()).parse_args(list(argv))


def test_every_engine_args_field_is_a_flag_with_its_default():
    args = _parse()
    assert set(ENGINE_FLAGS) == {f.name for f in dataclasses.fields(EngineArgs)} - {"model"}
    for name in ENGINE_FLAGS:
        assert hasattr(args, name), f"EngineArgs.{name} has no `pagedllm serve` flag"
    assert engine_args_from(args) == EngineArgs()


def test_engine_flags_reach_engine_args():
    engine = engine_args_from(_parse("--no-enable-chunked-prefill", "--long-prefill-token-threshold", "64",
                                     "--num-kv-blocks", "32", "--max-logprobs", "5", "--tokenizer", "tok",
                                     "--max-prefill-tokens-with-decodes", "64", "--kv-cache-populate", "startup",
                                     "--logprobs-mode", "processed_logprobs"))
    assert (engine.enable_chunked_prefill, engine.long_prefill_token_threshold, engine.num_kv_blocks,
            engine.max_logprobs, engine.tokenizer, engine.max_prefill_tokens_with_decodes,
            engine.kv_cache_populate, engine.logprobs_mode) == (False, 64, 32, 5, "tok", 64, "startup",
                                                                "processed_logprobs")
    # vLLM's JSON and on/off engine flags its command lines carry
    engine = engine_args_from(_parse("--hf-overrides", '{"max_position_embeddings": 4096}', "--trust-remote-code",
                                     "--override-generation-config", '{"temperature": 0.5}', "--disable-log-stats",
                                     "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json",
                                     "--tokenizer-mode", "hf", "--load-format", "safetensors"))
    assert (engine.hf_overrides, engine.override_generation_config, engine.trust_remote_code,
            engine.disable_log_stats, engine.tokenizer_mode, engine.load_format) == (
        {"max_position_embeddings": 4096}, {"temperature": 0.5}, True, True, "hf", "safetensors")


def test_token_counts_take_vllms_human_readable_forms(capsys):
    """vLLM's human_readable_int: k, m, g, t are powers of 1000 (decimals allowed), K, M, G, T powers of 1024."""
    args = _parse("--max-model-len", "4k", "--max-num-batched-tokens", "8K")
    assert (args.max_model_len, args.max_num_batched_tokens) == (4000, 8192)
    assert (_parse("--max-model-len", "25.6k").max_model_len, _parse("--max-model-len", "2048").max_model_len) == (
        25600, 2048)
    assert _parse("--max-model-len", "auto").max_model_len == _parse("--max-model-len", "-1").max_model_len == -1
    for value, message in [("1.5K", "decimals are not allowed with binary suffixes like K"), ("lots", "'lots'")]:
        with pytest.raises(SystemExit):
            _parse("--max-model-len", value)
        assert message in capsys.readouterr().err


def test_attention_backend_takes_vllms_names(capsys):
    """--attention-backend as vLLM's: any case, "auto" (the platform's default), its CPU_ATTN (TORCH_SDPA here); a name
    with no backend here is refused with the choices."""
    assert [_parse("--attention-backend", name).attention_backend for name in ("auto", "cpu_attn", "triton_attn")] == [
        None, "TORCH_SDPA", "TRITON_ATTN"]
    with pytest.raises(SystemExit):
        _parse("--attention-backend", "flash_attn")
    assert "must be one of auto, TORCH_SDPA, TRITON_ATTN, CPU_ATTN; got 'flash_attn'" in capsys.readouterr().err


def test_vllms_kv_cache_memory_bytes_sizes_the_cache():
    """vLLM's --kv-cache-memory-bytes (its CPU backend's knob too), in vLLM's human-readable form, sizes the cache as
    --kv-cache-memory does; both at once is an error naming both."""
    args = _parse("--kv-cache-memory-bytes", "1G")
    assert args.kv_cache_memory_bytes == 1 << 30
    assert engine_args_from(args).create_engine_config().cache_config.kv_cache_memory == 1 << 30
    with pytest.raises(ValueError, match="kv_cache_memory and kv_cache_memory_bytes"):
        engine_args_from(_parse("--kv-cache-memory-bytes", "1G", "--kv-cache-memory", "1GiB")).create_engine_config()


def test_vllms_num_gpu_blocks_override_sets_the_blocks():
    """vLLM's --num-gpu-blocks-override (LLM's num_gpu_blocks_override) sets the cache's blocks as --num-kv-blocks
    does; both at once is an error naming both."""
    args = _parse("--num-gpu-blocks-override", "32")
    assert engine_args_from(args).create_engine_config().cache_config.num_blocks == 32
    with pytest.raises(ValueError, match="num_kv_blocks and num_gpu_blocks_override"):
        engine_args_from(_parse("--num-gpu-blocks-override", "32", "--num-kv-blocks", "16")).create_engine_config()


def test_the_server_bounds_prefill_beside_decodes_unless_told():
    assert serve_engine_args(_parse()).max_prefill_tokens_with_decodes == SERVE_MAX_PREFILL_TOKENS_WITH_DECODES
    assert serve_engine_args(_parse("--max-prefill-tokens-with-decodes", "0")).max_prefill_tokens_with_decodes == 0
    assert EngineArgs().create_engine_config().scheduler_config.max_prefill_tokens_with_decodes == 0  # LLM()


def test_vllms_scheduler_reserve_full_isl_is_on_unless_turned_off():
    """vLLM's --scheduler-reserve-full-isl (on by default) and its --no- form reach the scheduler's config; an on/off
    value that is not a bool is a ValueError naming the field."""
    assert EngineArgs().create_engine_config().scheduler_config.scheduler_reserve_full_isl is True
    args = _parse("--no-scheduler-reserve-full-isl")
    assert engine_args_from(args).create_engine_config().scheduler_config.scheduler_reserve_full_isl is False
    assert _parse("--scheduler-reserve-full-isl").scheduler_reserve_full_isl is True
    with pytest.raises(ValueError, match="scheduler_reserve_full_isl must be True or False"):
        EngineArgs(scheduler_reserve_full_isl="false").create_engine_config()


def processor_of(model_config) -> Processor:
    """A Processor with only the model's config, which validate_logprobs reads (no tokenizer, no generation
    config)."""
    processor = Processor.__new__(Processor)
    processor.model_config = model_config
    return processor


def test_max_logprobs_bounds_requests_for_llm_too(tmp_path):
    model_config = EngineArgs(max_logprobs=-1, tokenizer=str(tmp_path)).create_engine_config().model_config
    assert model_config.tokenizer == str(tmp_path)
    processor = processor_of(model_config)
    Processor.validate_logprobs(processor, SamplingParams(logprobs=model_config.vocab_size))  # -1: the vocabulary
    with pytest.raises(ValueError, match=f"^prompt_logprobs must be at most {model_config.vocab_size}"):
        Processor.validate_logprobs(processor, SamplingParams(prompt_logprobs=model_config.vocab_size + 1))
    # A request's -1 is the whole vocabulary (vLLM's), which the engine's default max_logprobs (20) refuses.
    assert Processor.validate_logprobs(processor, SamplingParams(logprobs=-1)).logprobs == model_config.vocab_size
    bounded = processor_of(EngineArgs(tokenizer=str(tmp_path)).create_engine_config().model_config)
    with pytest.raises(ValueError, match=f"^logprobs must be at most 20 .* got {model_config.vocab_size}"):
        Processor.validate_logprobs(bounded, SamplingParams(logprobs=-1))
    with pytest.raises(ValueError, match="^logprobs must be non-negative, or -1"):
        SamplingParams(logprobs=-2)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_logprobs": -2}, "max_logprobs must be at least -1, got -2"),  # vLLM's ModelConfig: ge=-1
    ({"max_logprobs": "20"}, "max_logprobs must be an integer, got '20'"),
    ({"seed": None}, "seed must be an integer, got None"),  # torch.manual_seed would fail in the engine process
    ({"seed": "abc"}, "seed must be an integer, got 'abc'"),
    ({"gpu_memory_utilization": "0.5"}, "gpu_memory_utilization must be a number in (0, 1], got '0.5'"),
    ({"num_cpu_threads": "4"}, "num_cpu_threads must be an integer, got '4'"),
    ({"stream_interval": 0}, "stream_interval must be at least 1, got 0"),
    # vLLM's mistral_common tokenizer, which would tokenize and render chats otherwise than the HF one loaded here
    ({"tokenizer_mode": "mistral"}, "tokenizer_mode must be one of auto, hf (the Hugging Face tokenizer); got "
                                    "'mistral'"),
    ({"logprobs_mode": "processed"}, "logprobs_mode must be one of raw_logits, raw_logprobs, processed_logits, "
                                     "processed_logprobs, got 'processed'"),
])
def test_engine_values_of_the_wrong_kind_fail_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        EngineArgs(**kwargs).create_engine_config()


def test_vllms_compilation_config_is_taken_and_cudagraph_mode_none_runs_eagerly():
    """vLLM's compilation_config (LLM's kwarg, --compilation-config / -cc): a mode or CompilationConfig's fields.
    cudagraph_mode NONE turns CPU graphs off as enforce_eager does; the other fields (torch.compile's, the capture
    sizes, which vLLM's CPU backend drops too) leave them on; what vLLM refuses is a ValueError naming it."""
    def eager(compilation_config) -> bool:
        return EngineArgs(compilation_config=compilation_config).create_engine_config().model_config.enforce_eager

    assert eager({"cudagraph_mode": "none"}) and eager({"mode": 3, "cudagraph_mode": "NONE"})
    assert not any(eager(value) for value in (None, 3, {"cudagraph_capture_sizes": [1, 2, 4]},
                                              {"mode": "VLLM_COMPILE", "cudagraph_mode": "FULL_AND_PIECEWISE"}))
    assert _parse("-cc", "3").compilation_config == 3
    assert engine_args_from(_parse("--compilation-config", '{"cudagraph_mode": "NONE"}')).compilation_config == {
        "cudagraph_mode": "NONE"}
    for value, message in (({"cuda_graph_sizes": [1]}, "compilation_config has no field 'cuda_graph_sizes'"),
                           ({"cudagraph_mode": "OFF"}, "compilation_config cudagraph_mode must be one of"),
                           (7, "compilation_config mode must be 0-3")):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
            eager(value)


def test_vllms_spec_shortcuts_set_speculative_config_keys():
    """vLLM's --spec-method, --spec-model and --spec-tokens set their speculative_config keys (-sc is
    --speculative-config); a key set both ways is vLLM's error."""
    args = engine_args_from(_parse("--spec-method", "ngram", "--spec-tokens", "3"))
    spec = args.create_engine_config().speculative_config
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 3)
    args = engine_args_from(_parse("-sc", '{"method": "ngram", "prompt_lookup_max": 4}', "--spec-tokens", "2"))
    spec = args.create_engine_config().speculative_config
    assert (spec.num_speculative_tokens, spec.prompt_lookup_max, args.speculative_config) == (
        2, 4, {"method": "ngram", "prompt_lookup_max": 4})  # the caller's dict unchanged
    message = "--spec-tokens and --speculative-config['num_speculative_tokens'] are mutually exclusive"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        EngineArgs(spec_tokens=2, speculative_config={"method": "ngram", "num_speculative_tokens": 4}
                   ).create_engine_config()
    with pytest.raises(ValueError, match="^speculative_config must be a dict"):
        EngineArgs(spec_tokens=2, speculative_config="ngram").create_engine_config()


def test_vllms_structured_outputs_config_sets_the_requests_whitespace_default():
    """vLLM's --structured-outputs-config: its backend may name xgrammar (the one here), and disable_any_whitespace
    is what a request that does not say gets (compact JSON unless told)."""
    assert EngineArgs().create_engine_config().structured_outputs_config.disable_any_whitespace is True
    args = engine_args_from(_parse("--structured-outputs-config", '{"backend": "xgrammar", '
                                                                   '"disable_any_whitespace": false}'))
    config = args.create_engine_config().structured_outputs_config
    assert (config.backend, config.disable_any_whitespace) == ("xgrammar", False)


def test_vllms_profiler_config_reaches_the_engine_config():
    """vLLM's --profiler-config: the torch profiler and its directory (made absolute, as vLLM's) for start_profile;
    off by default; a key not offered is an error naming it."""
    assert EngineArgs().create_engine_config().profiler_config.profiler is None
    args = engine_args_from(_parse("--profiler-config", json.dumps({"profiler": "torch", "torch_profiler_dir": "t"})))
    config = args.create_engine_config().profiler_config
    assert (config.profiler, config.torch_profiler_dir) == ("torch", os.path.abspath("t"))
    with pytest.raises(ValueError, match="profiler_config.*delay_iterations"):
        EngineArgs(profiler_config={"profiler": "torch", "torch_profiler_dir": "t",
                                    "delay_iterations": 2}).create_engine_config()


def test_vllms_optimization_level_0_runs_eagerly():
    """vLLM's -O0 (--optimization-level 0) sets cudagraph_mode NONE where compilation_config leaves it: no CPU
    graphs; the other levels leave them on, and compilation_config's cudagraph_mode wins over the level's."""
    command_lines = (["-O0"], ["-O", "1"], ["-O=3"], ["--optimization-level", "0"], [])
    assert [_parse(*argv).optimization_level for argv in command_lines] == [0, 1, 3, 0, 2]

    def eager(**kwargs) -> bool:
        return EngineArgs(**kwargs).create_engine_config().model_config.enforce_eager

    assert eager(optimization_level=0) and not eager(optimization_level=3)
    assert not eager(optimization_level=0, compilation_config={"cudagraph_mode": "FULL"})
    assert eager(optimization_level=3, compilation_config={"cudagraph_mode": "NONE"})
    for level in (4, 2.0, True):  # vLLM's level is an int
        with pytest.raises(ValueError, match=f"^optimization_level must be 0, 1, 2 or 3, got {level}$"):
            eager(optimization_level=level)


def test_vllms_capture_size_shortcuts_are_taken_but_not_beside_their_compilation_config_fields():
    args = engine_args_from(_parse("--cudagraph-capture-sizes", "1", "2", "4", "--max-cudagraph-capture-size", "4"))
    assert (args.cudagraph_capture_sizes, args.max_cudagraph_capture_size) == ([1, 2, 4], 4)
    assert not args.create_engine_config().model_config.enforce_eager
    for kwargs, message in (
            ({"cudagraph_capture_sizes": [8], "compilation_config": {"cudagraph_capture_sizes": [8]}},
             "cudagraph_capture_sizes and compilation_config.cudagraph_capture_sizes are mutually exclusive"),
            ({"max_cudagraph_capture_size": "8"}, "max_cudagraph_capture_size must be an integer, got '8'"),
            ({"cudagraph_capture_sizes": [1, 0]}, "cudagraph_capture_sizes must be at least 1, got 0")):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            EngineArgs(**kwargs).create_engine_config()


def test_vllms_on_off_flags_take_their_no_forms():
    """vLLM's boolean flags are argparse.BooleanOptionalAction: --x and --no-x (the last one given wins)."""
    names = ("enforce_eager", "enable_lora", "enable_expert_parallel", "enable_log_requests", "allow_credentials",
             "disable_uvicorn_access_log", "enable_auto_tool_choice", "exclude_tools_when_tool_choice_none")
    flags = [f"--{name.replace('_', '-')}" for name in names]
    on = _parse(*flags)
    assert all(getattr(on, name) is True for name in names)
    off = _parse(*flags, *[f"--no-{flag[2:]}" for flag in flags])
    assert all(getattr(off, name) is False for name in names)
    assert _parse("-ep").enable_expert_parallel is True


def test_several_api_keys_or_the_environments(monkeypatch):
    """vLLM's --api-key takes several keys (any of them authenticates: test_errors'
    test_api_key_scheme_is_case_insensitive); without it PAGEDLLM_API_KEY is the key, else vLLM's VLLM_API_KEY (a
    server moved from vLLM with its key in the environment must not come up open)."""
    monkeypatch.delenv("PAGEDLLM_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    args = _parse("--api-key", "k1", "k2")
    assert (api_keys_from(args), api_keys_from(_parse())) == (["k1", "k2"], [])
    monkeypatch.setenv("VLLM_API_KEY", "vllm-key")
    assert api_keys_from(_parse()) == ["vllm-key"]
    monkeypatch.setenv("PAGEDLLM_API_KEY", "env-key")
    assert (api_keys_from(args), api_keys_from(_parse())) == (["k1", "k2"], ["env-key"])  # the flag wins


def test_frontend_flag_defaults_and_json_lists():
    args = _parse()
    assert (args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials) == (
        [], ["*"], ["*"], False)  # vLLM 0.32's: no cross-origin browser access unless origins are named
    assert (args.enable_log_requests, args.max_log_len, args.response_role, args.uds, args.root_path) == (
        False, None, "assistant", None, None)
    assert _parse("--allowed-origins", json.dumps([GOOD_ORIGIN])).allowed_origins == [GOOD_ORIGIN]
    with pytest.raises(SystemExit):
        _parse("--allowed-origins", GOOD_ORIGIN)  # not a JSON list


def test_default_chat_template_kwargs_under_the_requests(tokenizer):
    """vLLM's --default-chat-template-kwargs: template variables for every chat request, under its own
    chat_template_kwargs (one set to None or "auto" leaves the default, as vLLM's merge_kwargs)."""
    from types import SimpleNamespace

    from pagedllm.entrypoints.openai.protocol import TokenizeChatRequest
    from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

    defaults = _parse("--default-chat-template-kwargs", '{"greeting": "Hi", "name": "Ann"}')
    models = SimpleNamespace(check_model=lambda model: model, max_model_len=64)
    serving = OpenAIServingTokenization(tokenizer, models, "{{ greeting }} {{ name }}: {{ messages[0]['content'] }}",
                                        defaults.default_chat_template_kwargs)

    def rendered(**chat_template_kwargs) -> str:
        request = TokenizeChatRequest(messages=[{"role": "user", "content": "x"}],
                                      chat_template_kwargs=chat_template_kwargs or None)
        return tokenizer.decode(serving.create_tokenize(request).tokens)

    assert rendered() == "Hi Ann: x"
    assert rendered(greeting="Yo", name=None) == rendered(greeting="Yo", name="auto") == "Yo Ann: x"


def test_disable_access_log_for_endpoints():
    """vLLM's --disable-access-log-for-endpoints: uvicorn's access log records of requests to those paths (the query
    string aside) are dropped, others kept."""
    from pagedllm.entrypoints.openai.api_server import AccessLogFilter

    log_filter = AccessLogFilter(_parse("--disable-access-log-for-endpoints", "/health, /metrics")
                                 .disable_access_log_for_endpoints)

    def logged(path: str) -> bool:
        return log_filter.filter(logging.LogRecord("uvicorn.access", logging.INFO, __file__, 0,
                                                   '%s - "%s %s HTTP/%s" %d', ("127.0.0.1:1", "GET", path, "1.1", 200),
                                                   None))

    assert not logged("/health") and not logged("/metrics?name=x")
    assert logged("/v1/models") and logged("/health/more")


def test_engine_commands_start_the_fork_server_first_thing():
    """cli._starts_engines reads the command before the arguments are parsed (the fork server its engines are forked
    from starts first thing, launch.py): serve and run-batch, whatever their flags; no other command."""
    assert cli._starts_engines(["serve", "--port", "8000"]) and cli._starts_engines(["serve", "-dp", "2"])
    assert cli._starts_engines(["run-batch", "--data-parallel-size", "16"])
    assert not cli._starts_engines(["chat"]) and not cli._starts_engines([])


@pytest.fixture
def served(monkeypatch):
    """What `serve` would have been called with, instead of serving."""
    calls: list[argparse.Namespace] = []
    monkeypatch.setattr(cli, "serve", calls.append)
    return calls


def test_bad_flags_are_errors_before_the_engine_starts(tmp_path, served, capsys):
    key, cert, missing = tmp_path / "key.pem", tmp_path / "cert.pem", tmp_path / "missing.pem"
    key.write_text("key")
    cert.write_text("cert")
    before = {p.pid for p in psutil.Process().children()}  # the session's shared servers, if started
    for argv, message in [
        (["--shutdown-timeout", "-1"], "--shutdown-timeout must be 0 or more seconds, got -1"),
        (["--ssl-keyfile", str(missing), "--ssl-certfile", str(cert)],
         f"--ssl-keyfile {missing}: No such file or directory"),
        (["--ssl-certfile", str(tmp_path)], f"--ssl-certfile {tmp_path}: Is a directory"),
        (["--ssl-certfile", str(cert), "--ssl-ca-certs", str(missing)], f"--ssl-ca-certs {missing}:"),
        (["--ssl-keyfile", str(key)], "--ssl-keyfile needs --ssl-certfile"),
        (["--ssl-cert-reqs", "2"], "need HTTPS (--ssl-certfile)"),
        (["--ssl-ca-certs", str(cert)], "need HTTPS (--ssl-certfile)"),
        (["--ssl-certfile", str(cert), "--ssl-cert-reqs", "3"], "invalid choice: 3"),
        (["--lora-modules", "a=b"], "need --enable-lora"),
        (["--enable-lora", "--max-lora-rank", "4"], "invalid choice: 4"),  # vLLM's MaxLoRARanks
        (["--port", "70000"], "--port must be in 0-65535, got 70000"),
        (["--enable-log-outputs"], "--enable-log-outputs needs --enable-log-requests"),
        # vLLM's rule: the model after --served-model-name's names was served as one more name (the default model)
        (["--port", "8001", "--served-model-name", "name", "/models/llama"], "the model must be the first argument"),
        (["--kv-cache-memory", "lots"], "a size like '2GiB'"),
        (["--tool-call-parser", "nosuch"], "--tool-call-parser nosuch: no such format (choose from hermes,"),
        (["--tool-parser-plugin", str(missing)], f"--tool-parser-plugin {missing}: no such Python file"),
        (["run-batch", "-i", str(key), "-o", str(cert), "--lora-modules", "a=b"], "need --enable-lora"),
    ]:
        with pytest.raises(SystemExit) as info:
            cli.main(argv if argv[0] == "run-batch" else ["serve", *argv])
        assert info.value.code == 2 and message in capsys.readouterr().err, argv
        # the engine interpreter the command started at once (launch.py) went with the command
        assert {p.pid for p in psutil.Process().children()} <= before, argv
    assert not served
    cli.main(["serve", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--ssl-ca-certs", str(cert),
              "--ssl-cert-reqs", "2", "--shutdown-timeout", "0"])
    [args] = served
    assert (args.ssl_ca_certs, args.ssl_cert_reqs) == (str(cert), ssl.CERT_REQUIRED)


def test_vllms_flags_taken_only_at_the_values_pagedllm_honours(served, capsys):
    """vLLM's --api-server-count, --revision, --download-dir, --cpu-offload-gb and --async-scheduling: one API server,
    no download, no offloading and no async scheduling are taken; any other value is an error naming the flag before
    the engine starts (LLM()'s, for the engine's), rather than a setting taken and not honoured."""
    for argv, message in [
        (["-asc", "2"], "--api-server-count 2: pagedllm serves from one API server process"),
        (["--revision", "main"], "revision='main': pagedllm never downloads"),
        (["--download-dir", "/tmp/hub"], "download_dir='/tmp/hub': pagedllm never downloads"),
        (["--cpu-offload-gb", "4"], "cpu_offload_gb=4.0: offloading weights to CPU memory is not supported"),
        (["--cpu-offload-gb", "-1"], "cpu_offload_gb must be a number of GiB, at least 0"),
        (["--async-scheduling"], "async_scheduling=True: pagedllm has no async scheduling"),
    ]:
        with pytest.raises(SystemExit) as info:
            cli.main(["serve", *argv])
        assert info.value.code == 2 and message in capsys.readouterr().err, argv
    assert not served
    cli.main(["serve", "--api-server-count", "1", "--no-async-scheduling", "--cpu-offload-gb", "0"])
    [args] = served
    assert (args.api_server_count, args.async_scheduling, args.cpu_offload_gb) == (1, False, 0)
    with pytest.raises(ValueError, match="^revision='main': pagedllm never downloads"):
        EngineArgs(revision="main").create_engine_config()


def test_vllms_spellings_of_flags(served):
    """vLLM's FlexibleArgumentParser: underscores for dashes in a flag's name (not its value), and `serve --model`."""
    cli.main(["serve", "--max_model_len=4096", "--max_num_seqs", "8", "--model", "my_model", "--served_model_name",
              "a_b", "--port", "8001"])
    cli.main(["serve", "--model=other_model"])
    first, second = served
    assert (first.model, first.max_model_len, first.max_num_seqs, first.served_model_name, first.port) == (
        "my_model", 4096, 8, ["a_b"], 8001)
    assert second.model == "other_model"


def test_vllms_dotted_fields_of_json_flags(served):
    """vLLM's ``--flag.field VALUE`` (or ``=VALUE``): one field of a JSON flag's object, nested by more dots, the value
    JSON (else text), ``field+`` a comma-separated list; a flag's fields make one object."""
    cli.main(["serve", "m", "--speculative-config.method", "ngram", "--speculative_config.num_speculative_tokens=3",
              "-cc.cudagraph_mode=NONE", "--hf-overrides.rope_scaling.factor", "2.0",
              "--hf-overrides.architectures+", "LlamaForCausalLM,Other", "--port", "8001"])
    [args] = served
    assert (args.model, args.port, args.speculative_config, args.compilation_config) == (
        "m", 8001, {"method": "ngram", "num_speculative_tokens": 3}, {"cudagraph_mode": "NONE"})
    assert args.hf_overrides == {"rope_scaling": {"factor": 2.0}, "architectures": ["LlamaForCausalLM", "Other"]}


def test_an_address_in_use_fails_before_the_engine_starts():
    """vLLM's setup_server binds the port before the engine starts: a port taken is an error at once, naming the
    flags, not after the model has loaded."""
    before = {p.pid for p in psutil.Process().children()}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        message = f"--host 127.0.0.1 --port {port}: cannot listen there: Address already in use"
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            cli.main(["serve", "--port", str(port), "--max-num-seqs", "0"])  # the engine's config would fail too
    assert {p.pid for p in psutil.Process().children()} <= before


def test_a_bad_flag_found_after_the_port_is_checked_leaves_it_free():
    """A speculative config that fails as the server reads it (the method it needs) frees the port it would have
    listened on: the socket is bound last before the engine, where the server's cleanup closes it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(ValueError, match="needs a method"):  # the traceback keeps run_server's frame alive
        cli.main(["serve", "--port", str(port), "--speculative-config", '{"num_speculative_tokens": 2}'])
    with socket.socket() as again:
        again.bind(("127.0.0.1", port))


def test_no_host_listens_on_every_interface():
    """A --config file's ``host:`` (or ``host: null``) is no host: every interface, as vLLM binds (args.host or "")
    and as uvicorn took it before the socket was bound ahead of the engine (not a TypeError)."""
    from argparse import Namespace

    from pagedllm.entrypoints.openai.api_server import listening_socket

    sock = listening_socket(Namespace(uds=None, host=None, port=0))
    try:
        assert sock.getsockname()[0] == "0.0.0.0"
    finally:
        sock.close()


def _self_signed_certificate(directory) -> tuple[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    key, cert = str(directory / "key.pem"), str(directory / "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
                   check=True, capture_output=True)
    return key, cert


@pytest.fixture(scope="module")
def flags_server(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("flags")
    key, cert = _self_signed_certificate(directory)
    tokenizer_dir = directory / "tokenizer"
    tokenizer.save_pretrained(tokenizer_dir)
    config_path = tokenizer_dir / "tokenizer_config.json"
    (tokenizer_dir / "chat_template.jinja").unlink(missing_ok=True)
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "chat_template": PLAIN_TEMPLATE}))
    socket_path = str(directory / "server.sock")
    # Client certificates are required, verified against the server's own (self-signed) one, which clients send.
    client_tls = ssl.create_default_context(cafile=cert)
    client_tls.load_cert_chain(cert, key)
    srv = RemoteServer(
        directory / "server.log", api_key=API_KEY,
        extra_args=["--uds", socket_path, "--ssl-keyfile", key, "--ssl-certfile", cert, "--ssl-ca-certs", cert,
                    "--ssl-cert-reqs", str(ssl.CERT_REQUIRED), "--root-path", ROOT_PATH,
                    "--allowed-origins", json.dumps([GOOD_ORIGIN]), "--enable-log-requests", "--enable-log-outputs",
                    "--max-log-len", str(MAX_LOG_LEN), "--max-logprobs", str(MAX_LOGPROBS), "--response-role", "bot",
                    "--disable-uvicorn-access-log", "--tokenizer", str(tokenizer_dir), "--disable-web-ui",
                    "--disable-log-stats", "--enable-server-load-tracking", "--enable-request-id-headers",
                    "--enable-force-include-usage", "--return-tokens-as-token-ids"],
        url_root="https://localhost",  # as a proxy serving us under ROOT_PATH sends requests: with it stripped
        client_options={"transport": httpx.HTTPTransport(uds=socket_path, verify=client_tls)})
    srv.socket_path, srv.cert = socket_path, cert
    yield srv
    srv.stop()


def test_https_on_the_socket_under_the_root_path(flags_server):
    with flags_server.http() as http:
        assert http.get("/v1/models").json()["data"][0]["id"]
        assert http.get("/openapi.json").json()["servers"] == [{"url": ROOT_PATH}]
        assert http.get("/v1/models", headers={"Authorization": ""}).status_code == 401  # the prefix skips no check
    with httpx.Client(transport=httpx.HTTPTransport(uds=flags_server.socket_path)) as plain:
        with pytest.raises(httpx.HTTPError):
            plain.get("http://localhost/health")  # TLS only
    no_client_certificate = ssl.create_default_context(cafile=flags_server.cert)
    with httpx.Client(transport=httpx.HTTPTransport(uds=flags_server.socket_path, verify=no_client_certificate)) as tls:
        with pytest.raises(httpx.HTTPError):
            tls.get("https://localhost/health")  # --ssl-cert-reqs 2: a client certificate is required
    assert "GET /api/v1/models" not in flags_server.log()  # no access log (the line would carry the root path)


def test_disable_web_ui(flags_server):
    """The shared server serves the page (tests/server/test_web_ui.py); this one was told not to."""
    with flags_server.http() as http:
        assert http.get("/").status_code == 404
        assert http.get("/static/app.js").status_code == 404
        assert http.get("/engine/view").status_code == 404


def test_force_include_usage_ends_every_stream_with_its_usage(flags_server):
    """vLLM's --enable-force-include-usage: a stream that did not ask for usage ends with it, and every chunk carries
    its choice's usage so far (vLLM's should_include_usage forces continuous_usage_stats too)."""
    with flags_server.http() as http, http.stream("POST", "/v1/completions", json={
            "prompt": "Hi", "max_tokens": 2, "ignore_eos": True, "stream": True}) as response:
        chunks = [json.loads(line[len("data: "):]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert chunks[-1]["usage"]["completion_tokens"] == 2 and chunks[-1]["choices"] == []
    # a token a chunk, or fewer chunks where the stream fell behind and its deltas merged (RequestOutputCollector)
    counts = [chunk["usage"]["completion_tokens"] for chunk in chunks[:-1]]
    assert counts in ([1, 2], [2])
    # no details asked for: none sent, not nulls (vLLM's chunks leave them out)
    assert not {"prompt_tokens_details", "completion_tokens_details"} & set(chunks[-1]["usage"])


def test_return_tokens_as_token_ids_unless_the_request_says_otherwise(flags_server):
    """vLLM's --return-tokens-as-token-ids: logprobs name tokens "token_id:<id>"; a request's false keeps text."""
    with flags_server.http() as http:
        def tokens(**extra) -> list[str]:
            body = {"prompt": "Hi", "max_tokens": 2, "temperature": 0, "logprobs": 0, **extra}
            return http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["tokens"]
        as_ids, as_text = tokens(), tokens(return_tokens_as_token_ids=False)
    assert all(token.startswith("token_id:") for token in as_ids)
    assert not any(token.startswith("token_id:") for token in as_text) and len(as_text) == 2


def test_disable_log_stats_keeps_no_statistics(flags_server):
    """vLLM's --disable-log-stats (log_stats=False) makes no stat loggers, so no pagedllm: metrics either: /metrics
    serves the process's alone."""
    with flags_server.http() as http:
        assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
        text = http.get("/metrics").text
    assert "process_cpu_seconds_total" in text and "pagedllm:" not in text


def test_cors_preflight(flags_server):
    def preflight(origin: str) -> httpx.Response:
        with flags_server.http() as http:
            return http.options("/v1/chat/completions", headers={
                "Origin": origin, "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type"})

    allowed = preflight(GOOD_ORIGIN)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == GOOD_ORIGIN
    refused = preflight("http://evil.example")
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers


def test_server_load_counts_the_requests_in_flight(flags_server):
    """vLLM's --enable-server-load-tracking: GET /load counts a generating request (here under the root path) until
    its stream has ended; other routes do not count."""
    with flags_server.http() as http:
        assert http.get("/load").json() == {"server_load": 0}
        body = {"prompt": "Hi", "max_tokens": 3, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as stream:
            events = stream.iter_lines()
            assert next(events).startswith("data: ")
            assert http.get("/load").json() == {"server_load": 1}
            assert "data: [DONE]" in list(events)
        for _ in range(100):  # the server's count drops once the last event is sent, maybe after the client has it
            if http.get("/load").json()["server_load"] == 0:
                break
            time.sleep(0.1)
        assert http.get("/load").json() == {"server_load": 0}


def test_request_id_headers(flags_server):
    """vLLM's --enable-request-id-headers: each response's X-Request-Id is the request's own (its completion's id is
    cmpl- and it), else a random one."""
    with flags_server.http() as http:
        answer = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers={"X-Request-Id": "r1"})
        health = http.get("/health")
    assert answer.headers["X-Request-Id"] == "r1" and answer.json()["id"] == "cmpl-r1"
    assert re.fullmatch("[0-9a-f]{32}", health.headers["X-Request-Id"])


def test_requests_are_logged_cut_at_max_log_len(flags_server):
    prompt = "The quick brown fox jumps over the lazy dog"
    with flags_server.http() as http:
        response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).json()
    line = next(line for line in flags_server.log().splitlines() if f"Received request {response['id']}" in line)
    assert f"prompt: {prompt[:MAX_LOG_LEN]!r}," in line
    token_ids = re.search(r"prompt_token_ids: \[([^\]]*)\]", line).group(1).split(",")
    assert len(token_ids) == MAX_LOG_LEN and "max_tokens=2" in line


def test_outputs_are_logged_as_requests_end(flags_server):
    """vLLM's --enable-log-outputs: each choice's text, token ids and finish reason, streamed or not, cut at
    --max-log-len as the inputs are."""
    body = {"prompt": "Hi", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with flags_server.http() as http:
        response = http.post("/v1/completions", json=body).json()
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
            chunks = [json.loads(line[len("data: "):]) for line in stream.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
    streamed_id = chunks[0]["id"]
    for request_id in (response["id"], streamed_id):
        [line] = [line for line in flags_server.log().splitlines() if f"Generated response {request_id}" in line]
        text = response["choices"][0]["text"]  # greedy: the stream's too
        assert f"(choice 0): output: {text[:MAX_LOG_LEN]!r}, output_token_ids: [" in line
        assert len(re.search(r"output_token_ids: \[([^\]]*)\]", line).group(1).split(",")) == MAX_LOG_LEN
        assert line.endswith("finish_reason: length")


def test_max_logprobs_and_response_role(flags_server):
    hi = [{"role": "user", "content": "Hi"}]
    with flags_server.http() as http:
        for path, body, param in [("/v1/completions", {"prompt": "Hi", "logprobs": MAX_LOGPROBS + 1}, "logprobs"),
                                  ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": MAX_LOGPROBS + 1},
                                   "prompt_logprobs"),
                                  ("/v1/chat/completions",
                                   {"messages": hi, "logprobs": True, "top_logprobs": MAX_LOGPROBS + 1},
                                   "top_logprobs")]:
            response = http.post(path, json={**body, "max_tokens": 1})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == param and f"at most {MAX_LOGPROBS}" in error["message"]
        chat = http.post("/v1/chat/completions", json={"messages": hi, "max_tokens": 2, "logprobs": True,
                                                       "top_logprobs": MAX_LOGPROBS}).json()
    assert chat["choices"][0]["message"]["role"] == "bot"
    assert len(chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == MAX_LOGPROBS


def test_tokenizer_flag(flags_server, tokenizer):
    with flags_server.http() as http:
        tokens = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hello there"}]}).json()
    assert tokens["tokens"] == tokenizer.encode("Hello there", add_special_tokens=False)


def test_reset_prefix_cache_is_served_in_dev_mode_only(monkeypatch):
    """vLLM's POST /reset_prefix_cache (with its reset_running_requests query parameter), served as vLLM serves it:
    with the development switch on (PAGEDLLM_SERVER_DEV_MODE=1, an integer like vLLM's VLLM_SERVER_DEV_MODE)."""
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.openai.api_server import dev_router, server_dev_mode

    calls = []

    async def reset_prefix_cache(reset_running_requests: bool = False) -> bool:
        calls.append(reset_running_requests)
        return reset_running_requests

    app = FastAPI()
    app.include_router(dev_router)
    app.state.engine_client = SimpleNamespace(reset_prefix_cache=reset_prefix_cache)
    with TestClient(app) as client:
        assert client.post("/reset_prefix_cache").json() == {"success": False}
        assert client.post("/reset_prefix_cache?reset_running_requests=true").json() == {"success": True}
    assert calls == [False, True]
    monkeypatch.delenv("PAGEDLLM_SERVER_DEV_MODE", raising=False)
    assert server_dev_mode() is False
    monkeypatch.setenv("PAGEDLLM_SERVER_DEV_MODE", "1")
    assert server_dev_mode() is True
    monkeypatch.setenv("PAGEDLLM_SERVER_DEV_MODE", "yes")
    with pytest.raises(ValueError, match="PAGEDLLM_SERVER_DEV_MODE"):
        server_dev_mode()
