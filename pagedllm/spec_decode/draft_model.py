"""DraftModelProposer: a second, cheaper model drafts each request's next tokens greedily (vLLM's ``draft_model``).

Its paged KV cache has the same blocks as the target's, so a request's block table, slot mapping and prefix-cache
hits serve both, and both caches are sized, held and freed together. The invariant that keeps the draft in step:
**the draft's cache holds the right K/V for every position the target has computed** (so for every cached block
too, and a prefix hit is a hit for the draft as well), below the draft's max_model_len (speculative_config's, where
it caps the draft's context: no request drafts past it). Each step keeps it in one draft forward over what the
target computed, less the drafts it rejected, plus the token sampled after them:

- a request whose prefill chunk did not reach the prompt's end: the chunk;
- a request that sampled: from its first scheduled position through the token it just sampled. That is its
  accepted drafts again (the draft computed them while proposing, but the last step's bonus position and
  anything after a rejection must be rewritten anyway) and the new token, whose logits give the first draft.

Then each further draft is one single-token step of the draft model per request (replayed from CPU graphs where
the target's are), writing K/V at positions past the request's computed tokens: scratch that the next step's
forward overwrites, in the lookahead slots the scheduler gives each request for it (SpeculativeConfig.
num_lookahead_tokens). Preemption needs nothing: a recomputed request is recomputed by both.

Drafts are the draft model's argmax, so the proposal distribution q is one-hot and the rejection sampler's rule
keeps the target's output distribution exact.
"""
from __future__ import annotations

import numpy as np
import torch

from pagedllm.config import EngineConfig
from pagedllm.kv_cache_dtype import kv_cache_torch_dtype
from pagedllm.layers.attention.kv_cache import allocate_kv_caches
from pagedllm.layers.attention.metadata import AttentionMetadata
from pagedllm.layers.attention.selector import get_attn_backend
from pagedllm.models.loader import get_model
from pagedllm.platforms.interface import KernelChoice
from pagedllm.sample.sampler import greedy_sample
from pagedllm.spec_decode.proposal_step import ProposalStep
from pagedllm.worker.cpu_graphs import Step, StepGraphs, cpu_graphs_apply
from pagedllm.worker.input_batch import InputBatch


class DraftModelProposer:
    def __init__(self, config: EngineConfig) -> None:
        self.model_config = config.speculative_config.draft_model_config
        self.block_size = config.cache_config.block_size
        self.cache_dtype = config.cache_config.cache_dtype
        self.kv_cache_populate = config.cache_config.kv_cache_populate
        self.model = None
        self.kv_caches: list = []
        self.decode_graphs: StepGraphs | None = None

    def load_model(self, kernels: KernelChoice) -> None:
        """The draft model, on the target's kernels (one dtype for both)."""
        mc = self.model_config
        self.model = get_model(mc.path, mc.hf_config, kernels, load_format=mc.load_format)

    def initialize_kv_cache(self, num_blocks: int, block_table_width: int) -> None:
        mc = self.model_config
        self.kv_caches = allocate_kv_caches(mc.num_layers, num_blocks, self.block_size, mc.num_kv_heads,
                                            mc.head_dim, kv_cache_torch_dtype(self.cache_dtype, mc.dtype),
                                            backend=get_attn_backend(mc.attention_backend),
                                            populate=self.kv_cache_populate)
        if cpu_graphs_apply(mc, self.model):
            self.decode_graphs = StepGraphs(self.model, self.kv_caches, self.block_size, block_table_width)

    def release_kv_cache(self) -> None:
        """Drops the draft's KV cache and the graphs replayed over it (ModelRunner.release_kv_cache)."""
        self.kv_caches, self.decode_graphs = [], None

    def propose_for_step(self, batch: InputBatch, step: ProposalStep) -> list[list[int]]:
        """Per sampling request of ``step``: up to its max_drafts drafts. Runs for every step that computed
        anything, sampled or not, to keep the draft's cache in step with the target's."""
        rows = step.rows
        sampled = np.zeros(len(rows), dtype=bool)
        sampled[step.sampling] = True
        # Positions from the draft's max_model_len on are never computed: no request drafts there (max_drafts).
        ends = np.minimum(np.where(sampled, batch.num_tokens[rows], step.num_computed + step.num_scheduled),
                          self.model_config.max_model_len)
        starts = np.minimum(step.num_computed, ends)
        drafts: list[list[int]] = [[] for _ in step.sampling]
        computing = ends > starts
        if not computing.any():
            return drafts
        hidden_states = self._forward(batch, rows[computing], starts[computing], ends[computing],
                                      batch.token_ids[np.repeat(rows, ends - starts), _positions(starts, ends)])
        wanting = np.nonzero(step.max_drafts > 0)[0]  # indices into step.sampling
        if not len(wanting):
            return drafts
        last_token = (np.cumsum(ends - starts) - 1)[step.sampling[wanting]]
        tokens = greedy_sample(self.model.compute_logits(hidden_states[torch.from_numpy(last_token)])).numpy()
        draft_rows = step.sample_rows[wanting]
        num_tokens = batch.num_tokens[draft_rows]
        for j, token in zip(wanting.tolist(), tokens.tolist()):
            drafts[j].append(token)
        # Draft i + 1 of each request still wanting one: the draft model's next token after draft i.
        for i in range(1, int(step.max_drafts.max())):
            going_on = step.max_drafts[wanting] > i
            if not going_on.any():
                break
            wanting, tokens = wanting[going_on], tokens[going_on]
            draft_rows, num_tokens = draft_rows[going_on], num_tokens[going_on]
            tokens = self._decode(batch, draft_rows, tokens, num_tokens + i - 1)
            for j, token in zip(wanting.tolist(), tokens.tolist()):
                drafts[j].append(token)
        return drafts

    def _forward(self, batch: InputBatch, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                 input_ids: np.ndarray) -> torch.Tensor:
        """The draft model over ``input_ids`` at positions [starts[j], ends[j]) of each row (a varlen batch, eager)."""
        lengths = ends - starts
        positions = _positions(starts, ends)
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int64)
        query_start_loc[1:] = np.cumsum(lengths)
        metadata = AttentionMetadata(
            num_actual_tokens=len(positions),
            slot_mapping=torch.from_numpy(batch.slot_mapping(np.repeat(rows, lengths), positions, self.block_size)),
            query_start_loc=torch.from_numpy(query_start_loc),
            seq_lens=torch.from_numpy(ends.astype(np.int32)),
            block_table=torch.from_numpy(batch.block_table[rows][:, :int(batch.num_blocks[rows].max())]),
            max_query_len=int(lengths.max()),
            max_seq_len=int(ends.max()))
        return self.model(torch.from_numpy(input_ids), torch.from_numpy(positions), self.kv_caches, metadata)

    def _decode(self, batch: InputBatch, rows: np.ndarray, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """One draft token per row: ``tokens`` at ``positions``, written to the rows' lookahead slots."""
        hidden_states = None
        if self.decode_graphs is not None:
            hidden_states = self.decode_graphs.forward(Step(
                tokens, positions, positions + 1, np.arange(len(rows) + 1),
                [(batch.slot_mapping(rows, positions, self.block_size), batch.block_table[rows])]))
        if hidden_states is None:
            hidden_states = self._forward(batch, rows, positions, positions + 1, tokens)
        return greedy_sample(self.model.compute_logits(hidden_states)).numpy()


def _positions(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Positions [starts[j], ends[j]) of every row j, one after another."""
    lengths = ends - starts
    return np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths - starts, lengths)
