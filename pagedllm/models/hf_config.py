"""Config and tokenizer loading for both HF directories and GGUF files.

transformers builds a config, a tokenizer and its chat template from GGUF
metadata when given ``gguf_file``, so one code path serves both formats.
That is slow, so results are cached on disk (see ``gguf_cache``) and per process.
"""

import copy
import functools
import os
from typing import Any

from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from pagedllm.models.gguf_cache import gguf_cache_dir, save_atomically
from pagedllm.models.gguf_config import complete_gguf_config
from pagedllm.models.resolve import resolve_model


def _from_pretrained(auto_class, path: str):
    """``auto_class.from_pretrained`` for an HF directory or a ``.gguf`` file."""
    path = resolve_model(path)
    if not path.endswith(".gguf"):
        return auto_class.from_pretrained(path, local_files_only=True)
    cached = gguf_cache_dir(path, auto_class.__name__)
    if os.path.isdir(cached):
        return auto_class.from_pretrained(cached, local_files_only=True)
    obj = auto_class.from_pretrained(
        os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path), local_files_only=True
    )
    save_atomically(obj, cached)
    return obj


# Multimodal architectures whose language model runs on its own here, text in and text out (vLLM runs them whole):
# the checkpoint's text config becomes the model's config, keeping the architecture's name, by which the registry
# picks the class that loads the language model's weights and skips the vision tower's.
TEXT_PART_ARCHITECTURES = frozenset({"Gemma3ForConditionalGeneration"})


def _text_part(config: PretrainedConfig) -> PretrainedConfig:
    """``config``, or for an architecture in TEXT_PART_ARCHITECTURES its language model's config."""
    architectures = list(getattr(config, "architectures", None) or [])
    if not TEXT_PART_ARCHITECTURES.intersection(architectures) or getattr(config, "text_config", None) is None:
        return config
    text = config.text_config
    text.architectures = architectures
    if getattr(text, "dtype", None) is None:  # saved on the outer config only
        text.dtype = getattr(config, "dtype", None)
    # Whether the LM head is the embedding is the whole model's setting (transformers ties by the outer config; the
    # text config's own defaults to tied whatever the checkpoint holds).
    text.tie_word_embeddings = getattr(config, "tie_word_embeddings", text.tie_word_embeddings)
    return text


@functools.lru_cache(maxsize=8)
def _load_hf_config_cached(path: str) -> PretrainedConfig:
    config = _from_pretrained(AutoConfig, path)
    resolved = resolve_model(path)
    return complete_gguf_config(config, resolved) if resolved.endswith(".gguf") else _text_part(config)


def load_hf_config(path: str) -> PretrainedConfig:
    """Load the model config; returns a private copy callers may modify."""
    return copy.deepcopy(_load_hf_config_cached(path))


def apply_hf_overrides(config: PretrainedConfig, overrides: Any) -> PretrainedConfig:
    """vLLM's hf_overrides: a dict whose entries replace the config's (a dict for a sub-config, e.g. a multimodal
    checkpoint's text_config, overriding within it), or a callable taking the config and returning it. The config's
    checks (architecture, rope scaling, context length) then see the overridden values. Anything else, a ValueError
    naming it."""
    if callable(overrides):
        config = overrides(config)
        if not isinstance(config, PretrainedConfig):
            raise ValueError(f"hf_overrides: the callable returned {type(config).__name__}, not the config")
        return config
    if not isinstance(overrides, dict):
        raise ValueError(f"hf_overrides must be a dict of config fields (or a callable), got {overrides!r}")
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and isinstance(current, PretrainedConfig):
            apply_hf_overrides(current, value)
        elif not _override_legacy_rope(config, key, value):
            setattr(config, key, value)
    return config


def _override_legacy_rope(config: PretrainedConfig, key: str, value: Any) -> bool:
    """Whether ``key`` is a rope key of transformers < 5 (vLLM's documented ``rope_scaling`` override), now applied to a
    config's one set of rope parameters as transformers reads a config.json that holds it: ``rope_scaling`` replaces
    the scaling and keeps the base (``rope_theta``, ``partial_rotary_factor``) that sat beside it, ``rope_theta``
    replaces the base. transformers' ``rope_scaling`` setter drops the base (None: the engine process failed), and
    ``rope_theta`` alone was ignored."""
    params = getattr(config, "rope_parameters", None)
    if key not in ("rope_scaling", "rope_theta") or not isinstance(params, dict) or any(
            isinstance(nested, dict) for nested in params.values()):
        return False
    if key == "rope_theta":
        config.rope_parameters = {**params, "rope_theta": value}
    else:
        base = {name: params[name] for name in ("rope_theta", "partial_rotary_factor") if name in params}
        config.rope_parameters = {**base, **(value or {"rope_type": "default"})}
    config.standardize_rope_params()
    return True


@functools.lru_cache(maxsize=8)
def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Load the tokenizer (with chat template); shared per process, do not mutate."""
    return _from_pretrained(AutoTokenizer, path)
