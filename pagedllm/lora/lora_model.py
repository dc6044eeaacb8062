"""An adapter's weights, loaded from its safetensors (or .bin / .pt) file and mapped onto the model's fused layers
(vLLM's LoRAModel).

PEFT names a tensor ``base_model.model.<module>.lora_A.weight`` (``[r, in]``) or ``...lora_B.weight``
(``[out, r]``) after the checkpoint's own modules (q_proj, k_proj, ...); the model fuses q/k/v into qkv_proj and
gate/up into gate_up_proj, so each original module becomes one slice of a fused layer, with its own A and B
(LORA_TARGETS). Where the checkpoint's module is itself fused (Phi-3's qkv_proj and gate_up_proj), its B splits by
rows into the slices, which share its A: x·A·B is the slices' x·A·B_i side by side. B is stored multiplied by the
adapter's scaling, so a layer adds x·A·B with nothing else to do.

Outside the decoder layers (vLLM's embedding_modules): the token embedding, whose LoRA PEFT names
``...embed_tokens.lora_embedding_A`` (``[r, vocab]``: a token's A is its column) and ``...lora_embedding_B``
(``[hidden, r]``), and the LM head, a linear LoRA (A ``[r, hidden]``, B ``[vocab, r]``), each one slice of its own.
The base weights PEFT saves beside them (``...embed_tokens.base_layer.weight``, ``lm_head.base_layer.weight``) are
the base model's, skipped as vLLM skips them (is_base_embedding_weights).
"""
from __future__ import annotations

import contextlib
import os
import pickle
import re
from dataclasses import dataclass, field

import torch
from safetensors import SafetensorError, safe_open

from pagedllm.config import head_dim
from pagedllm.lora.peft_helper import WEIGHTS_FILES, PEFTHelper, adapter_dir, weights_file

# checkpoint module -> (the model's layer, slice index; None: every slice, the checkpoint's module being the fused one)
LORA_TARGETS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "self_attn.o_proj": ("self_attn.o_proj", 0),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.down_proj": ("mlp.down_proj", 0),
    "self_attn.qkv_proj": ("self_attn.qkv_proj", None),
    "mlp.gate_up_proj": ("mlp.gate_up_proj", None),
}
NUM_SLICES = {"self_attn.qkv_proj": 3, "self_attn.o_proj": 1, "mlp.gate_up_proj": 2, "mlp.down_proj": 1}
# A decoder layer's LoRA A or B as peft names it, or without peft's "base_model.model." (as vLLM takes it:
# parse_fine_tuned_lora_name); a multimodal checkpoint's (Gemma 3 4B and up) under its language model, as either
# transformers layout spells it.
_MODEL = r"^(?:base_model\.model\.)?(?:model\.language_model\.|language_model\.model\.|model\.)"
_TENSOR_NAME = re.compile(_MODEL + r"layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")
# checkpoint module outside the decoder layers -> the model's module that serves its LoRA
EMBEDDING_MODULES = {"embed_tokens": "model.embed_tokens", "lm_head": "lm_head"}
_EMBEDDING_NAMES = (re.compile(_MODEL + r"(embed_tokens)\.lora_embedding_([AB])$"),
                    re.compile(r"^(?:base_model\.model\.)?(?:language_model\.)?(lm_head)\.lora_([AB])\.weight$"))
_BASE_EMBEDDING_WEIGHTS = (".embed_tokens.base_layer.weight", ".lm_head.base_layer.weight")


def slice_shapes(hf_config) -> dict[str, list[tuple[int, int]]]:
    """(in, out) of each slice of each LoRA'd layer, as the checkpoint's full (unsharded) modules have them."""
    hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    dim = head_dim(hf_config)
    return {
        "self_attn.qkv_proj": [(hidden, heads * dim), (hidden, kv_heads * dim), (hidden, kv_heads * dim)],
        "self_attn.o_proj": [(heads * dim, hidden)],
        "mlp.gate_up_proj": [(hidden, hf_config.intermediate_size)] * 2,
        "mlp.down_proj": [(hf_config.intermediate_size, hidden)],
    }


def embedding_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """(in, out) of each EMBEDDING_MODULES' LoRA: A is ``[r, in]`` and B ``[out, r]``, the embedding's taking a
    token id (one of the vocabulary) to a hidden state."""
    return {"embed_tokens": (hf_config.vocab_size, hf_config.hidden_size),
            "lm_head": (hf_config.hidden_size, hf_config.vocab_size)}


