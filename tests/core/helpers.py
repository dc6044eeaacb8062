"""Builders for scheduler tests: requests, schedulers, a fake model runner, and the block-accounting checks."""
from __future__ import annotations

import itertools
from typing import Callable, Optional

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_cache_utils import make_block_hasher
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched.output import SchedulerOutput
from pagedllm.core.sched.scheduler import Scheduler
from pagedllm.engine.protocol import EngineCoreOutputs
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.outputs import ModelRunnerOutput

EOS = 0
created_schedulers: list[Scheduler] = []
_arrival = itertools.count()


def make_scheduler(num_blocks: int = 1000, block_size: int = 16, max_num_batched_tokens: int = 8192,
                   max_num_seqs: Optional[int] = None, max_model_len: int = 8192, enable_prefix_caching: bool = True,
                   enable_chunked_prefill: bool = True, long_prefill_token_threshold: int = 0,
                   policy: str = "fcfs", structured_output_manager=None, pipeline_parallel_size: int = 1,
                   num_speculative_tokens: int = 0, num_lookahead_tokens: int = 0, max_loras: int = 0,
                   sliding_window: Optional[int] = None, max_prefill_tokens_with_decodes: int = 0,
                   kv_cache_groups: tuple = (), scheduler_reserve_full_isl: bool = True) -> Scheduler:
    scheduler = Scheduler(
        SchedulerConfig(max_model_len=max_model_len,
                        max_num_seqs=min(256, max_num_batched_tokens) if max_num_seqs is None else max_num_seqs,
                        max_num_batched_tokens=max_num_batched_tokens,
                        enable_chunked_prefill=enable_chunked_prefill,
                        long_prefill_token_threshold=long_prefill_token_threshold,
                        max_prefill_tokens_with_decodes=max_prefill_tokens_with_decodes, policy=policy,
                        scheduler_reserve_full_isl=scheduler_reserve_full_isl),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching, num_blocks=num_blocks,
                    sliding_window=sliding_window, kv_cache_groups=kv_cache_groups),
        structured_output_manager, pipeline_parallel_size, num_speculative_tokens, num_lookahead_tokens, max_loras)
    created_schedulers.append(scheduler)
    return scheduler


def make_request(req_id: str, prompt_token_ids: list[int], block_size: int = 16, max_tokens: int = 16,
                 priority: int = 0, arrival_time: Optional[float] = None, lora_request=None, **params) -> Request:
    return Request(req_id, prompt_token_ids, SamplingParams(max_tokens=max_tokens, **params), eos_token_id=EOS,
                   arrival_time=arrival_time if arrival_time is not None else float(next(_arrival)),
                   priority=priority, block_hasher=make_block_hasher(block_size), lora_request=lora_request)


def deterministic_token(req_id: str, position: int) -> int:
    """The token a fake model 'samples' at a position: a pure function, so recomputation reproduces it."""
    return 1000 + (hash((req_id, position)) % 30000)


def fake_model_output(scheduler: Scheduler, output: SchedulerOutput,
                      token_fn: Callable[[str, int], int] = deterministic_token) -> ModelRunnerOutput:
    """Samples one token for each request whose scheduled chunk reaches the end of its known tokens."""
    req_ids = list(output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        # num_computed_tokens was advanced at schedule time.
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append([token_fn(req_id, request.num_tokens)] if done else [])
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)


