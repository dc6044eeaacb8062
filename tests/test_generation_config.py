"""--generation-config: which sampling defaults a model's generation_config.json gives (vLLM's
get_diff_sampling_param), how a request's own values win over them, and the checks at start-up. No model runs
here: the offline LLM is in tests/e2e/test_generation_config.py, the server in tests/server/."""
from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.models.generation_config import check_generation_config, diff_sampling_param
from pagedllm.models.resolve import DEFAULT_MODEL, resolve_model

GENERATION_CONFIG = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": None, "repetition_penalty": 1.1,
                     "presence_penalty": 1.5, "frequency_penalty": -0.5, "max_new_tokens": 7, "do_sample": True,
                     "bos_token_id": 1}
DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1, "presence_penalty": 1.5,
            "frequency_penalty": -0.5, "max_tokens": 7}


def model_dir(path, config: dict = GENERATION_CONFIG):
    path.mkdir(exist_ok=True)
    (path / "generation_config.json").write_text(json.dumps(config))
    return str(path)


def test_auto_reads_the_model_directory_and_keeps_the_sampling_keys(tmp_path):
    model = model_dir(tmp_path / "model")
    # Nulls and non-sampling keys are left out; max_new_tokens is renamed.
    assert diff_sampling_param(model, "auto") == DEFAULTS
    assert diff_sampling_param(model, "vllm") == {}


def test_a_directory_overrides_the_model_and_a_gguf_file_has_none(tmp_path):
    gguf = resolve_model(DEFAULT_MODEL)
    assert diff_sampling_param(gguf, "auto") == {}
    other = model_dir(tmp_path / "other", {"temperature": 0.0})
    assert diff_sampling_param(gguf, other) == {"temperature": 0.0}
    assert diff_sampling_param(model_dir(tmp_path / "model"), other) == {"temperature": 0.0}
    assert diff_sampling_param(str(tmp_path / "empty"), "auto") == {}  # a model directory without the file


def test_bad_generation_configs_fail_at_start_up_naming_the_flag(tmp_path):
    gguf = resolve_model(DEFAULT_MODEL)
    check_generation_config(gguf, "auto")
    check_generation_config(gguf, "vllm")
    with pytest.raises(ValueError, match="generation_config must be auto, vllm or a directory"):
        check_generation_config(gguf, str(tmp_path))
    with pytest.raises(ValueError, match=r"generation_config \(.*\): top_p must be in \(0, 1\]"):
        check_generation_config(gguf, model_dir(tmp_path / "bad", {"top_p": 0}))


def test_requests_fall_back_to_the_defaults_field_by_field():
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_p=0.5, top_k=5)
    params = request.to_sampling_params(10, DEFAULTS)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.6, 0.5, 5, 1.1)
    # vLLM 0.32 takes the presence and frequency penalties from the generation config too.
    assert (params.presence_penalty, params.frequency_penalty) == (1.5, -0.5)
    plain = CompletionRequest(prompt="hi").to_sampling_params(10, {})
    assert (plain.temperature, plain.top_p, plain.top_k, plain.repetition_penalty) == (1.0, 1.0, 0, 1.0)
    assert (plain.presence_penalty, plain.frequency_penalty) == (0.0, 0.0)
    own = CompletionRequest(prompt="hi", presence_penalty=0.0).to_sampling_params(10, DEFAULTS)
    assert (own.presence_penalty, own.frequency_penalty) == (0.0, -0.5)  # a request's own 0 wins
    assert CompletionRequest(prompt="hi", temperature=0.2).to_sampling_params(10, DEFAULTS).temperature == 0.2
    beams = CompletionRequest(prompt="hi", use_beam_search=True, n=2)
    assert beams.to_beam_search_params(10, DEFAULTS, 20).temperature == 0.6
    assert beams.to_beam_search_params(10, {}, 20).temperature == 0.0
