"""Shared helpers for the model tests: a paged-batch builder and cached
reference models, loaded once per pytest process (GGUF parsing is slow)."""

import functools
import json
import os
import random
import unittest.mock
from collections.abc import Callable
from dataclasses import dataclass

import gguf
import numpy as np
import torch
from transformers import AutoModelForCausalLM
from transformers.initialization import no_init_weights
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from pagedllm import SamplingParams
from pagedllm.layers.attention import AttentionMetadata, allocate_kv_caches
from pagedllm.models.hf_config import load_hf_config
from pagedllm.models.loader import get_model
from pagedllm.platforms.interface import KernelChoice
from pagedllm.models.resolve import DEFAULT_MODEL, resolve_model


@functools.lru_cache(maxsize=1)
def smollm_path() -> str:
    return resolve_model(DEFAULT_MODEL)


@functools.lru_cache(maxsize=1)
def smollm_model() -> torch.nn.Module:
    """Our float32 SmolLM2 loaded from the GGUF file."""
    return get_model(smollm_path(), load_hf_config(smollm_path()), KernelChoice(torch.float32))


@functools.lru_cache(maxsize=1)
def smollm_reference_tensors() -> dict[str, torch.Tensor]:
    """transformers' own GGUF dequantization and renaming, as from_pretrained does it.

    (from_pretrained(gguf_file=...) itself requires accelerate, which is not a dependency.)
    """
    # transformers builds gguf's name map anew for each of the model's ~400 modules (most of the load's time); the
    # map depends only on (architecture, number of blocks), so one per pair serves them all.
    with unittest.mock.patch.object(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map)):
        return load_gguf_checkpoint(smollm_path(), return_tensors=True,
                                    model_to_load=_empty_reference())["tensors"]