class SpeculatingWorker:
    """A fake worker with speculative decoding. The 'model' samples ``token_fn(req_id, position)``; a draft is
    accepted while it equals that token, and the token after the accepted ones is emitted too (greedy
    verification). It then proposes ``draft_fn(req_id, num_tokens)`` for the next step. Every token it computes
    is written to ``kv[(block_id, offset)]``, so tests can check what each slot of the cache holds.

    With ``num_lookahead_tokens`` it also writes SCRATCH to that many slots past the step's tokens, as a draft model
    proposing does: those slots must be the request's own (allocated, never a block another request reads)."""

    SCRATCH = -1

    def __init__(self, draft_fn: Callable[[str, int], list[int]], token_fn: Callable[[str, int], int] =
                 deterministic_token, num_lookahead_tokens: int = 0) -> None:
        self.draft_fn, self.token_fn = draft_fn, token_fn
        self.num_lookahead_tokens = num_lookahead_tokens
        self.kv: dict[tuple[int, int], int] = {}

    def execute(self, scheduler: Scheduler, output: SchedulerOutput) -> ModelRunnerOutput:
        req_ids = list(output.num_scheduled_tokens)
        block_size = scheduler.block_size
        sampled, spec = [], []
        for req_id in req_ids:
            request = scheduler.requests[req_id]
            num_new = output.num_scheduled_tokens[req_id]
            drafts = output.scheduled_spec_decode_tokens.get(req_id, [])
            start = request.num_computed_tokens - num_new  # advanced at schedule time
            end = min(start + num_new + self.num_lookahead_tokens, scheduler.max_model_len)
            for blocks in scheduler.kv_cache_manager.req_to_blocks[req_id]:  # each group's layers write its blocks
                for pos, token in enumerate((request.all_token_ids + drafts)[start:start + num_new], start):
                    self.kv[(blocks[pos // block_size].block_id, pos % block_size)] = token
                assert len(blocks) * block_size >= end, "the lookahead slots were not allocated"
                for pos in range(start + num_new, end):
                    self.kv[(blocks[pos // block_size].block_id, pos % block_size)] = self.SCRATCH
            if request.num_computed_tokens < request.num_tokens:
                sampled.append([])
                spec.append([])
                continue
            emitted, pos = [], request.num_tokens
            for draft in drafts:
                if draft != self.token_fn(req_id, pos):
                    break
                emitted.append(draft)
                pos += 1
            emitted.append(self.token_fn(req_id, pos))
            sampled.append(emitted)
            spec.append(self.draft_fn(req_id, request.num_tokens + len(emitted)))
        return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled, spec_token_ids=spec)

    def step(self, scheduler: Scheduler) -> tuple[SchedulerOutput, EngineCoreOutputs]:
        output = scheduler.schedule()
        return output, scheduler.update_from_output(output, self.execute(scheduler, output))

    def run(self, scheduler: Scheduler, after_step: Callable[[], None] = lambda: None) -> dict[str, list[int]]:
        """Steps until every request finished, checking after each step that every block is accounted for and
        that the cache holds each request's own tokens (then ``after_step``); returns each request's tokens."""
        got: dict[str, list[int]] = {}
        while scheduler.has_requests():
            _, outs = self.step(scheduler)
            for out in outs.outputs:
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert_block_invariants(scheduler)
            self.assert_computed_tokens_are_in_the_cache(scheduler)
            after_step()
        return got

    def assert_computed_tokens_are_in_the_cache(self, scheduler: Scheduler) -> None:
        """Each running request's computed positions hold its own known tokens (written by it, or by the request
        whose cached blocks it hit), in every KV cache group: never a rejected draft. Under a group's sliding window,
        those its next query sees."""
        block_size = scheduler.block_size
        manager = scheduler.kv_cache_manager
        for (g, group), request in itertools.product(enumerate(manager.groups), scheduler.running):
            blocks = manager.req_to_blocks[request.request_id][g]
            assert len(blocks) == -(-request.num_computed_tokens // block_size), request
            window = group.sliding_window
            first = 0 if window is None else max(0, request.num_computed_tokens - window + 1)
            for pos in range(first, request.num_computed_tokens):
                slot = (blocks[pos // block_size].block_id, pos % block_size)
                assert self.kv.get(slot) == request.all_token_ids[pos], (request, pos)


def step(scheduler: Scheduler, token_fn=deterministic_token) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    output = scheduler.schedule()
    return output, scheduler.update_from_output(output, fake_model_output(scheduler, output, token_fn))


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000, token_fn=deterministic_token,
                      on_step: Optional[Callable] = None) -> dict[str, list[int]]:
    """Steps until nothing is left; returns each finished request's output tokens."""
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_requests():
            return tokens
        sched_out, outs = step(scheduler, token_fn)
        for out in outs.outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if on_step:
            on_step(scheduler, sched_out)
    raise AssertionError(f"requests did not finish in {max_steps} steps")


def held_blocks(scheduler: Scheduler) -> list[list]:
    """Every request's block list in every KV cache group."""
    return [blocks for group_blocks in scheduler.kv_cache_manager.req_to_blocks.values() for blocks in group_blocks]


def owners_per_block(scheduler: Scheduler) -> dict[int, int]:
    counts: dict[int, int] = {}
    null = scheduler.kv_cache_manager.block_pool.null_block  # stands for a block out of the window: owns nothing
    for blocks in held_blocks(scheduler):
        for b in blocks:
            if b is not null:
                counts[b.block_id] = counts.get(b.block_id, 0) + 1
    return counts


def assert_block_invariants(scheduler: Scheduler) -> None:
    """No block both free and owned; ref counts equal owners; free + used == total."""
    pool = scheduler.kv_cache_manager.block_pool
    free_ids = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    assert len(free_ids) == len(set(free_ids)) == pool.get_num_free_blocks()
    owners = owners_per_block(scheduler)
    assert not set(free_ids) & set(owners), "a block is both free and owned"
    for block in pool.blocks:
        assert block.ref_cnt == owners.get(block.block_id, 0), f"{block} has {owners.get(block.block_id, 0)} owners"
    assert len(free_ids) + len(owners) == pool.num_blocks
    for block_hash, blocks in pool.cached_block_hash_to_block.items():
        assert blocks and all(block.block_hash == block_hash and block.block_id == block_id
                              for block_id, block in blocks.items())
    for block in pool.blocks:  # a block with a hash is cached under it
        assert block.block_hash is None or pool.cached_block_hash_to_block[block.block_hash][block.block_id] is block
    # Only live requests hold blocks.
    assert set(scheduler.kv_cache_manager.req_to_blocks) <= set(scheduler.requests)


def assert_no_leaks(scheduler: Scheduler) -> None:
    """What must hold once everything is done: empty queues, zero ref counts, every block free."""
    if scheduler.has_requests() and not scheduler.get_num_unfinished_requests():
        scheduler.schedule()  # flush pending finished ids
    assert not scheduler.running and not len(scheduler.waiting) and not scheduler.requests
    pool = scheduler.kv_cache_manager.block_pool
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert pool.get_num_free_blocks() == pool.num_blocks
    assert not scheduler.kv_cache_manager.req_to_blocks
    assert_block_invariants(scheduler)


def abort(scheduler: Scheduler, *req_ids: str) -> None:
    scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)
