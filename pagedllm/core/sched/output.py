"""SchedulerOutput: one step's plan, sent to the workers. New requests travel in full, running ones as diffs."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch

from pagedllm.core.request import Request
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: Optional[int]
    block_ids: tuple[list[int], ...]  # per KV cache group (core/kv_cache_groups.py)
    num_computed_tokens: int
    lora_request: Optional[LoRARequest] = None

    @classmethod
    def from_request(cls, request: Request, block_ids: tuple[list[int], ...]) -> "NewRequestData":
        return cls(request.request_id, request.prompt_token_ids, request.sampling_params, request.eos_token_id,
                   block_ids, request.num_computed_tokens, request.lora_request)


@dataclass
class CachedRequestData:
    """Diffs for requests the workers already know, one list entry per request.

    Block ids go per KV cache group, a list each. A request resumed from preemption gets its whole block lists in
    new_block_ids (it lost its old blocks) and all its tokens in resumed_req_token_ids; a running one gets only
    blocks added this step. Before those, a running request holds exactly the blocks its num_computed_tokens fill
    (ceil(num_computed / block_size)) in each group: the scheduler gives back blocks that only rejected draft
    tokens had reached, and the worker drops them too.
    """

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    resumed_req_token_ids: list[Optional[list[int]]] = field(default_factory=list)
    new_block_ids: list[tuple[Sequence[int], ...]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    # Pipeline parallel only (else empty): the tokens each request computes this step, so that stages before the
    # last, which never sample, learn the tokens the last stage sampled (vLLM's new_token_ids).
    new_token_ids: list[list[int]] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens to compute this step; the step's whole batch.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests finished (or aborted) since the previous step: workers drop their state.
    finished_req_ids: set[str]
    # Requests preempted in this step: workers drop them from the batch but may keep their state.
    preempted_req_ids: set[str]
    # Structured output: req_id -> its row of grammar_bitmask ([rows, ceil(vocab/32)] int32, bit set = allowed),
    # for every structured-output request scheduled this step.
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: Optional[torch.Tensor] = None
    # Speculative decoding: req_id -> the draft tokens it verifies this step (counted in num_scheduled_tokens,
    # after its one uncomputed known token); requests without drafts are absent.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Whether the worker should propose drafts after this step (dynamic speculation: not while draft-free steps
    # are faster, but before each probe).
    propose_drafts: bool = True

    def decodes_only(self) -> bool:
        """Whether every request computes just its one uncomputed known token and its drafts, if any: a decode or
        verify step (which CPU graphs replay and dynamic speculation times), not one with prompt chunks."""
        if self.total_num_scheduled_tokens == len(self.num_scheduled_tokens):
            return True
        spec = self.scheduled_spec_decode_tokens
        return bool(spec) and all(count == 1 + len(spec.get(req_id, ()))
                                  for req_id, count in self.num_scheduled_tokens.items())
