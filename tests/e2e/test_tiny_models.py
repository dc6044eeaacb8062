"""Engine-level greedy parity with transformers for tiny random-weight models saved as safetensors dirs (and, for
packed GGUF experts, with the same GGUF file loaded dense)."""
from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3Config, Gemma3ForCausalLM,
                          Gemma3ForConditionalGeneration, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Phi3Config,
                          Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, SiglipVisionConfig)

from pagedllm import SamplingParams, native
from pagedllm.native.graph import CpuGraph
from tests.e2e.conftest import assert_transformers_generate, assert_transformers_greedy, in_process_llm, running_llm
from tests.model_fixtures import save_pickled, write_tiny_gguf
from tests.test_moe import MOE_MODELS

VOCAB = 49152  # the SmolLM2 tokenizer is saved beside the weights so the directory is a complete model


def _save_tiny(tmp_path, tokenizer, config_cls, model_cls, **extra):
    values = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.5, eos_token_id=2,
                  bos_token_id=1, pad_token_id=0)
    config = config_cls(**{**values, **extra})
    torch.manual_seed(0)
    model = model_cls(config).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    tokenizer.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("config_cls, model_cls, extra", [
    (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": False}),
    (Phi3Config, Phi3ForCausalLM, {"tie_word_embeddings": False}),
    # the second layer attends to a window of 8, shorter than the prompts and outputs (test_sliding_window.py:
    # Mistral, every layer windowed)
    (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True, "use_sliding_window": True, "sliding_window": 8,
                                     "max_window_layers": 1}),
    # Gemma 3: a local layer (window 8, its own rope base) and a global one
    (Gemma3TextConfig, Gemma3ForCausalLM, {"sliding_window": 8, "head_dim": 16, "query_pre_attn_scalar": 16,
                                           "layer_types": ["sliding_attention", "full_attention"]}),
    # Gemma 2: its default layer types (local, global), soft caps that bite (scaled scores reach ~75 here, logits
    # ~35; a final cap of a few would tie the top logits at the cap in float32)
    (Gemma2Config, Gemma2ForCausalLM, {"sliding_window": 8, "head_dim": 16, "query_pre_attn_scalar": 16,
                                       "attn_logit_softcapping": 5.0, "final_logit_softcapping": 10.0}),
    # the same at head size 64, which the native prefill tiles take: steps with prompt chunks replay CPU graphs,
    # padded to whole blocks, under the window and the soft caps
    (Gemma2Config, Gemma2ForCausalLM, {"sliding_window": 8, "head_dim": 64, "query_pre_attn_scalar": 64,
                                       "attn_logit_softcapping": 5.0, "final_logit_softcapping": 10.0}),
])
def test_tiny_model_greedy_parity(tmp_path, tokenizer, config_cls, model_cls, extra):
    """4 mixed prompts x 24 tokens, prefills chunked by a 32-token budget, and a cache of 8 blocks (128 tokens) for
    the ~190 tokens they come to, so requests are preempted and recomputed."""
    reference = _save_tiny(tmp_path, tokenizer, config_cls, model_cls, **extra)
    prompts = [[1, 50, 60, 70], list(range(200, 237)), list(range(1000, 1100, 3)), list(range(3000, 3020))]
    with running_llm(str(tmp_path), dtype="float32", max_model_len=512, num_kv_blocks=8,
                     max_num_batched_tokens=32) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        assert llm.get_stats().num_preemptions > 0
    assert_transformers_greedy(reference, prompts, [o.outputs[0].token_ids for o in outputs], 24)


@pytest.mark.parametrize("num_shards, load_format", [(1, "auto"), (3, "auto"), (1, "pt")])
def test_a_pickled_checkpoint_serves_transformers_greedy_tokens(tmp_path, tokenizer, num_shards, load_format):
    """A checkpoint saved before safetensors (pytorch_model.bin, or shards that pytorch_model.bin.index.json names),
    with the Trainer's training_args.bin beside it (not weights, nor loadable with weights_only): vLLM's load_format
    "auto" falls back to the .bin files and leaves that one out; the engine process failed finding no safetensors.
    load_format="pt" loads a model.pt, not the model.safetensors beside it (zeros here), as vLLM's."""
    from safetensors.torch import load_file, save_file

    reference = _save_tiny(tmp_path, tokenizer, LlamaConfig, LlamaForCausalLM, tie_word_embeddings=False)
    safetensors = str(tmp_path / "model.safetensors")
    if load_format == "pt":
        save_file({name: torch.zeros_like(tensor) for name, tensor in load_file(safetensors).items()}, safetensors)
    else:
        os.unlink(safetensors)
    save_pickled(reference, tmp_path, num_shards)
    if load_format == "pt":
        (tmp_path / "pytorch_model.bin").rename(tmp_path / "model.pt")
    (tmp_path / "training_args.bin").write_bytes(b"a pickled TrainingArguments")
    prompts = [[1, 50, 60, 70], list(range(200, 237))]
    with running_llm(str(tmp_path), dtype="float32", max_model_len=512, load_format=load_format) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert_transformers_greedy(reference, prompts, [o.outputs[0].token_ids for o in outputs], 16)