@dataclass
class LoRALayerWeights:
    """One fused layer's adapter: per slice, ``(A [r, in], B·scaling [out, r])`` or None where the adapter leaves
    that slice alone."""

    slices: list[tuple[torch.Tensor, torch.Tensor] | None]


@dataclass
class LoRAModel:
    lora_int_id: int
    rank: int
    # "model.layers.<i>.<layer>", or an EMBEDDING_MODULES' module -> its weights
    layers: dict[str, LoRALayerWeights] = field(default_factory=dict)

    @classmethod
    def from_local_checkpoint(cls, lora_path: str, lora_int_id: int, hf_config, max_lora_rank: int,
                              dtype: torch.dtype = torch.float32) -> LoRAModel:
        """Load an adapter, checked against the base model's config first (check_local_checkpoint's checks, on
        the weights opened once: a pickled adapter is read whole)."""
        peft = PEFTHelper.from_local_dir(lora_path, max_lora_rank)
        model = cls(lora_int_id, peft.r)
        shapes = slice_shapes(hf_config)
        with _weights(lora_path) as f:
            for (layer_index, module), names in _checked_modules(lora_path, hf_config, peft, f).items():
                a, b = (f.get_tensor(names[ab]) for ab in "AB")
                scaling = peft.rank_and_scaling(module_name(names["A"]))[1]
                a, b = a.to(dtype), (b.to(torch.float64) * scaling).to(dtype)
                if layer_index is None:
                    model.layers[EMBEDDING_MODULES[module]] = LoRALayerWeights([(a, b)])
                    continue
                fused, slice_index = LORA_TARGETS[module]
                weights = model.layers.setdefault(f"model.layers.{layer_index}.{fused}",
                                                  LoRALayerWeights([None] * NUM_SLICES[fused]))
                if slice_index is None:
                    for i, b_slice in enumerate(b.split([out for _, out in shapes[fused]])):
                        weights.slices[i] = (a, b_slice)
                else:
                    weights.slices[slice_index] = (a, b)
        return model


def module_name(tensor_name: str) -> str:
    """The module a LoRA tensor belongs to, as PEFT's rank_pattern and alpha_pattern name it
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" -> "model.layers.0.self_attn.q_proj")."""
    return tensor_name.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]


class _LoadedTensors:
    """A pickled adapter's tensors behind the part of safetensors' safe_open that the loader uses."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self._tensors = tensors

    def keys(self):
        return self._tensors.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def get_slice(self, name: str):
        """What safe_open's get_slice gives for the one call made of it: ``get_shape()``."""
        return _Shaped(self._tensors[name].shape)


@dataclass(frozen=True)
class _Shaped:
    shape: torch.Size

    def get_shape(self) -> list[int]:
        return list(self.shape)


@contextlib.contextmanager
def _weights(lora_path: str):
    """The adapter's weights open for reading: its safetensors file, or its .bin / .pt loaded as vLLM loads them
    (torch.load with weights_only=True: tensors and plain containers, no code run). A file that is not one
    (truncated, corrupt, gone, not a dict of tensors) is a ValueError naming it, as every other thing wrong with an
    adapter is."""
    path = weights_file(adapter_dir(lora_path)) or os.path.join(adapter_dir(lora_path), WEIGHTS_FILES[0])
    name = os.path.basename(path)
    if name.endswith(".safetensors"):
        try:
            with safe_open(path, framework="pt") as f:
                yield f
        except (OSError, SafetensorError) as e:
            raise ValueError(f"LoRA adapter {lora_path!r}: {name} cannot be read ({e})") from None
        return
    try:
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, pickle.UnpicklingError, RuntimeError, EOFError) as e:
        raise ValueError(f"LoRA adapter {lora_path!r}: {name} cannot be read ({e})") from None
    # keys are tensor names, matched against PEFT's (a number would fail the match with a TypeError)
    if not (isinstance(tensors, dict) and all(isinstance(k, str) and isinstance(t, torch.Tensor)
                                              for k, t in tensors.items())):
        raise ValueError(f"LoRA adapter {lora_path!r}: {name} holds {type(tensors).__name__}, not a dict of tensors "
                         "by name")
    yield _LoadedTensors(tensors)