@functools.lru_cache(maxsize=1)
def smollm_reference() -> torch.nn.Module:
    """transformers' float32 model with the GGUF weights."""
    model = _empty_reference()
    result = model.load_state_dict(smollm_reference_tensors(), strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
    model.tie_weights()
    return model.eval()


def _empty_reference() -> torch.nn.Module:
    with no_init_weights():
        return AutoModelForCausalLM.from_config(load_hf_config(smollm_path()), dtype=torch.float32)


@dataclass
class Chunk:
    """``num_new`` tokens of request ``req`` starting at position ``start``."""

    req: int
    start: int
    num_new: int


class PagedBatchRunner:
    """Drives a model step by step like the engine: flattened batches, a paged
    KV cache, and block ids handed out in shuffled order."""

    def __init__(self, model, config, block_size: int = 16, num_blocks: int = 64,
                 dtype: torch.dtype = torch.float32, seed: int = 0):
        self.model = model
        self.block_size = block_size
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.kv_caches = allocate_kv_caches(
            config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads, head_dim, dtype
        )
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_ids: dict[int, list[int]] = {}

    def step(self, tokens: dict[int, list[int]], chunks: list[Chunk]) -> list[torch.Tensor]:
        """Run one step; returns each chunk's float32 logits ``[num_new, vocab]``."""
        input_ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
        for c in chunks:
            blocks = self.block_ids.setdefault(c.req, [])
            while len(blocks) * self.block_size < c.start + c.num_new:
                blocks.append(self.free_blocks.pop())
            for pos in range(c.start, c.start + c.num_new):
                input_ids.append(tokens[c.req][pos])
                positions.append(pos)
                slots.append(blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
            qsl.append(qsl[-1] + c.num_new)
            seq_lens.append(c.start + c.num_new)
        width = max(len(self.block_ids[c.req]) for c in chunks) + 1  # + padding column
        block_table = torch.full((len(chunks), width), 10**6, dtype=torch.int32)  # padding must be ignored
        for i, c in enumerate(chunks):
            block_table[i, : len(self.block_ids[c.req])] = torch.tensor(self.block_ids[c.req])
        metadata = AttentionMetadata(
            num_actual_tokens=len(input_ids),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=block_table,
            max_query_len=max(c.num_new for c in chunks),
            max_seq_len=max(seq_lens),
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), self.kv_caches, metadata)
            logits = self.model.compute_logits(hidden)
        return list(logits.split([c.num_new for c in chunks]))


def save_pickled(model: torch.nn.Module, path, num_shards: int = 1) -> None:
    """``model`` as transformers saved checkpoints before safetensors (save_pretrained(safe_serialization=False),
    which transformers 5 no longer offers): its config and its state dict torch.save'd, in pytorch_model.bin or
    in ``num_shards`` files pytorch_model-0000i-of-0000n.bin that pytorch_model.bin.index.json names."""
    model.config.save_pretrained(path)
    state = model.state_dict()
    if num_shards == 1:
        torch.save(state, os.path.join(path, "pytorch_model.bin"))
        return
    weight_map = {}
    for i in range(num_shards):
        shard = f"pytorch_model-{i + 1:05d}-of-{num_shards:05d}.bin"
        names = list(state)[i::num_shards]
        torch.save({name: state[name] for name in names}, os.path.join(path, shard))
        weight_map.update(dict.fromkeys(names, shard))
    with open(os.path.join(path, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def write_tiny_gguf(model: torch.nn.Module, path: str, arch: str,
                    layer_type: gguf.GGMLQuantizationType | Callable[[str], gguf.GGMLQuantizationType] | None = None,
                    extra: Callable[[gguf.GGUFWriter], None] | None = None) -> None:
    """Write an HF model as a GGUF the way llama.cpp's converter does,
    naming tensors with gguf-py's own map and permuting llama q/k rows (Gemma: its head size and soft caps in the
    metadata, its norm weights with their one added, no output tensor: it is tied);
    unquantized, or with the decoder layers' linear weights (and stacked experts) in ``layer_type``
    (or in the type it gives for each HF module name). ``extra`` adds what else the converter would write (rope
    scaling metadata, rope_freqs) to the writer before the file is written."""
    config = model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    # Gemma 3's parameters per kind of layer: llama.cpp's file holds the global layers' base (its local one is fixed)
    writer.add_rope_freq_base(config.rope_parameters.get("full_attention", config.rope_parameters)["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    num_experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if num_experts:  # a mixture of experts: llama.cpp stacks each projection's experts into one tensor
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if arch != "llama":
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if getattr(config, "shared_expert_intermediate_size", None):
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if getattr(config, "sliding_window", None):  # as llama.cpp's converter writes Phi-3's
        writer.add_sliding_window(config.sliding_window)
    gemma = arch in ("gemma2", "gemma3")
    if gemma:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        if config.attn_logit_softcapping is not None:
            writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        if config.final_logit_softcapping is not None:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
    model_arch = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    name_map = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    for name, tensor in _stacked_experts(model.state_dict()).items():
        base, suffix = name.rsplit(".", 1)
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        weight = tensor.float().numpy()
        if gemma and base.endswith("norm"):
            weight = weight + 1.0
        if base.endswith("shared_expert_gate"):
            weight = weight.reshape(-1)  # llama.cpp's shape for its one row
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            n_head = config.num_attention_heads if base.endswith("q_proj") else config.num_key_value_heads
            weight = _llama_cpp_permute(weight, n_head)
        if layer_type is not None and base.startswith("model.layers.") and weight.ndim >= 2:
            tensor_type = layer_type(base) if callable(layer_type) else layer_type
            blocks = quantize_gguf(weight.reshape(-1, weight.shape[-1]), tensor_type)  # an expert stack: row-wise
            writer.add_tensor(f"{name_map.get_name(base)}.{suffix}", blocks.reshape(*weight.shape[:-1], -1),
                              raw_dtype=tensor_type)
            continue
        writer.add_tensor(f"{name_map.get_name(base)}.{suffix}", weight)
    if extra is not None:
        extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantize_gguf(weight: np.ndarray, tensor_type: gguf.GGMLQuantizationType) -> np.ndarray:
    """``weight`` ``[rows, cols]`` as GGUF blocks of ``tensor_type``: gguf-py's quantizer, or for Q4_K, Q5_K and Q6_K
    (which it lacks) quantize_q4_k and quantize_q6_k."""
    if tensor_type in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K):
        return quantize_q4_k(weight, five_bits=tensor_type == gguf.GGMLQuantizationType.Q5_K)
    if tensor_type == gguf.GGMLQuantizationType.Q6_K:
        return quantize_q6_k(weight)
    return gguf.quants.quantize(weight, tensor_type)


def quantize_q4_k(weight: np.ndarray, five_bits: bool = False) -> np.ndarray:
    """A plain Q4_K (``five_bits``: Q5_K) quantizer (round to nearest; llama.cpp's searches its scales): per 32
    weights along a row a 6-bit scale and min, per 256 an fp16 ``d`` and ``dmin`` they multiply, codes ``q`` with
    ``w ~ d sc q - dmin m``. Returns the blocks as llama.cpp lays them out (144 bytes per 256 weights; Q5_K: 176, the
    codes' fifth bits between the scales and the low nibbles)."""
    rows, top = weight.shape[0], 31 if five_bits else 15
    w = weight.astype(np.float32).reshape(rows, -1, 8, 32)
    low, high = np.minimum(w.min(-1), 0), np.maximum(w.max(-1), 0)
    scale, minimum = (high - low) / top, -low
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (minimum.max(-1) / 63).astype(np.float16)

    def six_bits(values, unit):
        unit = unit.astype(np.float32)[..., None]
        return np.clip(np.round(np.divide(values, unit, out=np.zeros_like(values), where=unit > 0)), 0, 63
                       ).astype(np.uint8)

    sc, m = six_bits(scale, d), six_bits(minimum, dmin)
    step = d.astype(np.float32)[..., None] * sc
    offset = dmin.astype(np.float32)[..., None] * m
    q = np.divide(w + offset[..., None], step[..., None], out=np.zeros_like(w), where=step[..., None] > 0)
    q = np.clip(np.round(q), 0, top).astype(np.uint8)
    packed = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), m[..., :4] | ((m[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)], axis=-1)
    qs = ((q[..., 0::2, :] & 0x0F) | ((q[..., 1::2, :] & 0x0F) << 4)).reshape(*q.shape[:2], 128)
    fifth = [sum((((q[..., i, :] >> 4) & 1) << i) for i in range(8)).astype(np.uint8)] if five_bits else []
    blocks = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), packed, *fifth, qs], axis=-1)
    return blocks.reshape(rows, -1)


