"""The CUDA platform end to end on a GPU: skipped where torch sees none (CI); benchmarks/gpu_check.py runs it on a
GPU machine. The oracle is transformers' float32 model on the CPU, as for every other path."""
import pytest
import torch

from pagedllm import SamplingParams
from tests.e2e.conftest import assert_transformers_greedy, running_llm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA GPU")

# Eight prompts of mixed lengths: decode rows beside prefill chunks, contexts across many blocks.
PROMPTS = [[1, 50, 60, 70], list(range(200, 337)), list(range(1000, 1300, 3)), list(range(3000, 3020)),
           list(range(5000, 5250)), [7, 8, 9, 10, 11, 12], list(range(9000, 9061)), list(range(12000, 12400, 2))]


def test_greedy_parity_on_cuda_in_float32(hf_model):
    """8 prompts x 48 tokens, prefills chunked by a 64-token budget, a cache of 24 blocks (384 tokens) for the ~1,100
    they come to: requests admitted once their whole prompts fit outgrow it, and are preempted and recomputed."""
    with running_llm(device="cuda", dtype="float32", max_model_len=1024, num_kv_blocks=24,
                     max_num_batched_tokens=64) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                               SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)
        assert llm.get_stats().num_preemptions > 0
    assert_transformers_greedy(hf_model, PROMPTS, [o.outputs[0].token_ids for o in outputs], 48)


def test_auto_runs_on_the_gpu_in_bfloat16_with_a_profiled_cache():
    """device and dtype left to auto; the KV cache sized by gpu_memory_utilization after the profiling forward
    (which must hold one max_model_len request, or the engine would not start)."""
    with running_llm(max_model_len=2048, gpu_memory_utilization=0.5) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                               SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        config = llm.llm_engine.config
    assert (config.model_config.device, config.model_config.dtype) == ("cuda", torch.bfloat16)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [16] * len(PROMPTS)
