"""The TRITON_ATTN attention backend (the CUDA platform's) end to end on the CPU, its kernels run by Triton's
interpreter: greedy tokens equal transformers' through the engine process, with prefill chunks beside decode rows,
preemption and recomputation, GQA, a sliding window and soft-capped scores, and speculative verify steps. The
same device-generic path (model runner, loader, worker) a GPU runs, less the device."""
import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, Qwen2Config, Qwen2ForCausalLM

from pagedllm import SamplingParams
from tests.e2e.conftest import assert_transformers_greedy, running_llm
from tests.e2e.test_spec_decode import GREEDY, GREEDY_PROMPTS, save_tiny_llama, tiny_speculative_config
from tests.e2e.test_tiny_models import _save_tiny

pytest.importorskip("triton")
# tests/conftest.py turned Triton's interpreter on where torch sees no GPU; where it sees one, tests/e2e/test_cuda.py
# runs this backend compiled.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: test_cuda.py covers the backend")

PROMPTS = [[1, 50, 60, 70], list(range(200, 237)), list(range(1000, 1100, 3)), list(range(3000, 3020))]


@pytest.mark.parametrize("config_cls, model_cls, extra", [
    (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    # Gemma 2: a local layer (window 8) and a global one, attention scores soft-capped
    (Gemma2Config, Gemma2ForCausalLM, {"sliding_window": 8, "head_dim": 16, "query_pre_attn_scalar": 16,
                                       "attn_logit_softcapping": 5.0, "final_logit_softcapping": 10.0}),
], ids=["qwen2-gqa", "gemma2-window-softcap"])
def test_triton_attention_greedy_parity(tmp_path, tokenizer, config_cls, model_cls, extra):
    """4 mixed prompts x 24 tokens, prefills chunked by a 32-token budget, a cache of 8 blocks (128 tokens) for the
    ~190 tokens they come to: requests are preempted and recomputed."""
    reference = _save_tiny(tmp_path, tokenizer, config_cls, model_cls, **extra)
    with running_llm(str(tmp_path), dtype="float32", max_model_len=512, num_kv_blocks=8, max_num_batched_tokens=32,
                     attention_backend="TRITON_ATTN") as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                               SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        assert llm.get_stats().num_preemptions > 0
    assert_transformers_greedy(reference, PROMPTS, [o.outputs[0].token_ids for o in outputs], 24)


def test_triton_attention_verifies_drafts(tmp_path, tokenizer):
    """n-gram speculation with a tiny model over 8 tokens, whose outputs repeat: verify steps put several query rows
    per request into the prefill kernel; the tokens stay transformers' greedy ones."""
    reference = save_tiny_llama(tmp_path, tokenizer, seed=0, num_layers=2)
    with running_llm(str(tmp_path), dtype="float32", max_model_len=256, attention_backend="TRITON_ATTN",
                     speculative_config=tiny_speculative_config("ngram", None)) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in GREEDY_PROMPTS], GREEDY, use_tqdm=False)
        assert llm.get_stats().spec_decode_num_accepted_tokens > 0
    assert_transformers_greedy(reference, GREEDY_PROMPTS, [o.outputs[0].token_ids for o in outputs], 24, (2,))
