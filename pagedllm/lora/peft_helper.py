"""A PEFT adapter directory's adapter_config.json, read and checked (vLLM's vllm/lora/peft_helper.py).

What is served: LoRA (``peft_type`` "LORA") on the attention and MLP projections, the token embedding and the LM head
(vLLM's embedding_modules: ``embed_tokens``, ``lm_head``), any rank up to the engine's ``max_lora_rank``, ``lora_alpha``
scaling (``use_rslora``: alpha / sqrt(r)), per-module ranks and alphas (``rank_pattern``, ``alpha_pattern``, matched as
PEFT matches them), ``layers_to_transform`` (the adapter's tensors say which layers it has). What is refused, with a
ValueError naming it: DoRA, trained biases, ``modules_to_save`` (whole replaced modules, e.g. an LM head),
``fan_in_fan_out`` (GPT-2's Conv1D layout), and, as vLLM refuses them (PEFTHelper._validate_features), the PEFT variants
whose saved A and B are not the whole story: inits that change the base weights when PEFT loads the adapter (PiSSA,
OLoRA, CorDA, LoftQ), activated LoRA (applied only from its invocation tokens on), layer replication, block-diagonal
LoRA and QALoRA.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

CONFIG_FILE = "adapter_config.json"
# the weights' files PEFT writes, in the order vLLM looks for them (LoRAModel.from_local_checkpoint): safetensors, or
# a torch pickle (save_pretrained(..., safe_serialization=False)) read with torch.load(weights_only=True)
WEIGHTS_FILES = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")
# init_lora_weights that only set the initial A and B (vLLM's _init_is_supported); True and False are plain too.
_PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")
# settings of PEFT LoRA variants that add to, or change, what x·A·B computes -> what they make the adapter
_REFUSED_VARIANTS = {"lora_bias": "LoRA bias", "alora_invocation_tokens": "activated LoRA (aLoRA)",
                     "layer_replication": "layer-replicating", "use_bdlora": "block-diagonal LoRA (BD-LoRA)",
                     "use_qalora": "QALoRA"}


class LoRAAdapterNotFoundError(ValueError):
    """The path holds no adapter (no directory, or no adapter_config.json in it): vLLM's LoRAAdapterNotFoundError,
    which its server answers with a 404 where an adapter that does not fit is a 400."""


def adapter_dir(lora_path: str) -> str:
    """The directory a LoRARequest's ``lora_path`` names: the path, with a leading ``~`` expanded (vLLM's
    get_adapter_absolute_path, less its download of a Hugging Face Hub repo)."""
    return os.path.expanduser(lora_path)


def weights_file(directory: str) -> str | None:
    """The path of the adapter's weights in ``directory`` (the first of WEIGHTS_FILES there), or None."""
    return next((path for path in (os.path.join(directory, name) for name in WEIGHTS_FILES) if os.path.isfile(path)),
                None)


