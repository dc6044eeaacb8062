"""A sliding-window model (tiny Mistral, window 8) through the engine: greedy tokens equal transformers' with
prompts and outputs longer than the window, chunked prefill and decode steps replayed from CPU graphs; blocks out
of the window go back to the pool, so requests whose whole histories would not fit together run without
preemption; prefix-cache hits (only the window before a hit's end cached) give the same tokens."""
from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from pagedllm import LLM, SamplingParams, native
from pagedllm.core.kv_cache_utils import make_block_hasher
from pagedllm.core.request import Request
from pagedllm.native.graph import CpuGraph
from tests.e2e.conftest import assert_transformers_greedy
from tests.e2e.test_tiny_models import _save_tiny

pytestmark = pytest.mark.usefixtures("share_loaded_models")  # the test inspects the scheduler and the worker

WINDOW, BLOCK_SIZE, MAX_TOKENS = 8, 4, 24
PROMPTS = [list(range(200, 237)), [1, 50, 60, 70], list(range(1000, 1100, 3))]
# Without freeing, the three requests hold 61, 28 and 58 tokens: 38 blocks of 4, more than this pool.
NUM_KV_BLOCKS = 24


def test_mistral_sliding_window_through_the_engine(tmp_path, tokenizer, monkeypatch):
    reference = _save_tiny(tmp_path, tokenizer, MistralConfig, MistralForCausalLM, head_dim=64,
                           sliding_window=WINDOW, tie_word_embeddings=False)
    replays = []
    replay = CpuGraph.replay
    monkeypatch.setattr(CpuGraph, "replay", lambda self: replays.append(self) or replay(self))
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=512, num_kv_blocks=NUM_KV_BLOCKS,
              block_size=BLOCK_SIZE, max_num_batched_tokens=16)
    core = llm.llm_engine.engine_core.engine_core
    manager = core.scheduler.kv_cache_manager
    assert manager.sliding_window == WINDOW
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    first = [o.outputs[0].token_ids for o in outputs]
    assert_transformers_greedy(reference, PROMPTS, first, MAX_TOKENS)
    assert core.scheduler.num_preemptions == 0  # each request held about its window, not its history
    assert manager.block_pool.get_num_free_blocks() == NUM_KV_BLOCKS  # nothing leaked
    if native.gemm() is not None:
        assert replays, "no decode step replayed a CPU graph"

    # The longest prompt again: its blocks are cached now. Then evict its first 7 of 9 full blocks: a hit still
    # reaches the prompt's end, its first blocks null (the next query sees only the last 2), and gives the same.
    again = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    assert again[0].outputs[0].token_ids == first[0]
    pool = manager.block_pool
    hashes = Request("r", PROMPTS[0], params, block_hasher=make_block_hasher(BLOCK_SIZE)).block_hashes
    assert all(pool.get_cached_block(h) is not None for h in hashes)
    for block_hash in hashes[:7]:
        pool._maybe_evict_cached_block(pool.get_cached_block(block_hash))
    hits_before = manager.prefix_cache_hits
    again = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    assert again[0].outputs[0].token_ids == first[0]
    assert manager.prefix_cache_hits - hits_before == 36  # 9 blocks of 4 (the last token is recomputed)
    assert pool.get_num_free_blocks() == NUM_KV_BLOCKS
    llm.shutdown()


def test_mistral_sliding_window_self_speculation(tmp_path, tokenizer):
    """The model drafts for itself (draft_model, the same weights): in float32 every draft is the target's token,
    so a draft or a verify step (the native prefill tiles, replayed from CPU graphs) reading a position outside
    its window, or a block freed under it, would show as a rejection; greedy stays transformers'."""
    reference = _save_tiny(tmp_path, tokenizer, MistralConfig, MistralForCausalLM, head_dim=64,
                           sliding_window=WINDOW, tie_word_embeddings=False)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=512, num_kv_blocks=2 * NUM_KV_BLOCKS,
              block_size=BLOCK_SIZE, max_num_batched_tokens=16,
              speculative_config={"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 3})
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    assert scheduler.kv_cache_manager.sliding_window == WINDOW
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert_transformers_greedy(reference, PROMPTS, [o.outputs[0].token_ids for o in outputs], MAX_TOKENS)
    stats = scheduler.make_stats()
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 2 * NUM_KV_BLOCKS
    llm.shutdown()
