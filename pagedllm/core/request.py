"""Request: the scheduler's view of one sequence — its tokens, progress, status and cached block hashes."""
from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Callable, Optional, Union

from pagedllm.engine.protocol import FinishReason
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.lora.request import LoRARequest
    from pagedllm.structured_output.request import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    # Waiting for its grammar to compile (structured output); the scheduler skips it until then.
    WAITING_FOR_FSM = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: "RequestStatus") -> Optional[FinishReason]:
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
}


class Request:
    """One sequence inside the engine core.

    `num_computed_tokens` is how many of its tokens already have K/V in the cache; the scheduler closes the gap
    to `num_tokens` a budgeted chunk at a time. `block_hashes` holds the chained hash of every full block of
    known tokens, extended by `block_hasher` whenever tokens are appended, so each hash is computed once.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: Optional[int] = None,
        arrival_time: Optional[float] = None,
        priority: int = 0,
        cache_salt: Optional[str] = None,
        block_hasher: Optional[Callable[["Request"], list[bytes]]] = None,
        lora_request: Optional["LoRARequest"] = None,
    ) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_request = lora_request
        self.status = RequestStatus.WAITING
        self.stop_reason: Union[int, str, None] = None
        self.error: Optional[str] = None
        self.max_tokens = sampling_params.max_tokens
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        # Plain attributes, not properties: the scheduler reads them for every request every step.
        self.num_tokens = self.num_prompt_tokens
        # The target the scheduler computes towards: num_tokens plus the draft tokens proposed for the next step.
        self.num_tokens_with_spec = self.num_prompt_tokens
        # Draft tokens to verify in the next step (speculative decoding); never part of all_token_ids.
        self.spec_token_ids: list[int] = []
        # Its drafts accepted, and its verification trials (see SpecDecodeBudget.record_verification).
        self.spec_accepted = self.spec_trials = 0
        self.num_output_tokens = 0
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache when first scheduled (-1: not scheduled yet).
        self.num_cached_tokens = -1
        self.first_scheduled_time = 0.0
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []
        # Set by the StructuredOutputManager when the request has structured_outputs.
        self.structured_output_request: Optional["StructuredOutputRequest"] = None
        self._block_hasher = block_hasher
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def append_output_token_id(self, token_id: int) -> None:
        """Called for every sampled token of every request: kept lean."""
        self._output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        self.num_tokens += 1
        self.num_tokens_with_spec = self.num_tokens + len(self.spec_token_ids)
        self.num_output_tokens += 1
        if self._block_hasher is not None:
            new_hashes = self._block_hasher(self)
            if new_hashes:
                self.block_hashes.extend(new_hashes)

    def set_spec_token_ids(self, spec_token_ids: list[int]) -> None:
        self.spec_token_ids = spec_token_ids
        self.num_tokens_with_spec = self.num_tokens + len(spec_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> Optional[FinishReason]:
        return RequestStatus.get_finished_reason(self.status)

    def __lt__(self, other: "Request") -> bool:
        """Priority order: lower priority value first, then earlier arrival, then request id."""
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority, other.arrival_time, other.request_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