@dataclass(frozen=True)
class PEFTHelper:
    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str
    use_rslora: bool = False
    # module-name pattern -> its rank / its alpha, where it is not r / lora_alpha
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    def rank_and_scaling(self, module_name: str) -> tuple[int, float]:
        """A module's rank and what its x·A·B is multiplied by: PEFT's alpha / rank, or alpha / sqrt(rank) with
        rsLoRA, each taken from the patterns where one matches ``module_name`` (the checkpoint's name less
        ``base_model.model.``, e.g. "model.layers.0.self_attn.q_proj")."""
        rank = _match_pattern(self.rank_pattern, module_name) or self.r
        alpha = _match_pattern(self.alpha_pattern, module_name)
        alpha = self.lora_alpha if alpha is None else alpha
        return rank, alpha / (math.sqrt(rank) if self.use_rslora else rank)

    @classmethod
    def from_local_dir(cls, lora_path: str, max_lora_rank: int) -> PEFTHelper:
        """The adapter's settings, or a ValueError naming what does not fit (a missing file, a setting pagedllm
        does not serve, a rank above ``max_lora_rank``)."""
        directory = adapter_dir(lora_path)
        if not os.path.isdir(directory):
            raise LoRAAdapterNotFoundError(f"LoRA adapter directory {lora_path!r} does not exist")
        config_path = os.path.join(directory, CONFIG_FILE)
        if not os.path.isfile(config_path):
            raise LoRAAdapterNotFoundError(f"LoRA adapter {lora_path!r} has no {CONFIG_FILE}")
        if weights_file(directory) is None:
            raise ValueError(f"LoRA adapter {lora_path!r} has no weights ({' or '.join(WEIGHTS_FILES)})")
        try:
            with open(config_path) as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"LoRA adapter {lora_path!r}: {CONFIG_FILE} is not readable JSON ({e})") from None
        if not isinstance(config, dict):
            raise ValueError(f"LoRA adapter {lora_path!r}: {CONFIG_FILE} holds {type(config).__name__}, not an "
                             "object of settings")
        return cls.from_config(config, max_lora_rank, lora_path)

    @classmethod
    def from_config(cls, config: dict, max_lora_rank: int, where: str = "") -> PEFTHelper:
        def refuse(message: str) -> ValueError:
            return ValueError(f"LoRA adapter {where!r}: {message}")

        if config.get("peft_type", "LORA") != "LORA":
            raise refuse(f"peft_type {config.get('peft_type')!r} is not LORA")
        r, alpha = config.get("r"), config.get("lora_alpha")
        if not _is_rank(r):
            raise refuse(f"r must be a positive integer, got {r!r}")
        if not _is_alpha(alpha):
            raise refuse(f"lora_alpha must be a finite number, got {alpha!r}")
        rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
        if not _maps_names_to(rank_pattern, _is_rank):
            raise refuse(f"rank_pattern must map module names to positive integer ranks, got {rank_pattern!r}")
        if not _maps_names_to(alpha_pattern, _is_alpha):
            raise refuse(f"alpha_pattern must map module names to finite numbers, got {alpha_pattern!r}")
        for what, rank in (("rank r", r), *((f"rank_pattern[{key!r}]", rank) for key, rank in rank_pattern.items())):
            if rank > max_lora_rank:
                raise refuse(f"{what}={rank} exceeds max_lora_rank={max_lora_rank} (raise max_lora_rank to serve it)")
        if config.get("use_dora"):
            raise refuse("use_dora: DoRA adapters are not supported")
        if config.get("bias", "none") != "none":
            raise refuse(f"bias={config['bias']!r}: adapters with trained biases are not supported")
        if config.get("modules_to_save"):
            raise refuse(f"modules_to_save={config['modules_to_save']!r}: adapters that replace whole modules are "
                         f"not supported")
        if config.get("fan_in_fan_out"):
            raise refuse("fan_in_fan_out: Conv1D-layout adapters are not supported")
        init = config.get("init_lora_weights", True)
        if isinstance(init, str) and init.lower() not in _PLAIN_INITS:
            raise refuse(f"init_lora_weights={init!r}: an init that changes the base weights when PEFT loads the "
                         "adapter is not supported (convert it to a plain LoRA adapter with PEFT's "
                         "path_initial_model_for_weight_conversion)")
        for setting, what in _REFUSED_VARIANTS.items():
            if config.get(setting):
                raise refuse(f"{setting}: {what} adapters are not supported")
        targets = config.get("target_modules")  # None (left out): the adapter's tensors say which modules it has
        if not (targets is None or isinstance(targets, str)
                or isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
            raise refuse(f"target_modules must be a module name pattern or a list of module names, got {targets!r}")
        return cls(r=r, lora_alpha=float(alpha), use_rslora=bool(config.get("use_rslora", False)),
                   target_modules=targets if isinstance(targets, str) else tuple(targets or ()),
                   rank_pattern=dict(rank_pattern), alpha_pattern={k: float(v) for k, v in alpha_pattern.items()})


def _maps_names_to(pattern, fits) -> bool:
    """Whether ``pattern`` maps regular expressions of module names to values that ``fits`` accepts."""
    return isinstance(pattern, dict) and all(_is_regex(key) and fits(value) for key, value in pattern.items())


def _is_regex(key) -> bool:
    try:
        return isinstance(key, str) and re.compile(key) is not None
    except re.error:
        return False


def _is_rank(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_alpha(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _match_pattern(pattern: dict, module_name: str):
    """The value of the first key that is a suffix of ``module_name`` at a "." boundary (PEFT's get_pattern_key,
    as vLLM matches it), None where none is."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return None
