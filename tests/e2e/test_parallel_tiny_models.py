"""Tensor x pipeline parallelism on tiny random Llama, Qwen2 (also with windowed layers beside a full one, in KV
cache groups), Qwen3 and Phi-3 models (GQA: 4 attention heads, 2 KV
heads, so tp=2 splits both) holds the oracle: greedy float32 output token for token equal to transformers', on the
multi-process executor; Qwen3 (per-head q/k norms) also on one rank, where decode steps replay CPU graphs. Phi-3's
checkpoint holds q/k/v and gate/up fused: each rank cuts its slice of each out of them. So do the mixture-of-experts
models (4 experts, 2 per token): Mixtral with tp=2 splitting every expert's intermediate size, Qwen2-MoE (shared
expert, one dense layer) with tp=2 and expert parallelism (each rank holds two whole experts), Qwen3-MoE on one
rank."""
from __future__ import annotations

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, Phi3Config,
                          Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

from pagedllm import SamplingParams
from tests.e2e.conftest import assert_transformers_greedy, running_llm

VOCAB = 49152  # the SmolLM2 tokenizer is saved beside the weights so the directory is a complete model
MODELS = {"llama": (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": False}),
          "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True}),
          # a full-attention layer, then three windowed ones: four KV cache groups of one layer each, the layers of
          # a pipeline stage sharing one cache tensor (core/kv_cache_groups.py)
          "qwen2_hybrid": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True, "use_sliding_window": True,
                                                          "sliding_window": 8, "max_window_layers": 1}),
          "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"tie_word_embeddings": True}),
          "mixtral": (MixtralConfig, MixtralForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2}),
          "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM,
                        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                         "shared_expert_intermediate_size": 256, "mlp_only_layers": [2]}),
          "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                         "norm_topk_prob": True}),
          "phi3": (Phi3Config, Phi3ForCausalLM, {"tie_word_embeddings": False})}
# Short and long prompts sharing a prefix (prefix-cache hits), chunked into 32-token steps, in a cache of 10 blocks
# (160 tokens) for the ~270 they come to: each is admitted once the free blocks hold its whole prompt (vLLM's
# scheduler_reserve_full_isl), and their outputs then outgrow the pool: requests are preempted and recomputed.
PROMPTS = [[1, 50, 60, 70], list(range(200, 237)), list(range(200, 300)), list(range(1000, 1150, 3))]
MAX_TOKENS = 20


def save_tiny_model(path, tokenizer, name: str):
    config_cls, model_cls, extra = MODELS[name]
    config = config_cls(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                        initializer_range=0.3, eos_token_id=2, bos_token_id=1, **extra)
    torch.manual_seed(0)
    model = model_cls(config).eval()
    for name, param in model.named_parameters():
        if name.endswith(("q_norm.weight", "k_norm.weight")):  # not the initial ones: the norms must apply
            param.data.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return model


def generate(path, on_engine=None, num_kv_blocks: int = 10, **parallel) -> list[list[int]]:
    """Greedy outputs of PROMPTS; ``on_engine`` is called while the engine runs."""
    with running_llm(str(path), dtype="float32", max_model_len=512, num_kv_blocks=num_kv_blocks,
                     max_num_batched_tokens=32, **parallel) as llm:
        if on_engine is not None:
            on_engine()
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                               SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
        assert llm.get_stats().num_preemptions > 0
    return [o.outputs[0].token_ids for o in outputs]


def assert_parity(reference, outputs: list[list[int]]) -> None:
    assert_transformers_greedy(reference, PROMPTS, outputs, MAX_TOKENS)


@pytest.mark.parametrize("name, parallel", [
    ("llama", dict(tensor_parallel_size=2)),
    ("qwen2", dict(tensor_parallel_size=2, pipeline_parallel_size=2)),
    # blocks of one layer's bytes (a group's): pools small enough to preempt (the memory of 6 blocks of every layer;
    # the longest request needs 20, 8 in the full-attention group and 4 in each windowed one; with 32, requests
    # admitted only once their whole prompts fit never outgrow the pool), under pipeline and under tensor parallelism
    ("qwen2_hybrid", dict(tensor_parallel_size=1, pipeline_parallel_size=2, num_kv_blocks=24)),
    ("qwen2_hybrid", dict(tensor_parallel_size=2, num_kv_blocks=24)),
    ("qwen3", dict(tensor_parallel_size=2)),
    ("qwen3", dict(tensor_parallel_size=1)),
    ("mixtral", dict(tensor_parallel_size=2)),
    ("qwen2_moe", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
    ("qwen3_moe", dict(tensor_parallel_size=1)),
    ("phi3", dict(tensor_parallel_size=2)),
])
def test_tiny_model_parallel_parity_mp(tmp_path, tokenizer, name, parallel):
    reference = save_tiny_model(tmp_path, tokenizer, name)
    assert_parity(reference, generate(tmp_path, distributed_executor_backend="mp", **parallel))
