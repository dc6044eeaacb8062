"""Two engines in one process, one float32 and one bfloat16: each lays out its weights and picks its kernels for
itself (platforms/cpu.KernelChoice, handed to the loader), so neither changes what the other computes."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.platforms.cpu import choose_kernels
from tests.e2e.conftest import assert_transformers_greedy

PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 9519, 253, 1345, 19682, 563, 260, 1085, 30]]
NUM_TOKENS = 16
LLM_ARGS = dict(max_model_len=256, kv_cache_memory="32MiB")
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


def _tokens(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _first_projection(llm: LLM):
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    return runner.kernels, runner.model.model.layers[0].self_attn.qkv_proj.quant_method.dense


def test_float32_and_bfloat16_engines_side_by_side(hf_model):
    bf16_alone = LLM(dtype="bfloat16", **LLM_ARGS)  # the default: its own engine process
    try:
        expected_bf16 = _tokens(bf16_alone)
    finally:
        bf16_alone.shutdown()
    with pytest.MonkeyPatch.context() as patcher:
        patcher.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")  # both workers in this process
        f32 = LLM(dtype="float32", **LLM_ARGS)
        bf16 = LLM(dtype="bfloat16", **LLM_ARGS)
    f32_kernels, f32_dense = _first_projection(f32)
    bf16_kernels, bf16_dense = _first_projection(bf16)
    assert not f32_kernels.bf16_panels and f32_kernels.compute_dtype == torch.float32
    assert bf16_kernels == choose_kernels(torch.bfloat16)
    assert f32_dense.panels is None or f32_dense.panels.dtype == torch.float32
    if bf16_kernels.bf16_panels:
        assert bf16_dense.panels.dtype == torch.bfloat16 and bf16_dense.data is None

    first_f32 = _tokens(f32)
    assert_transformers_greedy(hf_model, PROMPTS, first_f32, NUM_TOKENS)
    assert _tokens(bf16) == expected_bf16
    assert _tokens(f32) == first_f32  # after the other engine ran
    f32.shutdown()
    bf16.shutdown()