def _no_decode_step_refused(graphs) -> bool:
    """Whether every step of decodes only (as many decode rows as requests) had its graph. Steps with prompt chunks
    may be refused here: the tiny models' head size of 16 has no native prefill tiles, so their chunks take torch."""
    return all(d < n for n, _, d, _, _ in graphs._refused)


@pytest.mark.parametrize("name", sorted(MOE_MODELS))
def test_moe_decode_steps_replay_cpu_graphs(tmp_path, tokenizer, monkeypatch, name):
    """Mixtral, Qwen2-MoE (shared expert, a dense layer) and Qwen3-MoE through the engine: the experts' routing is
    decided inside the native MoE kernel, so decode steps replay CPU graphs (none refused), and the tokens are
    transformers' greedy ones, while requests join and leave the batch."""
    if native.gemm() is None or native.fused_ops() is None:
        pytest.skip("no native GEMM here: MoE steps run eagerly")
    config_cls, model_cls, extra = MOE_MODELS[name]
    reference = _save_tiny(tmp_path, tokenizer, config_cls, model_cls, tie_word_embeddings=False, **extra)
    replays = []
    replay = CpuGraph.replay
    monkeypatch.setattr(CpuGraph, "replay", lambda self: replays.append(self) or replay(self))
    prompts = [[1, 50, 60, 70], list(range(200, 237)), list(range(1000, 1100, 3)), list(range(3000, 3020))]
    llm = in_process_llm(str(tmp_path), dtype="float32", max_model_len=512, max_num_batched_tokens=32)
    params = [SamplingParams(temperature=0, max_tokens=16 + 4 * i, ignore_eos=True) for i in range(len(prompts))]
    outputs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                            use_tqdm=False)]
    graphs = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.step_graphs
    llm.shutdown()
    assert graphs is not None and _no_decode_step_refused(graphs) and len(replays) >= 10
    for prompt, got, param in zip(prompts, outputs, params):
        assert_transformers_greedy(reference, [prompt], [got], param.max_tokens)


@pytest.mark.skipif(native.moe_bf16() is None or native.fused_ops() is None,
                    reason="no bf16 panels here (the CPU has no AVX512-BF16)")
def test_bf16_experts_in_panels_replay_cpu_graphs(tmp_path, tokenizer, monkeypatch):
    """A bfloat16 Mixtral on a CPU with bf16 panels keeps its experts in them (moe_bf16: one call a layer), so its
    decode steps replay CPU graphs (none refused), with the eager engine's greedy tokens."""
    config_cls, model_cls, extra = MOE_MODELS["mixtral"]
    _save_tiny(tmp_path, tokenizer, config_cls, model_cls, tie_word_embeddings=False, **extra)
    replays = []
    replay = CpuGraph.replay
    monkeypatch.setattr(CpuGraph, "replay", lambda self: replays.append(self) or replay(self))
    prompts = [{"prompt_token_ids": p} for p in ([1, 50, 60, 70], list(range(200, 237)), list(range(3000, 3020)))]
    params = [SamplingParams(temperature=0, max_tokens=16 + 4 * i, ignore_eos=True) for i in range(len(prompts))]
    tokens = {}
    for eager in (False, True):
        llm = in_process_llm(str(tmp_path), dtype="bfloat16", max_model_len=512, max_num_batched_tokens=32,
                             enforce_eager=eager)
        tokens[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
        assert runner.model.model.layers[0].block_sparse_moe.experts.quant_method.w13_panels is not None
        graphs = runner.step_graphs
        llm.shutdown()
        if not eager:
            assert graphs is not None and _no_decode_step_refused(graphs) and len(replays) >= 10
    assert tokens[False] == tokens[True]


@pytest.mark.skipif(native.gemm_q4() is None or native.gemm_q8() is None,
                    reason="no quantized GEMMs here: GGUF experts are dequantized")
def test_packed_gguf_experts_replay_cpu_graphs(tmp_path, model_path):
    """A Mixtral GGUF whose experts stay packed under quantization="gguf" (a Q4_0 gate, a Q8_0 up, a Q4_1 down):
    moe_quant.c decides the routing as it runs, so decode steps replay CPU graphs (none refused), and the greedy
    tokens are those of the same file loaded dense, while requests join and leave the batch."""
    config_cls, model_cls, extra = MOE_MODELS["mixtral"]
    torch.manual_seed(0)
    values = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.5, eos_token_id=2,
                  bos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    path = str(tmp_path / "mixtral.gguf")
    types = {"gate_proj": GGMLQuantizationType.Q4_0, "up_proj": GGMLQuantizationType.Q8_0}
    write_tiny_gguf(model_cls(config_cls(**values, **extra)).eval(), path, "llama",
                    layer_type=lambda name: next((t for key, t in types.items() if key in name),
                                                 GGMLQuantizationType.Q4_1))
    prompts = [[1, 50, 60, 70], list(range(200, 237)), list(range(1000, 1100, 3)), list(range(3000, 3020))]
    params = [SamplingParams(temperature=0, max_tokens=16 + 4 * i, ignore_eos=True) for i in range(len(prompts))]
    outputs = {}
    for quantization in (None, "gguf"):
        llm = in_process_llm(path, tokenizer=model_path, quantization=quantization, dtype="float32",
                             max_model_len=512, max_num_batched_tokens=32)
        replays = []
        replay = CpuGraph.replay
        with pytest.MonkeyPatch.context() as patcher:
            patcher.setattr(CpuGraph, "replay", lambda self: replays.append(self) or replay(self))
            outputs[quantization] = [o.outputs[0].token_ids for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
        experts = runner.model.model.layers[0].block_sparse_moe.experts
        llm.shutdown()
        assert type(experts.quant_method).__name__ == ("GGUFFusedMoEMethod" if quantization else
                                                       "UnquantizedFusedMoEMethod")
        assert runner.step_graphs is not None and _no_decode_step_refused(runner.step_graphs) and len(replays) >= 10
    assert outputs["gguf"] == outputs[None]


def save_tiny_gemma3_multimodal(path, tokenizer) -> Gemma3ForConditionalGeneration:
    """A tiny random Gemma 3 multimodal checkpoint (Gemma3ForConditionalGeneration, as the 4B and larger models
    ship: language model, SigLIP vision tower and projector, the text config nested), saved to ``path``."""
    text = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                            initializer_range=0.2, sliding_window=8, head_dim=16, query_pre_attn_scalar=16,
                            layer_types=["sliding_attention", "full_attention"], eos_token_id=2, bos_token_id=1,
                            pad_token_id=0, tie_word_embeddings=False)  # an LM head of its own: its name is mapped too
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=VOCAB - 1,
                          boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 3, tie_word_embeddings=False)
    torch.manual_seed(0)
    reference = Gemma3ForConditionalGeneration(config).eval()
    reference.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return reference


