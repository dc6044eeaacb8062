"""pagedllm: a high-throughput LLM inference and serving engine on the vLLM V1 architecture.

The public names are imported on first use (PEP 562), not with the package: the engine and worker processes
import ``pagedllm.<module>`` and must not pay for the frontend (LLM pulls in transformers' tokenizers and the
argument parsing), which would be most of their start-up."""
import importlib

from pagedllm.gc_utils import gc_paused

_EXPORTS = {
    "LLM": "pagedllm.entrypoints.llm",
    "SamplingParams": "pagedllm.sampling_params",
    "RequestOutput": "pagedllm.outputs",
    "CompletionOutput": "pagedllm.outputs",
    "BeamSearchParams": "pagedllm.sampling_params",
    "BeamSearchOutput": "pagedllm.beam_search",
    "LoRARequest": "pagedllm.lora.request",
    "EngineArgs": "pagedllm.engine.arg_utils",
    "AsyncEngineArgs": "pagedllm.engine.arg_utils",
    "LLMEngine": "pagedllm.engine.llm_engine",
    "AsyncLLMEngine": "pagedllm.engine.async_llm",  # vLLM's alias of AsyncLLM
    "PromptType": "pagedllm.inputs",
    "TextPrompt": "pagedllm.inputs",
    "TokensPrompt": "pagedllm.inputs",
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
    with gc_paused():  # torch and transformers behind it: a million objects made at once (gc_utils.py)
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
