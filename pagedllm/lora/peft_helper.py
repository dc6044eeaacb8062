"""A PEFT adapter directory's adapter_config.json, read and checked (vLLM's vllm/lora/peft_helper.py).

What is served: LoRA (``peft_type`` "LORA") on the attention and MLP projections, any rank up to the engine's
``max_lora_rank``, ``lora_alpha`` scaling (``use_rslora``: alpha / sqrt(r)), ``layers_to_transform`` (the
adapter's tensors say which layers it has). What is refused, with a ValueError naming it: DoRA, trained biases,
``modules_to_save`` (whole replaced modules, e.g. an LM head), per-module ranks or alphas (``rank_pattern``,
``alpha_pattern``), ``fan_in_fan_out`` (GPT-2's Conv1D layout), weights saved as .bin (pickles: not loaded), and, as
vLLM refuses them (PEFTHelper._validate_features), the PEFT variants whose saved A and B are not the whole story:
inits that change the base weights when PEFT loads the adapter (PiSSA, OLoRA, CorDA, LoftQ), activated LoRA (applied
only from its invocation tokens on), layer replication, block-diagonal LoRA and QALoRA.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
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


@dataclass(frozen=True)
class PEFTHelper:
    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        """What x·A·B is multiplied by: PEFT's lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

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
        if not os.path.isfile(os.path.join(directory, WEIGHTS_FILE)):
            if os.path.isfile(os.path.join(directory, "adapter_model.bin")):
                raise ValueError(f"LoRA adapter {lora_path!r} holds adapter_model.bin, a pickle, which pagedllm does "
                                 f"not load; save it as {WEIGHTS_FILE} (peft: save_pretrained(..., "
                                 f"safe_serialization=True))")
            raise ValueError(f"LoRA adapter {lora_path!r} has no {WEIGHTS_FILE}")
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
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise refuse(f"r must be a positive integer, got {r!r}")
        if r > max_lora_rank:
            raise refuse(f"rank r={r} exceeds max_lora_rank={max_lora_rank} (raise max_lora_rank to serve it)")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
            raise refuse(f"lora_alpha must be a finite number, got {alpha!r}")
        if config.get("use_dora"):
            raise refuse("use_dora: DoRA adapters are not supported")
        if config.get("bias", "none") != "none":
            raise refuse(f"bias={config['bias']!r}: adapters with trained biases are not supported")
        if config.get("modules_to_save"):
            raise refuse(f"modules_to_save={config['modules_to_save']!r}: adapters that replace whole modules are "
                         f"not supported")
        for pattern in ("rank_pattern", "alpha_pattern"):
            if config.get(pattern):
                raise refuse(f"{pattern}: per-module ranks and alphas are not supported")
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
        targets = config.get("target_modules") or ()
        return cls(r=r, lora_alpha=float(alpha), use_rslora=bool(config.get("use_rslora", False)),
                   target_modules=targets if isinstance(targets, str) else tuple(targets))