def test_gemma3_multimodal_checkpoint_runs_its_language_model(tmp_path, tokenizer):
    """A Gemma 3 multimodal checkpoint serves text prompts with its language model: the engine's greedy tokens are
    transformers' for the whole model on the same token ids."""
    reference = save_tiny_gemma3_multimodal(tmp_path, tokenizer)
    prompts = [[1, 50, 60, 70], list(range(200, 237)), list(range(1000, 1100, 3))]
    with running_llm(str(tmp_path), dtype="float32", max_model_len=512, max_num_batched_tokens=32) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert all(len(set(t)) > 12 for t in tokens)  # varied outputs, not one token repeated
    assert_transformers_greedy(reference, prompts, tokens, 24)


ORIGINAL = 32  # the original context (dynamic's is max_position_embeddings); the prompts fit it, outputs cross it
LONGROPE = dict(rope_type="longrope", short_factor=[1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7],
                long_factor=[1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0])


@pytest.mark.parametrize("config_cls, model_cls, extra", [
    (LlamaConfig, LlamaForCausalLM, dict(max_position_embeddings=ORIGINAL,
                                         rope_parameters=dict(rope_type="dynamic", factor=2.0))),
    (LlamaConfig, LlamaForCausalLM, dict(max_position_embeddings=2 * ORIGINAL, rope_parameters=dict(
        LONGROPE, original_max_position_embeddings=ORIGINAL))),
    # Phi-3's generate re-encodes the whole sequence with the long factors once it outgrows the original length
    # (Phi3ForCausalLM.prepare_inputs_for_generation), which a per-position table does not: within it only.
    (Phi3Config, Phi3ForCausalLM, dict(max_position_embeddings=4 * ORIGINAL,
                                       original_max_position_embeddings=2 * ORIGINAL, rope_parameters=dict(LONGROPE))),
], ids=["llama-dynamic", "llama-longrope", "phi3-longrope-within"])
def test_rope_scaling_matches_transformers_generate(tmp_path, tokenizer, config_cls, model_cls, extra):
    """dynamic and longrope change frequencies where the sequence outgrows the original length: the engine (its
    decode steps on CPU graphs, max_model_len 64 positions) generates what transformers' generate does after
    prompts within that length."""
    reference = _save_tiny(tmp_path, tokenizer, config_cls, model_cls, tie_word_embeddings=False, **extra)
    prompts = [[1, 50, 60, 70], list(range(200, 220)), list(range(1000, 1093, 3))]
    with running_llm(str(tmp_path), dtype="float32", max_model_len=2 * ORIGINAL, num_kv_blocks=32,
                     max_num_batched_tokens=32) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    assert_transformers_generate(reference, prompts, [o.outputs[0].token_ids for o in outputs], 30)