def quantize_q6_k(weight: np.ndarray) -> np.ndarray:
    """A plain Q6_K quantizer (round to nearest): per 16 weights along a row an int8 scale, per 256 an fp16 ``d``
    it multiplies, 6-bit codes ``q`` with ``w ~ d sc (q - 32)``. Returns the blocks as llama.cpp lays them out (210
    bytes per 256: the codes' low nibbles, their high two bits, the scales, d)."""
    rows = weight.shape[0]
    w = weight.astype(np.float32).reshape(rows, -1, 16, 16)
    scale = np.abs(w).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16)
    unit = d.astype(np.float32)[..., None]
    sc = np.clip(np.round(np.divide(scale, unit, out=np.zeros_like(scale), where=unit > 0)), 0, 127).astype(np.int8)
    step = (unit * sc)[..., None]
    q = np.clip(np.round(np.divide(w, step, out=np.zeros_like(w), where=step > 0)), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(rows, -1, 2, 4, 32)  # per half of 128: four runs of 32
    low = np.concatenate([(q[..., 0, :] & 0x0F) | ((q[..., 2, :] & 0x0F) << 4),
                          (q[..., 1, :] & 0x0F) | ((q[..., 3, :] & 0x0F) << 4)], axis=-1)  # [rows, n, 2, 64]
    high = sum(((q[..., g, :] >> 4) & 0x03) << (2 * g) for g in range(4)).astype(np.uint8)  # [rows, n, 2, 32]
    blocks = np.concatenate([low.reshape(*q.shape[:2], 128), high.reshape(*q.shape[:2], 64), sc.view(np.uint8),
                             d[..., None].view(np.uint8)], axis=-1)
    return blocks.reshape(rows, -1)


def _stacked_experts(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with transformers' fused expert stacks (``...experts.gate_up_proj`` ``[experts, 2 * rows,
    cols]``, ``...experts.down_proj``) as the per-projection stacks gguf-py maps to the ``_exps`` tensors."""
    out = {}
    for name, tensor in state_dict.items():
        if name.endswith(".experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            out[name.replace("gate_up_proj", "gate_proj.weight")] = gate
            out[name.replace("gate_up_proj", "up_proj.weight")] = up
        elif name.endswith(".experts.down_proj"):
            out[name + ".weight"] = tensor
        else:
            out[name] = tensor
    return out


def _llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def teacher_forced(llm, reference, sequences: list[list[int]], num_tokens: int) -> tuple[list[int], list[float]]:
    """For the last ``num_tokens`` tokens of each sequence (the reference's greedy continuations), each predicted
    from the tokens before it: ``llm``'s rank of that token, and its |logprob difference| from ``reference``'s.
    The strict measure of two close models, where free-running a near-tie flipped by rounding sends the rest of
    a sequence elsewhere."""
    forced = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    prompts = [{"prompt_token_ids": ids} for ids in sequences]
    ours, theirs = ([o.prompt_logprobs[-num_tokens:] for o in engine.generate(prompts, forced, use_tqdm=False)]
                    for engine in (llm, reference))
    ranks, deltas = [], []
    for seq, lps_a, lps_b in zip(sequences, ours, theirs):
        for tok, a, b in zip(seq[-num_tokens:], lps_a, lps_b):
            ranks.append(a[tok].rank)
            deltas.append(abs(a[tok].logprob - b[tok].logprob))
    return ranks, deltas
