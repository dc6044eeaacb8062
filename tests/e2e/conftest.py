"""Shared fixtures for end-to-end tests with the real default model.

Engines run as users run them: the EngineCore in its own process (LLM's default). Modules that inspect or patch
the worker from the test process opt into in-process engines (``share_loaded_models``); they share one loaded
model per set-up, since loading and dequantizing the GGUF takes seconds (the model is stateless; each engine has
its own KV cache).
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import pytest
import torch

from pagedllm import LLM
from pagedllm.models import loader
from pagedllm.models.hf_config import load_tokenizer
from pagedllm.models.resolve import DEFAULT_MODEL, resolve_model
from tests.e2e.parallel_helpers import engine_processes
from tests.model_fixtures import smollm_reference

_loaded_models: dict = {}  # for the whole session: later modules get the models earlier ones loaded


def _engines_in_this_process(patcher: pytest.MonkeyPatch) -> None:
    def get_model_once(path, hf_config, kernels, *rank_and_layers):
        key = (path, kernels, repr(getattr(hf_config, "quantization_config", None)), rank_and_layers)
        if key not in _loaded_models:
            _loaded_models[key] = loader.get_model(path, hf_config, kernels, *rank_and_layers)
        return _loaded_models[key]

    patcher.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
    patcher.setattr("pagedllm.worker.model_runner.get_model", get_model_once)


@pytest.fixture(scope="module")
def share_loaded_models():
    """The module's engines run in the test process (PAGEDLLM_ENABLE_MULTIPROCESSING=0), so that its tests can
    reach the worker, and reuse one model per set-up. For modules that inspect the worker's internals:
    ``pytestmark = pytest.mark.usefixtures("share_loaded_models")``."""
    with pytest.MonkeyPatch.context() as patcher:
        _engines_in_this_process(patcher)
        yield


def in_process_llm(*args, **kwargs) -> LLM:
    """An LLM whose engine runs in the test process, with the shared models: for one test of a module whose
    other tests run engine processes."""
    with pytest.MonkeyPatch.context() as patcher:
        _engines_in_this_process(patcher)
        return LLM(*args, **kwargs)


@contextlib.contextmanager
def running_llm(*args, **kwargs) -> Iterator[LLM]:
    """An LLM that is shut down (its engine process stopped) when the block ends, whatever happened in it."""
    llm = LLM(*args, **kwargs)
    try:
        yield llm
    finally:
        llm.shutdown()


_shared_engine_pids: set[int] = set()


@pytest.fixture(scope="package")
def llm():
    """The float32 engine of the tests' usual settings, one for the package (an engine process takes seconds to
    start): modules that need nothing else share it, and each test leaves it idle. A module that needs other
    settings defines an ``llm`` of its own."""
    before = {p.pid for p in engine_processes()}
    with running_llm(dtype="float32", max_model_len=1024, kv_cache_memory="256MiB") as engine:
        _shared_engine_pids.update(p.pid for p in engine_processes() if p.pid not in before)
        yield engine
    _shared_engine_pids.clear()


def caller_id(engine_request_id: str) -> str:
    """The id a request was added under, from the unique one the engine runs it under (processor.assign_request_id:
    the caller's and 8 random characters, as vLLM's)."""
    return engine_request_id.rsplit("-", 1)[0]


@pytest.fixture(scope="module", autouse=True)
def no_engine_process_left_behind():
    """Every module stops the engine processes it starts (LLM.shutdown, running_llm, or a fixture's teardown):
    one left running holds its memory and threads until pytest exits, slowing every later test. Engines that ran
    before the module (another directory's session-wide server) are not the module's."""
    before = {p.pid for p in engine_processes()}
    yield
    left = [p for p in engine_processes() if p.pid not in _shared_engine_pids | before]
    for process in left:
        process.kill()
    assert not left, f"engine processes left running by this module: {[p.pid for p in left]}"


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


_greedy_choices: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def hf_greedy(hf_model, prompt_token_ids: list[int], output_token_ids: list[int],
              suppress_token_ids: tuple[int, ...] = ()) -> list[int]:
    """transformers' greedy token after the prompt and after each prefix of ``output_token_ids``, from one forward
    pass over prompt + output (teacher forcing); ``suppress_token_ids`` never win (as min_tokens masks EOS).

    Greedy decoding takes each token as the argmax given the tokens before it, which is what each position of the
    one pass computes: so the result equals ``output_token_ids`` exactly when the output is transformers' greedy
    continuation of the prompt, and where the two first differ it holds transformers' token. One pass instead of
    generate's loop of one step per token (the suite's oracle took minutes that way); memoized per model, since
    engines of different settings are checked against the same outputs."""
    choices = _greedy_choices.setdefault(hf_model, {})
    key = (tuple(prompt_token_ids), tuple(output_token_ids), tuple(suppress_token_ids))
    if key not in choices:
        with torch.inference_mode():
            tokens = torch.tensor([list(prompt_token_ids) + list(output_token_ids)])
            logits = hf_model(tokens).logits[0, len(prompt_token_ids) - 1:]
            logits[:, list(suppress_token_ids)] = float("-inf")
            choices[key] = logits.argmax(-1).tolist()[:len(output_token_ids)]
    return choices[key]


def assert_transformers_greedy(hf_model, prompts: list[list[int]], outputs: list[list[int]], num_tokens: int,
                               suppress_token_ids: tuple[int, ...] = ()) -> None:
    """Each output is ``num_tokens`` long and transformers' greedy continuation of its prompt."""
    for i, (prompt, got) in enumerate(zip(prompts, outputs, strict=True)):
        assert len(got) == num_tokens, f"prompt {i}: {len(got)} tokens, not {num_tokens}"
        expected = hf_greedy(hf_model, prompt, got, suppress_token_ids)
        assert got == expected, f"prompt {i} ({len(prompt)} tokens) diverges from transformers at token " \
                                f"{next(k for k, (a, b) in enumerate(zip(got, expected)) if a != b)}"


def assert_transformers_generate(hf_model, prompts: list[list[int]], outputs: list[list[int]], num_tokens: int) -> None:
    """Each output is transformers' greedy ``generate`` of ``num_tokens`` tokens after its prompt (EOS not
    stopping it, as ignore_eos): the prompt in one forward, then one token a step on its KV cache. Where one
    teacher-forced pass (hf_greedy) is not that: with dynamic or longrope rope past the original length, whose
    frequencies transformers takes from each forward's length (see layers/rope_scaling.py)."""
    for i, (prompt, got) in enumerate(zip(prompts, outputs, strict=True)):
        assert len(got) == num_tokens, f"prompt {i}: {len(got)} tokens, not {num_tokens}"
        with torch.inference_mode():
            ids = torch.tensor([prompt])
            generated = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens,
                                          do_sample=False, eos_token_id=None, pad_token_id=0)
        expected = generated[0, len(prompt):].tolist()
        assert got == expected, f"prompt {i} ({len(prompt)} tokens) diverges from transformers' generate at " \
                                f"token {next(k for k, (a, b) in enumerate(zip(got, expected)) if a != b)}"

