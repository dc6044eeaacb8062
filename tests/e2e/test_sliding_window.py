"""A sliding-window model (tiny Mistral, window 8) through the engine: greedy tokens equal transformers' with
prompts and outputs longer than the window, chunked prefill and decode steps replayed from CPU graphs; blocks out
of the window go back to the pool, so requests whose whole histories would not fit together run without
preemption; prefix-cache hits (only the window before a hit's end cached) give the same tokens. A hybrid model
(tiny Gemma 2, local and global layers) does the same for its local layers' blocks, in KV cache groups."""
from __future__ import annotations

import pytest
from transformers import Gemma2Config, Gemma2ForCausalLM, MistralConfig, MistralForCausalLM

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
    assert [group.sliding_window for group in manager.groups] == [WINDOW]
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
    assert [group.sliding_window for group in scheduler.kv_cache_manager.groups] == [WINDOW]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert_transformers_greedy(reference, PROMPTS, [o.outputs[0].token_ids for o in outputs], MAX_TOKENS)
    stats = scheduler.make_stats()
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 2 * NUM_KV_BLOCKS
    llm.shutdown()


def test_a_hybrid_model_gives_back_its_local_layers_blocks(tmp_path, tokenizer, monkeypatch):
    """Gemma 2 (four layers, local with a window of 8 and global alternating): two KV cache groups over one pool,
    each layer pair (a local and a global one) sharing cache tensors, steps replaying CPU graphs. The local group
    gives back the blocks out of its window while the global group keeps every request's history: greedy tokens
    equal transformers', each request holds at most a step's window of blocks in the local group, and requests
    whose histories in both groups (76 blocks) would not fit the pool run without preemption; a prefix hit gives
    the same tokens again."""
    reference = _save_tiny(tmp_path, tokenizer, Gemma2Config, Gemma2ForCausalLM, num_hidden_layers=4,
                           sliding_window=WINDOW, head_dim=64, query_pre_attn_scalar=64)
    replays = []
    replay = CpuGraph.replay
    monkeypatch.setattr(CpuGraph, "replay", lambda self: replays.append(self) or replay(self))
    num_blocks = 60  # the histories take 38 blocks a group; 3 requests x at most 7 local ones on top
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=512, num_kv_blocks=num_blocks, block_size=BLOCK_SIZE,
              max_num_batched_tokens=16)
    core = llm.llm_engine.engine_core.engine_core
    manager = core.scheduler.kv_cache_manager
    assert [group.sliding_window for group in manager.groups] == [None, WINDOW]
    runner = core.executor.worker.model_runner
    assert len(runner.kv_caches) == 4 and len({id(key) for key, _ in runner.kv_caches}) == 2
    local_held = []
    allocate = manager.allocate_slots

    def allocate_and_count(*args, **kwargs):
        blocks = allocate(*args, **kwargs)
        null = manager.block_pool.null_block
        local_held.extend(sum(b is not null for b in local) for _, local in manager.req_to_blocks.values())
        return blocks
    monkeypatch.setattr(manager, "allocate_slots", allocate_and_count)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    first = [o.outputs[0].token_ids for o in outputs]
    assert_transformers_greedy(reference, PROMPTS, first, MAX_TOKENS)
    assert core.scheduler.num_preemptions == 0
    # at most the blocks of a 16-token step and the window before it
    assert max(local_held) <= -(-(WINDOW - 1 + 16) // BLOCK_SIZE) + 1
    assert manager.block_pool.get_num_free_blocks() == num_blocks
    if native.gemm() is not None:  # steps replayed graphs over both groups' block tables
        assert replays and not runner.step_graphs._refused
    # The longest prompt twice, one token each: the second hits the first's blocks in both groups (the first run's
    # local blocks went back to the pool as the window passed them, and were reused).
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], one, use_tqdm=False)
    hits_before = manager.prefix_cache_hits
    again = llm.generate([{"prompt_token_ids": PROMPTS[0]}], one, use_tqdm=False)
    assert again[0].outputs[0].token_ids == first[0][:1]
    assert manager.prefix_cache_hits - hits_before == 36  # 9 blocks of 4 (the last token is recomputed)
    llm.shutdown()


def test_a_hybrid_model_speculating_with_itself_as_its_draft(tmp_path, tokenizer):
    """The hybrid Gemma 2 drafting for itself (draft_model, the same weights): the draft reads through the target's
    first KV cache group's table (the global layers': every block of the history) while the target's local group
    frees its blocks; in float32 every draft is the target's token, so a draft or verify step reading a block the
    local group gave back would show as a rejection. Greedy stays transformers'."""
    reference = _save_tiny(tmp_path, tokenizer, Gemma2Config, Gemma2ForCausalLM, num_hidden_layers=4,
                           sliding_window=WINDOW, head_dim=64, query_pre_attn_scalar=64)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=512, num_kv_blocks=120, block_size=BLOCK_SIZE,
              max_num_batched_tokens=16,
              speculative_config={"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 3})
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    assert [group.sliding_window for group in scheduler.kv_cache_manager.groups] == [None, WINDOW]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert_transformers_greedy(reference, PROMPTS, [o.outputs[0].token_ids for o in outputs], MAX_TOKENS)
    stats = scheduler.make_stats()
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 120
    llm.shutdown()
