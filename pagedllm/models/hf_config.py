"""Config and tokenizer loading for both HF directories and GGUF files.

transformers builds a config, a tokenizer and its chat template from GGUF
metadata when given ``gguf_file``, so one code path serves both formats.
Parsing GGUF metadata is slow (the vocabulary is decoded in Python), so the
result is cached per process.
"""

import copy
import functools
import os

from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from pagedllm.models.resolve import resolve_model


def _split_source(path: str) -> tuple[str, dict]:
    """Return the directory and the from_pretrained kwargs for ``path``."""
    path = resolve_model(path)
    if path.endswith(".gguf"):
        return os.path.dirname(os.path.abspath(path)), {"gguf_file": os.path.basename(path)}
    return path, {}


@functools.lru_cache(maxsize=8)
def _load_hf_config_cached(path: str) -> PretrainedConfig:
    directory, kwargs = _split_source(path)
    return AutoConfig.from_pretrained(directory, local_files_only=True, **kwargs)


def load_hf_config(path: str) -> PretrainedConfig:
    """Load the model config; returns a private copy callers may modify."""
    return copy.deepcopy(_load_hf_config_cached(path))


@functools.lru_cache(maxsize=8)
def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Load the tokenizer (with chat template); shared per process, do not mutate."""
    directory, kwargs = _split_source(path)
    return AutoTokenizer.from_pretrained(directory, local_files_only=True, **kwargs)
