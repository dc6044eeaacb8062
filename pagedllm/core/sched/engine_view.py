"""The engine view: a snapshot of one engine's scheduler and KV cache for people to watch (the web page's live
view, GET /engine/view).

Built on demand, by a utility call between steps, so an engine nobody watches pays nothing; one call walks every
block once. The counters are totals since start-up: a watcher takes rates (steps per second, tokens per step,
the prefix-cache hit rate of the last interval) from two snapshots and their `time`.
"""
from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING

import msgspec

from pagedllm.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from pagedllm.core.sched.scheduler import Scheduler

# One character a block, in block-id order.
BLOCK_FREE = "."       # free, holding nothing reusable
BLOCK_CACHED = "c"     # free, but holding a cached full block a prefix hit can take back
BLOCK_IN_USE = "u"     # held by one request
BLOCK_SHARED = "s"     # held by several requests at once (a shared prefix)

# Requests listed per queue; the counts say how many there are in all. Bounds a snapshot under a long queue.
MAX_LISTED_REQUESTS = 64


class RequestView(msgspec.Struct, omit_defaults=True):
    request_id: str
    status: str  # "running", "waiting" or "preempted" (waiting to resume)
    num_prompt_tokens: int
    num_computed_tokens: int
    num_output_tokens: int
    max_tokens: int
    num_blocks: int
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    num_preemptions: int = 0
    lora_name: str = ""


class EngineView(msgspec.Struct):
    time: float  # wall clock (time.time()) when taken
    block_size: int
    block_map: str  # one of BLOCK_FREE / BLOCK_CACHED / BLOCK_IN_USE / BLOCK_SHARED per block
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int
    num_step_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_running_reqs: int
    num_waiting_reqs: int
    running: list[RequestView]
    waiting: list[RequestView]


def make_engine_view(scheduler: "Scheduler") -> EngineView:
    kv = scheduler.kv_cache_manager
    waiting = list(itertools.islice(scheduler.waiting, MAX_LISTED_REQUESTS))
    return EngineView(
        time=time.time(), block_size=kv.block_size, block_map=_block_map(scheduler), kv_cache_usage=kv.usage,
        prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
        num_preemptions=scheduler.num_preemptions, num_steps=scheduler.num_steps,
        num_step_tokens=scheduler.num_step_tokens, max_num_seqs=scheduler.max_num_running_reqs,
        max_num_batched_tokens=scheduler.max_num_scheduled_tokens, num_running_reqs=len(scheduler.running),
        num_waiting_reqs=len(scheduler.waiting),
        running=[_request_view(r, kv) for r in scheduler.running[:MAX_LISTED_REQUESTS]],
        waiting=[_request_view(r, kv) for r in waiting])


def _block_map(scheduler: "Scheduler") -> str:
    return "".join(BLOCK_SHARED if b.ref_cnt > 1 else BLOCK_IN_USE if b.ref_cnt == 1
                   else BLOCK_CACHED if b.block_hash is not None else BLOCK_FREE
                   for b in scheduler.kv_cache_manager.block_pool.blocks)


def _request_view(request: Request, kv) -> RequestView:
    status = ("running" if request.status == RequestStatus.RUNNING
              else "preempted" if request.status == RequestStatus.PREEMPTED else "waiting")
    blocks = [b for group_blocks in kv.req_to_blocks.get(request.request_id, ()) for b in group_blocks]
    return RequestView(
        request_id=request.request_id, status=status, num_prompt_tokens=request.num_prompt_tokens,
        num_computed_tokens=request.num_computed_tokens, num_output_tokens=request.num_output_tokens,
        max_tokens=request.max_tokens or 0, num_blocks=sum(b is not kv.block_pool.null_block for b in blocks),
        num_cached_tokens=max(request.num_cached_tokens, 0), num_preemptions=request.num_preemptions,
        lora_name=request.lora_request.lora_name if request.lora_request is not None else "")