def check_local_checkpoint(lora_path: str, hf_config, max_lora_rank: int
                           ) -> tuple[PEFTHelper, dict[tuple[int | None, str], dict[str, str]]]:
    """An adapter's settings and, per (layer, module) it adapts, the names of its A and B tensors: the token
    embedding's and the LM head's first (layer None), then the decoder layers' in layer order. Checked against the
    base model's config from its config file and its tensors' names and shapes, without reading a safetensors file's
    data (the frontend checks each adapter this way; the worker loads it). A ValueError names what does not fit: a
    module the model has no LoRA layer for (an MLP projection of a layer whose feed-forward block is experts
    included: a dense model's adapter on a mixture of experts of its shapes), a shape that is not the base's (an
    embedding's A of another vocabulary size), a layer past its last, an A without its B."""
    peft = PEFTHelper.from_local_dir(lora_path, max_lora_rank)
    with _weights(lora_path) as f:
        return peft, _checked_modules(lora_path, hf_config, peft, f)


def _parsed(lora_path: str, hf_config, name: str) -> tuple[int | None, str, str]:
    """(layer index, None outside the decoder layers; the checkpoint's module; "A" or "B") of LoRA tensor ``name``,
    or a ValueError where it is not one of a module pagedllm serves adapters on."""
    for pattern in _EMBEDDING_NAMES:
        match = pattern.match(name)
        if match is not None:
            return None, match.group(1), match.group(2)
    match = _TENSOR_NAME.match(name)
    if match is None or match.group(2) not in LORA_TARGETS:
        raise ValueError(f"LoRA adapter {lora_path!r}: tensor {name!r} is not a LoRA A/B of a module pagedllm serves "
                         f"adapters on ({', '.join(LORA_TARGETS)} of a decoder layer, {', '.join(EMBEDDING_MODULES)})")
    layer_index = int(match.group(1))
    if layer_index >= hf_config.num_hidden_layers:
        raise ValueError(f"LoRA adapter {lora_path!r}: tensor {name!r} is for layer {layer_index}; the base model has "
                         f"{hf_config.num_hidden_layers}")
    return layer_index, match.group(2), match.group(3)


def _checked_modules(lora_path: str, hf_config, peft: PEFTHelper, weights
                     ) -> dict[tuple[int | None, str], dict[str, str]]:
    """check_local_checkpoint's modules, from the names and shapes of the open ``weights``."""
    from pagedllm.models.registry import get_model_architecture

    dense_mlp = get_model_architecture(hf_config).dense_mlp
    shapes, outside = slice_shapes(hf_config), embedding_shapes(hf_config)
    found: dict[tuple[int | None, str], dict[str, tuple[int, ...]]] = {}
    names: dict[tuple[int | None, str], dict[str, str]] = {}
    for name in weights.keys():
        if name.endswith(_BASE_EMBEDDING_WEIGHTS):
            continue
        layer_index, module, ab = _parsed(lora_path, hf_config, name)
        if layer_index is not None and module.startswith("mlp.") and not dense_mlp(hf_config, layer_index):
            raise ValueError(f"LoRA adapter {lora_path!r}: tensor {name!r} is for layer {layer_index}'s MLP; the "
                             f"base model's is a mixture of experts, on which pagedllm serves no adapters")
        found.setdefault((layer_index, module), {})[ab] = tuple(weights.get_slice(name).get_shape())
        names.setdefault((layer_index, module), {})[ab] = name
    order = sorted(found, key=lambda key: (key[0] is not None, key[0] or 0, key[1]))
    for layer_index, module in order:
        ab, where = found[(layer_index, module)], module if layer_index is None else f"layer {layer_index} {module}"
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {lora_path!r}: {where} has lora_{''.join(ab)} without its pair")
        if layer_index is None:
            in_features, out_features = outside[module]
        else:
            fused, slice_index = LORA_TARGETS[module]
            covered = shapes[fused] if slice_index is None else [shapes[fused][slice_index]]
            in_features, out_features = covered[0][0], sum(out for _, out in covered)
        rank = peft.rank_and_scaling(module_name(names[(layer_index, module)]["A"]))[0]
        if ab["A"] != (rank, in_features) or ab["B"] != (out_features, rank):
            raise ValueError(f"LoRA adapter {lora_path!r}: {where} has A {ab['A']} and B {ab['B']}; the base model "
                             f"needs A ({rank}, {in_features}) and B ({out_features}, {rank}) for rank {rank}")
    if not found:
        raise ValueError(f"LoRA adapter {lora_path!r} holds no LoRA weights")
    return {key: names[key] for key in order}
