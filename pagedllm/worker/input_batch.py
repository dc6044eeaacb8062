"""The worker's persistent batch: per-request state kept across steps and updated by diffs.

Rows hold each running request's tokens, block tables (one per KV cache group, core/kv_cache_groups.py) and
sampling settings in preallocated numpy arrays, so
building a step's inputs is array indexing rather than per-token Python. A request keeps its row while it runs,
scheduled in a step or not; it leaves when it finishes or is preempted, and the last row moves into its hole
(vLLM's condense), so rows 0 .. num_reqs - 1 stay dense and a removal copies one row, not the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional

import numpy as np
import torch

from pagedllm.config import ReasoningConfig
from pagedllm.lora.request import LoRARequest
from pagedllm.sample.metadata import PenaltyMetadata, SamplingMetadata
from pagedllm.sample.sampler import position_generator
from pagedllm.sample.thinking_budget import MarkerScan, ThinkingBudget
from pagedllm.sampling_params import SamplingParams, SamplingType


@dataclass
class CachedRequestState:
    """What the worker remembers of a request, in or out of the batch (e.g. while preempted)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: Optional[int]
    block_ids: tuple[list[int], ...]  # per KV cache group, all of the same length
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    # Prompt positions whose prompt logprobs were already returned (a preempted request recomputes them).
    num_prompt_logprobs_done: int = 0
    lora_request: Optional[LoRARequest] = None
    # Where its thinking_token_budget's scan of its tokens for the reasoning markers stopped (thinking_budget.py).
    marker_scan: MarkerScan = field(default_factory=MarkerScan)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    # Built once, on first use, rather than every step the request is sampled.
    @cached_property
    def allowed_token_ids(self) -> torch.Tensor:
        return torch.tensor(self.sampling_params.allowed_token_ids, dtype=torch.int64)

    @cached_property
    def logprob_token_ids(self) -> torch.Tensor:
        return torch.tensor(self.sampling_params.logprob_token_ids, dtype=torch.int64)

    @cached_property
    def logit_bias(self) -> tuple[torch.Tensor, torch.Tensor]:
        bias = self.sampling_params.logit_bias
        return torch.tensor(list(bias), dtype=torch.int64), torch.tensor(list(bias.values()), dtype=torch.float32)


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int, vocab_size: int,
                 num_kv_cache_groups: int = 1, reasoning_config: Optional[ReasoningConfig] = None) -> None:
        self.max_num_reqs = max_num_reqs
        # None without a reasoning parser, where the Processor refuses every thinking_token_budget.
        self.thinking_budget = None if reasoning_config is None else ThinkingBudget(reasoning_config)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.req_ids: list[str] = []
        self.req_id_to_index: dict[str, int] = {}
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # Each group's block table; block_table is the first group's (every layer's, where there is one group).
        self.block_tables = [np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
                             for _ in range(num_kv_cache_groups)]
        self.block_table = self.block_tables[0]
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)  # a row's blocks in each group
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence_penalties = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalties = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalties = np.ones(max_num_reqs, dtype=np.float32)
        self.states: list[CachedRequestState] = []

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def add_request(self, state: CachedRequestState) -> None:
        if state.req_id in self.req_id_to_index:
            raise ValueError(f"request {state.req_id} is already in the batch")
        i = self.num_reqs
        if i >= self.max_num_reqs:
            raise RuntimeError(f"the batch is full ({self.max_num_reqs} requests)")
        self.req_ids.append(state.req_id)
        self.states.append(state)
        self.req_id_to_index[state.req_id] = i
        n_prompt = len(state.prompt_token_ids)
        n = n_prompt + len(state.output_token_ids)
        self.token_ids[i, :n_prompt] = state.prompt_token_ids
        self.token_ids[i, n_prompt:n] = state.output_token_ids
        self.num_tokens[i] = n
        self.num_prompt_tokens[i] = n_prompt
        self.num_computed_tokens[i] = state.num_computed_tokens
        self.set_block_ids(i, state.block_ids)
        params = state.sampling_params
        self.temperature[i] = params.temperature
        self.top_p[i] = params.top_p
        self.top_k[i] = params.top_k
        self.min_p[i] = params.min_p
        self.presence_penalties[i] = params.presence_penalty
        self.frequency_penalties[i] = params.frequency_penalty
        self.repetition_penalties[i] = params.repetition_penalty

    def set_block_ids(self, i: int, block_ids: tuple[list[int], ...]) -> None:
        for table, ids in zip(self.block_tables, block_ids, strict=True):
            table[i, :len(ids)] = ids
        self.num_blocks[i] = len(block_ids[0])

    def append_block_ids(self, i: int, block_ids: tuple[list[int], ...]) -> None:
        start = self.num_blocks[i]
        for table, ids in zip(self.block_tables, block_ids, strict=True):
            table[i, start:start + len(ids)] = ids
        self.num_blocks[i] = start + len(block_ids[0])

    def remove_request(self, req_id: str) -> None:
        """Drops the request's row: the last row moves into it (its used part only), the others stay put."""
        hole = self.req_id_to_index.pop(req_id)
        last = self.num_reqs - 1
        if hole != last:
            moved = self.req_ids[last]
            num_tokens, num_blocks = self.num_tokens[last], self.num_blocks[last]
            self.token_ids[hole, :num_tokens] = self.token_ids[last, :num_tokens]
            for table in self.block_tables:
                table[hole, :num_blocks] = table[last, :num_blocks]
            for arr in self._per_row_values():
                arr[hole] = arr[last]
            self.req_ids[hole], self.states[hole] = moved, self.states[last]
            self.req_id_to_index[moved] = hole
        self.req_ids.pop()
        self.states.pop()

    def _per_row_values(self) -> tuple[np.ndarray, ...]:
        """The arrays holding one value per row (the token and block tables hold a row each)."""
        return (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens, self.num_blocks,
                self.temperature, self.top_p, self.top_k, self.min_p, self.presence_penalties,
                self.frequency_penalties, self.repetition_penalties)

    def set_draft_tokens(self, i: int, draft_token_ids: list[int]) -> None:
        """Writes a request's draft tokens after its known ones, where the step's input_ids are gathered from;
        num_tokens is unchanged (they are not the request's until verified)."""
        n = self.num_tokens[i]
        self.token_ids[i, n:n + len(draft_token_ids)] = draft_token_ids

    def slot_mapping(self, rows: np.ndarray, positions: np.ndarray, block_size: int, group: int = 0) -> np.ndarray:
        """The KV cache slot (block id * block_size + offset) of each ``positions[k]`` of batch row ``rows[k]``, in
        KV cache group ``group``."""
        return (self.block_tables[group][rows, positions // block_size].astype(np.int64) * block_size
                + positions % block_size)

    def append_token(self, i: int, token_id: int) -> None:
        n = self.num_tokens[i]
        self.token_ids[i, n] = token_id
        self.num_tokens[i] = n + 1
        self.states[i].output_token_ids.append(token_id)

    def make_sampling_metadata(self, rows: np.ndarray, offsets: Optional[np.ndarray] = None) -> SamplingMetadata:
        """Sampling tensors for the given batch rows, in that order (the rows whose logits are sampled).

        ``offsets`` (speculative decoding, where a row may repeat): entry k describes the next token after
        ``offsets[k]`` of its request's draft tokens, which token_ids holds past num_tokens; those drafts count
        as output for min_tokens, bad_words and penalties, as if sampled."""
        if offsets is None:
            offsets = np.zeros(len(rows), dtype=np.int64)
        states = [self.states[i] for i in rows]
        types = [s.sampling_params.sampling_type for s in states]
        all_greedy = all(t == SamplingType.GREEDY for t in types)
        all_random = all(t != SamplingType.GREEDY for t in types)
        temperature = top_p = top_k = min_p = None
        if not all_greedy:
            temperature = torch.from_numpy(self.temperature[rows])
            if (self.top_p[rows] < 1.0).any():
                top_p = torch.from_numpy(self.top_p[rows])
            if (self.top_k[rows] > 0).any():
                top_k = torch.from_numpy(self.top_k[rows])
            if (self.min_p[rows] > 0.0).any():
                min_p = torch.from_numpy(self.min_p[rows])
        # A seeded row's noise is its token's own (by output position, drafts counted): sampler.position_generator.
        generators = {row: position_generator(s.sampling_params.seed, len(s.output_token_ids) + int(offsets[row]))
                      for row, (s, kind) in enumerate(zip(states, types)) if kind == SamplingType.RANDOM_SEED}
        max_num_logprobs = max((s.sampling_params.num_logprobs for s in states
                                if s.sampling_params.num_logprobs is not None), default=None)
        min_tokens_mask, allowed_token_ids, bad_words_token_ids, logit_bias, logprob_token_ids = {}, {}, {}, {}, {}
        forced_token_ids = {}
        min_tokens_restorable = set()
        for row, s in enumerate(states):
            params = s.sampling_params
            if len(s.output_token_ids) + offsets[row] < params.min_tokens:
                suppressed = params.all_stop_token_ids(s.eos_token_id)
                if suppressed:
                    min_tokens_mask[row] = suppressed
                    if params.structured_outputs is not None or params.allowed_token_ids:
                        min_tokens_restorable.add(row)
            if params.allowed_token_ids:
                allowed_token_ids[row] = s.allowed_token_ids
            if params.bad_words_token_ids:
                bad_words_token_ids[row] = params.bad_words_token_ids
            if params.logit_bias:
                logit_bias[row] = s.logit_bias
            if params.logprob_token_ids:
                logprob_token_ids[row] = s.logprob_token_ids
            if params.thinking_token_budget is not None and self.thinking_budget is not None:
                num_tokens = int(self.num_tokens[rows[row]])
                forced = self.thinking_budget.forced_token(self.token_ids[rows[row]], num_tokens,
                                                           num_tokens + int(offsets[row]), params.thinking_token_budget,
                                                           s.marker_scan)
                if forced is not None:
                    forced_token_ids[row] = forced
        output_token_ids = [self._output_with_drafts(row, s, offset) for row, s, offset in zip(rows, states, offsets)
                            ] if bad_words_token_ids else []
        return SamplingMetadata(temperature=temperature, all_greedy=all_greedy, all_random=all_random,
                                top_p=top_p, top_k=top_k, min_p=min_p, generators=generators,
                                max_num_logprobs=max_num_logprobs, min_tokens_mask=min_tokens_mask,
                                min_tokens_restorable=frozenset(min_tokens_restorable),
                                allowed_token_ids=allowed_token_ids, bad_words_token_ids=bad_words_token_ids,
                                output_token_ids=output_token_ids, logit_bias=logit_bias,
                                logprob_token_ids=logprob_token_ids, forced_token_ids=forced_token_ids,
                                penalties=self._penalty_metadata(rows, offsets))

    def _output_with_drafts(self, row: int, state: CachedRequestState, num_drafts: int) -> list[int]:
        if not num_drafts:
            return state.output_token_ids
        num_tokens = int(self.num_tokens[row])
        return state.output_token_ids + self.token_ids[row, num_tokens:num_tokens + num_drafts].tolist()

    def _penalty_metadata(self, rows: np.ndarray, offsets: np.ndarray) -> Optional[PenaltyMetadata]:
        """Penalties of the sampled rows that use one, with their prompt and output tokens cut from token_ids."""
        uses = ((self.presence_penalties[rows] != 0.0) | (self.frequency_penalties[rows] != 0.0)
                | (self.repetition_penalties[rows] != 1.0))
        if not uses.any():
            return None
        logits_rows = np.nonzero(uses)[0]
        batch_rows = rows[logits_rows]
        num_prompt = self.num_prompt_tokens[batch_rows, None]
        num_tokens = self.num_tokens[batch_rows, None] + offsets[logits_rows, None]
        position = np.arange(int(num_tokens.max()))
        token_ids = self.token_ids[batch_rows, :len(position)]
        prompt = np.where(position < num_prompt, token_ids, self.vocab_size)
        output = np.where((position >= num_prompt) & (position < num_tokens), token_ids, self.vocab_size)
        return PenaltyMetadata(rows=torch.from_numpy(logits_rows),
                               presence_penalties=torch.from_numpy(self.presence_penalties[batch_rows]),
                               frequency_penalties=torch.from_numpy(self.frequency_penalties[batch_rows]),
                               repetition_penalties=torch.from_numpy(self.repetition_penalties[batch_rows]),
                               prompt_token_ids=torch.from_numpy(prompt), output_token_ids=torch.from_numpy(output))
