"""dtype=bfloat16 on a CPU with bf16 arithmetic (AMX or AVX512-BF16): bf16 GEMM weight panels, float32
activations, a bf16 KV cache (KernelChoice.bf16_panels). Its greedy tokens against float32's, teacher-forced as
bf16 rounding flips near-ties; CPU graphs replay its decode steps. Skipped where gemm_bf16.c has no body."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams, native
from tests.model_fixtures import teacher_forced

pytestmark = [pytest.mark.skipif(native.gemm_bf16() is None, reason="no AVX512-BF16 on this CPU (or no compiler)"),
              pytest.mark.usefixtures("share_loaded_models")]  # the tests reach into the worker

PROMPTS = ["The capital of France is", "Write a short poem about the sea.", "def fibonacci(n):",
           "List three primary colors:", "Water boils at a temperature of"]
NUM_TOKENS = 24
LLM_ARGS = dict(max_model_len=512, kv_cache_memory="64MiB")


@pytest.fixture(scope="module")
def engines():
    with pytest.MonkeyPatch.context() as patcher:
        patcher.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")  # the worker's model and cache, in process
        yield LLM(dtype="float32", **LLM_ARGS), LLM(dtype="bfloat16", **LLM_ARGS)


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.engine_core.executor.worker.model_runner


def test_bf16_weight_panels_float32_activations_bf16_cache(engines):
    _, bf16 = engines
    runner = _runner(bf16)
    assert runner.kernels.bf16_panels and runner.kernels.compute_dtype == torch.float32
    dense = runner.model.model.layers[0].self_attn.qkv_proj.quant_method.dense
    assert dense.panels.dtype == torch.bfloat16 and dense.data is None
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    # Twice float32's blocks in the same cache memory (the scheduler's; each cache also holds the CPU graphs'
    # padding block).
    blocks = [llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.num_blocks for llm in engines]
    assert blocks[1] // 2 == blocks[0] and runner.kv_caches[0][0].shape[0] == blocks[1] + 1


def test_greedy_tokens_agree_with_float32(engines):
    dense, bf16 = engines
    greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    expected = [o.prompt_token_ids + list(o.outputs[0].token_ids)
                for o in dense.generate(PROMPTS, greedy, use_tqdm=False)]
    ours = [list(o.outputs[0].token_ids) for o in bf16.generate(PROMPTS, greedy, use_tqdm=False)]
    assert all(e[-NUM_TOKENS] == o[0] for e, o in zip(expected, ours))  # every prompt's first token

    ranks, deltas = teacher_forced(bf16, dense, expected, NUM_TOKENS)
    agreement = sum(rank == 1 for rank in ranks) / len(ranks)
    print(f"bf16 panels vs float32: teacher-forced agreement {agreement:.3f}, max |logprob diff| {max(deltas):.2e}")
    assert agreement >= 0.9
    assert 0 < max(deltas) < 1.0  # bf16 weights: a different computation, and a close one


def test_decode_steps_replay_graphs_with_the_same_tokens(engines):
    _, bf16 = engines
    greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    graphed = [o.outputs[0].token_ids for o in bf16.generate(PROMPTS, greedy, use_tqdm=False)]
    graphs = _runner(bf16).step_graphs
    assert any(static.graphs for static in graphs._by_shape.values()) and not graphs._refused
    with pytest.MonkeyPatch.context() as patcher:
        patcher.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
        eager = LLM(dtype="bfloat16", enforce_eager=True, **LLM_ARGS)
    assert [o.outputs[0].token_ids for o in eager.generate(PROMPTS, greedy, use_tqdm=False)] == graphed


def test_chat_answers_paris(engines):
    out = engines[1].chat([{"role": "user", "content": "What is the capital of France?"}],
                          SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
