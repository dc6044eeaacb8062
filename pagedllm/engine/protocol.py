"""The engine core's wire types: what crosses the frontend ⇄ EngineCore boundary.

msgspec Structs (array_like, omit_defaults, gc=False) so they encode compactly and cheaply to msgpack.
"""
from __future__ import annotations

import enum
import time
from typing import Any, Optional, Union

import msgspec

from pagedllm.lora.request import LoRARequest
from pagedllm.sample.logprobs import LogprobsLists
from pagedllm.sampling_params import SamplingParams


# vLLM's get_supported_tasks(): pagedllm's models all generate (none pools or transcribes).
SUPPORTED_TASKS = ("generate",)


class EngineCoreReadyResponse(msgspec.Struct, array_like=True):
    """The first message on the engine's output socket: it is initialised and serving, with what its start-up
    settled that the frontend's config did not know (vLLM's): its KV cache's blocks and the context length served
    (lower than configured where max_model_len -1 fitted it to the cache)."""

    max_model_len: int
    num_gpu_blocks: int


class FinishReason(enum.IntEnum):
    """Why a request finished; an int on the wire, OpenAI's string at the API."""

    STOP = 0
    LENGTH = 1
    ABORT = 2

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: Optional[int]
    arrival_time: float
    priority: int = 0
    cache_salt: Optional[str] = None
    lora_request: Optional[LoRARequest] = None
    # The caller's id (vLLM's): its outputs carry it, and aborting it aborts every request added under it. None: the
    # request_id is the caller's own (assign_request_id makes a unique request_id for each request a caller adds).
    external_req_id: Optional[str] = None
    # vLLM's: with data parallelism, the engine that runs the request (None: the load balancer's choice).
    data_parallel_rank: Optional[int] = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    # Per new token: (token ids [sampled first, then top-k], logprobs, rank of the sampled token).
    new_logprobs: Optional[LogprobsLists] = None
    # Prompt logprobs for the prompt positions computed in this step (chunked prefill sends several pieces).
    new_prompt_logprobs: Optional[LogprobsLists] = None
    finish_reason: Optional[FinishReason] = None
    stop_reason: Union[int, str, None] = None
    # Set when the engine refused the request (e.g. it can never fit in the KV cache).
    error: Optional[str] = None
    num_cached_tokens: int = 0
    # Wall-clock time the request was first scheduled; sent with its first output (for queue-time metrics).
    first_scheduled_time: float = 0.0
    # Times the request has been preempted so far (vLLM's request_num_preemptions); 0, left out, for most.
    num_preemptions: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A snapshot after one step; the counters are totals since start-up."""

    num_running_reqs: int = 0
    # Waiting requests, as vLLM's: those waiting for the step's capacity, and those deferred by something else (a
    # grammar compiling, no LoRA slot free; num_skipped_waiting_reqs). The metrics' waiting requests are both.
    num_waiting_reqs: int = 0
    num_skipped_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_requests: int = 0  # the requests those queries were of (vLLM's PrefixCacheStats.requests)
    prefix_cache_resets: int = 0  # reset_prefix_cache calls that emptied it (vLLM's PrefixCacheStats.reset)
    num_preemptions: int = 0
    # Speculative decoding (vLLM's SpecDecodingStats): requests that verified drafts, the drafts, those
    # accepted, and accepted ones by position in the draft (index 0 = first draft token).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)
    # LoRA adapter name -> how many running (waiting) requests use it (vLLM's names).
    running_lora_adapters: dict[str, int] = msgspec.field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = msgspec.field(default_factory=dict)

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Accepted drafts over drafts (vLLM's "Avg Draft acceptance rate"); 0 before any draft."""
        return self.spec_decode_num_accepted_tokens / max(self.spec_decode_num_draft_tokens, 1)

    @property
    def spec_decode_mean_acceptance_length(self) -> float:
        """Tokens a verification yields on average, the token after the drafts included (vLLM's "Mean acceptance
        length"); 1 before any draft."""
        return 1 + self.spec_decode_num_accepted_tokens / max(self.spec_decode_num_drafts, 1)


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The answer to a utility call (abort, reset_prefix_cache, get_stats) made over the request socket."""

    call_id: int
    result: Any = None
    failure_message: Optional[str] = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: Optional[SchedulerStats] = None
    timestamp: float = msgspec.field(default_factory=time.monotonic)
    utility_output: Optional[UtilityOutput] = None
    # The engine's last message when it fails (e.g. a worker rank died): why, for the error every caller gets.
    engine_dead: Optional[str] = None
    # Data parallel, set by the frontend's client: which engine this came from; when that engine died while
    # others serve, the requests it took down with it (engine_dead says why).
    engine_index: int = 0
    failed_request_ids: list[str] = []


class EngineCoreRequestType(bytes, enum.Enum):
    """The first frame of every message to the engine core says what the second one holds."""

    ADD = b"\x00"  # an EngineCoreRequest
    ABORT = b"\x01"  # a list of request ids
    UTILITY = b"\x02"  # (call_id, method name, args)
