"""Shared fixtures for end-to-end tests with the real default model.

Loading and dequantizing the GGUF takes seconds, so one model per dtype is loaded per test session and
shared by every LLM the tests build (the model is stateless; each engine has its own KV cache).
"""
from __future__ import annotations

import pytest
import torch

from pagedllm.models import loader
from pagedllm.models.hf_config import load_tokenizer
from pagedllm.models.resolve import DEFAULT_MODEL, resolve_model
from tests.model_fixtures import smollm_reference


@pytest.fixture(scope="package", autouse=True)
def share_loaded_models():
    """In-process engines (PAGEDLLM_ENABLE_MULTIPROCESSING=0) in this package reuse one model per set-up."""
    models = {}

    def get_model_once(path, hf_config, kernels):
        key = (path, kernels, repr(getattr(hf_config, "quantization_config", None)))
        if key not in models:
            models[key] = loader.get_model(path, hf_config, kernels)
        return models[key]

    patcher = pytest.MonkeyPatch()
    patcher.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
    patcher.setattr("pagedllm.worker.model_runner.get_model", get_model_once)
    yield
    patcher.undo()


@pytest.fixture(scope="session")
def model_path() -> str:
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def tokenizer(model_path):
    return load_tokenizer(model_path)


@pytest.fixture(scope="session")
def hf_model():
    """transformers' own float32 model on the same dequantized GGUF weights: the oracle."""
    return smollm_reference()


def hf_greedy(hf_model, prompt_token_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt_token_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                min_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(prompt_token_ids):].tolist()
