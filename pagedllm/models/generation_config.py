"""The default sampling parameters a model's generation_config.json recommends, as vLLM reads them
(ModelConfig.get_diff_sampling_param, `--generation-config auto|vllm|<dir>`).

"auto" reads the model directory's generation_config.json (a GGUF file has none, so it gives nothing), "vllm"
ignores it (the engine's own defaults), and any other value is a directory holding one. Only the eight sampling
keys vLLM 0.32 takes are kept, with Hugging Face's max_new_tokens renamed to max_tokens; keys the file leaves out or
sets to null are not defaults (transformers 5 leaves every sampling field None unless the file sets it, so this is
vLLM's GenerationConfig.to_diff_dict() reading).
"""
from __future__ import annotations

import json
import os
from typing import Any

from pagedllm.sampling_params import SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"
# The generation-config keys vLLM turns into default sampling parameters.
SAMPLING_KEYS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p",
                 "min_p", "max_new_tokens")


def generation_config_dir(model_path: str, generation_config: str) -> str | None:
    """The directory whose generation_config.json applies; None for "vllm" and for a model with no directory."""
    if generation_config == "vllm":
        return None
    if generation_config == "auto":
        return model_path if os.path.isdir(model_path) else None
    return generation_config


def check_generation_config(model_path: str, generation_config: str, overrides: dict | None = None) -> None:
    """Fails at start-up, naming the flag, rather than on every request: a directory given by the user must hold
    the file (else the flag would silently do nothing), the overrides must be a dict, and the defaults must be
    valid SamplingParams."""
    if generation_config not in ("auto", "vllm") and not os.path.isfile(
            os.path.join(generation_config, GENERATION_CONFIG_FILE)):
        raise ValueError(f"generation_config must be auto, vllm or a directory holding {GENERATION_CONFIG_FILE}; "
                         f"got {generation_config!r}")
    if overrides is not None and not isinstance(overrides, dict):
        raise ValueError(f"override_generation_config must be a dict of generation config fields, got {overrides!r}")
    try:
        SamplingParams(**diff_sampling_param(model_path, generation_config, overrides))
    except (ValueError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"generation_config ({generation_config}, override_generation_config {overrides}): {e}"
                         if overrides else f"generation_config ({generation_config}): {e}") from e


def diff_sampling_param(model_path: str, generation_config: str, overrides: dict | None = None) -> dict[str, Any]:
    """SamplingParams field -> the value the generation config sets for it (empty when it sets none), with vLLM's
    override_generation_config (generation config names, e.g. max_new_tokens) over the file's values."""
    directory = generation_config_dir(model_path, generation_config)
    path = os.path.join(directory, GENERATION_CONFIG_FILE) if directory else None
    config = {}
    if path is not None and os.path.isfile(path):
        with open(path) as f:
            config = json.load(f)
    config.update(overrides or {})
    params = {key: config[key] for key in SAMPLING_KEYS if config.get(key) is not None}
    if "max_new_tokens" in params:
        params["max_tokens"] = params.pop("max_new_tokens")
    return params


def generation_eos_token_ids(model_path: str, generation_config: str, hf_config: Any) -> list[int]:
    """Every token id that ends generation by the model's own word (vLLM's update_from_generation_config): the
    generation config's ``eos_token_id`` (an id or a list: Llama 3 Instruct ends turns with <|eot_id|> and
    <|eom_id|> too), read from the model's directory under "auto" and "vllm" or from the given one, else the model
    config's."""
    directory = model_path if generation_config in ("auto", "vllm") else generation_config
    path = os.path.join(directory, GENERATION_CONFIG_FILE)
    eos = getattr(hf_config, "eos_token_id", None)
    if os.path.isdir(directory) and os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id", eos)
    ids = eos if isinstance(eos, (list, tuple)) else [eos]
    return [int(token_id) for token_id in ids if isinstance(token_id, int)]

