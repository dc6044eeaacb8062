"""ModelRunner: turns a SchedulerOutput into one forward pass over a flattened batch, then samples.

It keeps the worker's request states and the persistent InputBatch in step with the scheduler's diffs, builds
input_ids / positions / slot_mapping / block tables with vectorised numpy, computes logits only where a token
is sampled (or prompt logprobs are asked for), and returns sampled tokens as a ModelRunnerOutput.

Under tensor/pipeline parallelism every rank runs this with its slice of the model and the same SchedulerOutput.
A stage before the last receives nothing to sample: it sends its IntermediateTensors on and learns the sampled
tokens from the next SchedulerOutput (CachedRequestData.new_token_ids). On the last stage every TP rank joins the
logits gather, TP rank 0 alone samples and broadcasts the tokens to the others, and only it returns an output.

Speculative decoding: a request's draft tokens (SchedulerOutput.scheduled_spec_decode_tokens) are computed after
its known tokens in the same forward, the logits of all d + 1 positions go to the RejectionSampler, and the
driver proposes the next step's drafts once the accepted tokens are in the token table: the n-gram and suffix
proposers from the table, the draft model by running on what the step computed (every step, to keep its cache
in step).
"""
from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_groups import layer_placement, stage_cache_tensors
from pagedllm.core.kv_cache_manager import cdiv
from pagedllm.core.sched.output import SchedulerOutput
from pagedllm.distributed.parallel_state import ParallelRank, get_pp_group, get_tp_group
from pagedllm.kv_cache_dtype import kv_cache_torch_dtype
from pagedllm.layers.attention.kv_cache import allocate_kv_caches, kv_heads_per_rank
from pagedllm.layers.attention.layer import Attention
from pagedllm.layers.attention.metadata import AttentionMetadata
from pagedllm.layers.attention.selector import get_attn_backend
from pagedllm.lora.worker_manager import WorkerLoRAManager
from pagedllm.models.llama import IntermediateTensors
from pagedllm.models.loader import get_model
from pagedllm.platforms import resolve_platform
from pagedllm.platforms.cpu import kernel_paths
from pagedllm.platforms.interface import KernelChoice
from pagedllm.sample.logprobs import LogprobsLists, compute_token_logprobs
from pagedllm.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler
from pagedllm.sample.sampler import Sampler
from pagedllm.spec_decode.draft_model import DraftModelProposer
from pagedllm.spec_decode.ngram_proposer import NgramProposer
from pagedllm.spec_decode.proposal_step import ProposalStep
from pagedllm.spec_decode.suffix_decoding import SuffixDecodingProposer
from pagedllm.structured_output.bitmask import apply_bitmask
from pagedllm.worker.cpu_graphs import Step, StepGraphs, cpu_graphs_apply
from pagedllm.worker.input_batch import CachedRequestState, InputBatch
from pagedllm.worker.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: ParallelRank = ParallelRank()) -> None:
        self.config = config
        self.rank = rank
        self.layer_range = config.parallel_config.stage_layers(rank.pp_rank, config.model_config.num_layers)
        self.model_config = config.model_config
        self.platform = resolve_platform(config.model_config.device)
        self.device = torch.device(self.platform.device_type)
        self.block_size = config.cache_config.block_size
        max_model_len = self.model_config.max_model_len
        # A hybrid model's KV cache groups (core/kv_cache_groups.py; none: one block table for every layer).
        self.kv_cache_groups = config.cache_config.kv_cache_groups
        self.input_batch = InputBatch(config.scheduler_config.max_num_seqs, max_model_len,
                                      cdiv(max_model_len, self.block_size), self.model_config.vocab_size,
                                      max(1, len(self.kv_cache_groups)), config.reasoning_config)
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler(config.model_config.logprobs_mode)
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.drafter = make_proposer(config)
        self.model = None
        self.kernels: KernelChoice | None = None  # this engine's, chosen as its model loads
        self.kv_caches: list = []
        self.step_graphs: StepGraphs | None = None
        self.lora_manager: WorkerLoRAManager | None = None  # with enable_lora

    def load_model(self) -> None:
        mc = self.model_config
        self.kernels = self.platform.choose_kernels(mc.dtype, mc.attention_backend)
        if self.config.lora_config is not None:
            self.kernels = dataclasses.replace(self.kernels, fused_silu=False)
        self.model = get_model(mc.path, mc.hf_config, self.kernels, self.rank, self.layer_range, mc.load_format)
        if self.device.type == "cpu":
            paths = kernel_paths(self.kernels, mc.hf_config.num_attention_heads, mc.num_kv_heads, mc.head_dim,
                                 mc.quantization)
        else:
            paths = {"attention": mc.attention_backend, "GEMMs and fused ops": f"torch on {self.device.type}"}
        logger.info("Kernels (%s model): %s", str(mc.dtype).removeprefix("torch."),
                    "; ".join(f"{part}: {path}" for part, path in paths.items()))
        if isinstance(self.drafter, DraftModelProposer):
            self.drafter.load_model(self.kernels)
        lora = self.config.lora_config
        if lora is not None:
            self.lora_manager = WorkerLoRAManager(self.model, mc.hf_config, lora.max_loras, lora.max_lora_rank,
                                                  lora.max_cpu_loras, mc.dtype)

    def _allocate_kv_caches(self, num_blocks: int, populate: str) -> list:
        """A cache of ``num_blocks`` blocks for each layer of this stage, holding this TP rank's KV heads, on the
        model's device in its attention backend's layout: each layer's own, or a hybrid model's shared by its KV
        cache groups (layer j of every group the same, core/kv_cache_groups.py)."""
        mc = self.model_config
        tensors = stage_cache_tensors(self.kv_cache_groups, *self.layer_range)
        caches = allocate_kv_caches(max(tensors) + 1, num_blocks, self.block_size,
                                    kv_heads_per_rank(mc.num_kv_heads, self.rank.tp_size), mc.head_dim,
                                    kv_cache_torch_dtype(self.config.cache_config.cache_dtype, mc.dtype), self.device,
                                    get_attn_backend(mc.attention_backend), populate=populate)
        return [caches[j] for j in tensors]

    def _assign_kv_cache_groups(self) -> None:
        """Tells each attention layer of this stage which KV cache group's metadata it reads."""
        layers = [module for module in self.model.modules() if isinstance(module, Attention)]
        start, end = self.layer_range
        assert len(layers) == end - start, "one attention layer per decoder layer"
        placement = layer_placement(self.kv_cache_groups)
        for layer_index, layer in enumerate(layers, start):
            layer.kv_cache_group = placement[layer_index][0]

    def initialize_kv_cache(self, num_blocks: int) -> None:
        if self.kv_cache_groups:
            self._assign_kv_cache_groups()
        mc = self.model_config
        graphs = cpu_graphs_apply(mc, self.model, self.config.parallel_config.world_size)
        # With graphs, one block past the scheduler's: the padding block of steps with prompt chunks (cpu_graphs).
        self.kv_caches = self._allocate_kv_caches(num_blocks + int(graphs), self.config.cache_config.kv_cache_populate)
        if graphs:
            self.step_graphs = StepGraphs(self.model, self.kv_caches, self.block_size,
                                          self.input_batch.block_table.shape[1], padding_block=num_blocks,
                                          num_groups=len(self.input_batch.block_tables))
            start = time.perf_counter()
            shapes = self.step_graphs.capture_decode_steps(self.config.scheduler_config.max_num_seqs)
            logger.info("Captured the CPU graphs of decode steps of %d batch sizes in %.2f s", shapes,
                        time.perf_counter() - start)
        if isinstance(self.drafter, DraftModelProposer):
            self.drafter.initialize_kv_cache(num_blocks, self.input_batch.block_table.shape[1])

    def release_kv_cache(self) -> None:
        """Drops the KV cache and everything that holds it (the CPU graphs replayed over it, the draft model's), so
        that its memory can go back (Worker.sleep); initialize_kv_cache makes it anew."""
        self.kv_caches, self.step_graphs = [], None
        if isinstance(self.drafter, DraftModelProposer):
            self.drafter.release_kv_cache()

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A forward at the largest step the scheduler may send (max_num_batched_tokens tokens over up to
        max_num_seqs prompts, none longer than max_model_len) and the logits of every request, for the memory it
        peaks at (platforms/cuda.profile_memory). Its attention runs over a one-block cache that every slot maps
        into: what a step allocates does not depend on where its keys live."""
        sc = self.config.scheduler_config
        mc = self.model_config
        num_reqs = min(sc.max_num_seqs, sc.max_num_batched_tokens)
        per_req, extra = divmod(sc.max_num_batched_tokens, num_reqs)
        query_lens = np.minimum(per_req + (np.arange(num_reqs) < extra), mc.max_model_len)
        query_start_loc = np.concatenate([[0], np.cumsum(query_lens)])
        num_tokens = int(query_start_loc[-1])
        positions = np.arange(num_tokens) - np.repeat(query_start_loc[:-1], query_lens)
        caches = self._allocate_kv_caches(1, populate="startup")
        attn_metadata = AttentionMetadata(
            num_actual_tokens=num_tokens, slot_mapping=self._on_device(positions % self.block_size),
            query_start_loc=self._on_device(query_start_loc), seq_lens=self._on_device(query_lens.astype(np.int32)),
            block_table=self._on_device(np.zeros((num_reqs, cdiv(int(query_lens.max()), self.block_size)),
                                                 dtype=np.int32)),
            max_query_len=int(query_lens.max()), max_seq_len=int(query_lens.max()))
        hidden_states = self.model(self._on_device(np.zeros(num_tokens, dtype=np.int64)), self._on_device(positions),
                                   caches, attn_metadata, None)
        self.model.compute_logits(hidden_states[self._on_device(query_start_loc[1:] - 1)])

    # ------------------------------------------------------------------------------------------ state
    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        # Finished requests leave for good, preempted ones leave the batch but keep their state until they
        # resume; a request merely not scheduled this step keeps its row. A finished id can come back as a new
        # request in the same step (a caller reusing ids), so it leaves first. Removals go in sorted order, not
        # the sets' (string hashing differs per process): every rank's batch must have the same rows in the same
        # order, as the TP collectives combine the ranks' rows position by position.
        for req_id in sorted(so.finished_req_ids):
            state = self.requests.pop(req_id, None)
            if state is not None and isinstance(self.drafter, SuffixDecodingProposer) and self.rank.is_driver:
                self.drafter.cache_output(state.output_token_ids)
            if req_id in batch.req_id_to_index:
                batch.remove_request(req_id)
        for req_id in sorted(so.preempted_req_ids):
            if req_id in batch.req_id_to_index:
                batch.remove_request(req_id)

        for new in so.scheduled_new_reqs:
            state = CachedRequestState(new.req_id, new.prompt_token_ids, new.sampling_params, new.eos_token_id,
                                       tuple(list(ids) for ids in new.block_ids), new.num_computed_tokens,
                                       lora_request=new.lora_request)
            self.requests[new.req_id] = state
            batch.add_request(state)

        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            new_block_ids = cached.new_block_ids[i]
            if cached.resumed_from_preemption[i]:
                state.block_ids = tuple(list(ids) for ids in new_block_ids)
                state.output_token_ids[:] = cached.resumed_req_token_ids[i][len(state.prompt_token_ids):]
                batch.add_request(state)
                continue
            row = batch.req_id_to_index[req_id]
            # Blocks only rejected drafts reached were given back by the scheduler (see CachedRequestData).
            num_kept = cdiv(state.num_computed_tokens, self.block_size)
            if len(state.block_ids[0]) > num_kept:
                for ids in state.block_ids:
                    del ids[num_kept:]
                batch.num_blocks[row] = num_kept
            for ids, new_ids in zip(state.block_ids, new_block_ids, strict=True):
                ids.extend(new_ids)
            batch.num_computed_tokens[row] = state.num_computed_tokens
            if new_block_ids[0]:
                batch.append_block_ids(row, new_block_ids)
            if cached.new_token_ids:  # pipeline parallel: tokens sampled on the last stage, news to this one
                known = int(batch.num_tokens[row]) - state.num_computed_tokens
                for token in cached.new_token_ids[i][known:]:
                    batch.append_token(row, token)
        for req_id, draft_token_ids in so.scheduled_spec_decode_tokens.items():
            batch.set_draft_tokens(batch.req_id_to_index[req_id], draft_token_ids)

    # ------------------------------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """The step's output on the driver rank (TP rank 0 of the last stage); None on every other rank."""
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        batch = self.input_batch
        # The step's rows in batch order (the batch also holds running requests not scheduled now); in a step with
        # prompt chunks its decode rows first.
        rows = np.fromiter((batch.req_id_to_index[r] for r in so.num_scheduled_tokens), dtype=np.int64,
                           count=len(so.num_scheduled_tokens))
        rows.sort()
        n = len(rows)
        num_scheduled = np.fromiter((so.num_scheduled_tokens[batch.req_ids[row]] for row in rows), dtype=np.int64,
                                    count=n)
        decodes_only = so.decodes_only()
        num_decodes = None  # a decode step's rows are all decodes; a verify step's all chunks (0)
        if not decodes_only:  # prompt chunks: decode rows first (vLLM's reorder_batch), for the decode kernel
            order = np.argsort(num_scheduled > 1, kind="stable")
            rows, num_scheduled = rows[order], num_scheduled[order]
            num_decodes = int(np.count_nonzero(num_scheduled == 1))
        elif so.total_num_scheduled_tokens > n:
            num_decodes = 0
        cu_num_tokens = np.cumsum(num_scheduled)
        num_tokens = int(cu_num_tokens[-1])
        token_rows = np.repeat(rows, num_scheduled)
        offsets = np.arange(num_tokens) - np.repeat(cu_num_tokens - num_scheduled, num_scheduled)
        num_computed = batch.num_computed_tokens[rows]
        positions = batch.num_computed_tokens[token_rows] + offsets
        input_ids = batch.token_ids[token_rows, positions]
        seq_lens = num_computed + num_scheduled
        query_start_loc = np.zeros(n + 1, dtype=np.int64)
        query_start_loc[1:] = cu_num_tokens
        # Each KV cache group's slots for the step's tokens and block table rows for its requests.
        tables = [(batch.slot_mapping(token_rows, positions, self.block_size, group), table[rows])
                  for group, table in enumerate(batch.block_tables)]
        if self.lora_manager is not None:
            self._set_active_loras(rows, num_scheduled)
        hidden_states, captured_graph = None, False
        if self.step_graphs is not None:
            hidden_states = self.step_graphs.forward(Step(input_ids, positions, seq_lens, query_start_loc, tables),
                                                     self.lora_manager and self.lora_manager.punica, num_decodes)
            captured_graph = self.step_graphs.captured
        if hidden_states is None:
            width = int(batch.num_blocks[rows].max())
            tables = [(self._on_device(slots), self._on_device(table[:, :width])) for slots, table in tables]
            # A verify step's attention is the one its graph computes (every request a prefill chunk), also eagerly.
            verify = decodes_only and num_tokens > n
            attn_metadata = AttentionMetadata(
                num_actual_tokens=num_tokens,
                slot_mapping=tables[0][0],
                query_start_loc=self._on_device(query_start_loc),
                seq_lens=self._on_device(seq_lens.astype(np.int32)),
                block_table=tables[0][1],
                max_query_len=int(num_scheduled.max()),
                max_seq_len=int(seq_lens.max()),
                chunk_query_start=self._on_device(query_start_loc[:-1].astype(np.int32)) if verify else None,
                chunk_query_len=self._on_device(num_scheduled.astype(np.int32)) if verify else None,
            ).with_groups(tables)
            hidden_states = self.model(self._on_device(input_ids), self._on_device(positions), self.kv_caches,
                                       attn_metadata, self._receive_intermediate_tensors(num_tokens))
        if not self.rank.is_last_pp_rank:
            pp_group = get_pp_group()
            pp_group.send_tensors([hidden_states[k] for k in IntermediateTensors.KEYS], pp_group.next_rank)
            batch.num_computed_tokens[rows] = seq_lens
            return None

        # The one place that decides which rows sample: those whose whole known sequence is computed after this
        # step. A prefill chunk that stops short of the prompt's end does not (its logits would be thrown away).
        sampling = np.nonzero(seq_lens >= batch.num_tokens[rows])[0]  # indices into rows
        prompt_logprobs_dict = self._prompt_logprobs(hidden_states, rows, num_computed, query_start_loc,
                                                     num_scheduled)
        batch.num_computed_tokens[rows] = seq_lens

        req_ids = [batch.req_ids[row] for row in rows]
        sampled_token_ids: list[list[int]] = [[] for _ in range(n)]
        logprobs_per_req = spec_token_ids = None
        if len(sampling):
            sample_rows = rows[sampling]
            spec = so.scheduled_spec_decode_tokens
            drafts = [spec.get(req_ids[j], ()) for j in sampling.tolist()] if spec else None
            # Each sampling request's logits rows: its last known token's position, then one per draft.
            num_drafts = np.array([len(d) for d in drafts], dtype=np.int64) if drafts else np.zeros(len(sampling),
                                                                                                dtype=np.int64)
            offsets = np.arange(int(num_drafts.sum()) + len(sampling)) - np.repeat(np.cumsum(num_drafts + 1)
                                                                                  - num_drafts - 1, num_drafts + 1)
            logits_indices = np.repeat(cu_num_tokens[sampling] - 1 - num_drafts, num_drafts + 1) + offsets
            logits = self._compute_logits(hidden_states, logits_indices)
            sampler_output = None
            if logits is not None:  # TP rank 0
                logits_rows = np.repeat(sample_rows, num_drafts + 1)
                if so.grammar_bitmask is not None:  # a constrained request gets no drafts: one row each
                    self._apply_grammar_bitmask(logits, logits_rows, so)
                metadata = batch.make_sampling_metadata(logits_rows, offsets)
                if drafts:
                    sampler_output = self.rejection_sampler(logits, metadata, drafts)
                else:
                    sampler_output = self.sampler(logits, metadata)
                sampled = sampler_output.sampled_token_ids.view(len(sampling), -1)
            else:
                sampled = torch.empty(len(sampling), int(num_drafts.max()) + 1, dtype=torch.int64)
            if self.rank.tp_size > 1:
                sampled = get_tp_group().broadcast(sampled.to(torch.int64).contiguous())
            for j, row, tokens in zip(sampling.tolist(), sample_rows.tolist(), sampled.tolist()):
                tokens = [t for t in tokens if t != PLACEHOLDER_TOKEN_ID]
                for token in tokens:
                    batch.append_token(row, token)
                sampled_token_ids[j] = tokens
            if sampler_output is not None and sampler_output.logprobs is not None:
                logprobs_per_req = self._split_logprobs(n, sampling, sample_rows, sampler_output.logprobs.tolists(),
                                                        [len(sampled_token_ids[j]) for j in sampling.tolist()])
        if self.drafter is not None and self.rank.is_driver:
            max_drafts = self._max_drafts(rows[sampling]) if so.propose_drafts else np.zeros(len(sampling), np.int64)
            spec_token_ids = self._propose_drafts(ProposalStep(rows, num_computed, num_scheduled, sampling,
                                                               max_drafts))
        if not self.rank.is_driver:
            return None
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: j for j, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled_token_ids, logprobs=logprobs_per_req,
                                 prompt_logprobs_dict=prompt_logprobs_dict, spec_token_ids=spec_token_ids,
                                 captured_graph=captured_graph)

    def _on_device(self, array: np.ndarray) -> torch.Tensor:
        """A step's input array as a tensor on the model's device (on the CPU, a view of the array)."""
        tensor = torch.from_numpy(array)
        return tensor if self.device.type == "cpu" else tensor.to(self.device, non_blocking=True)

    def _on_host(self, logits: torch.Tensor | None) -> torch.Tensor | None:
        """Logits where the sampler runs: the CPU, whose tensors (sampling metadata, generators, grammar bitmasks)
        are the batch's (None stays None: a TP rank other than 0)."""
        return logits if logits is None or logits.device.type == "cpu" else logits.float().cpu()

    def _compute_logits(self, hidden_states: torch.Tensor, token_indices: np.ndarray) -> torch.Tensor | None:
        """The logits (on the host) of the step's tokens ``token_indices``, each by its request's adapter's LM head
        LoRA where it has one."""
        if self.lora_manager is not None:
            self.lora_manager.set_logits_rows(torch.from_numpy(token_indices))
        return self._on_host(self.model.compute_logits(hidden_states[self._on_device(token_indices)]))

    def _set_active_loras(self, rows: np.ndarray, num_scheduled: np.ndarray) -> None:
        """This step's adapters into slots, and each token's slot for the LoRA'd layers."""
        loras = [self.input_batch.states[row].lora_request for row in rows.tolist()]
        row_ids = np.array([lora.lora_int_id if lora is not None else 0 for lora in loras], dtype=np.int64)
        self.lora_manager.set_active_loras({lora.lora_int_id: lora for lora in loras if lora is not None},
                                           torch.from_numpy(np.repeat(row_ids, num_scheduled)))

    def _propose_drafts(self, step: ProposalStep) -> list[list[int]]:
        """Per output index: the drafts for the request's next step (none for a request that did not sample)."""
        spec_token_ids: list[list[int]] = [[] for _ in range(len(step.rows))]
        for j, drafts in zip(step.sampling.tolist(), self.drafter.propose_for_step(self.input_batch, step)):
            spec_token_ids[j] = drafts
        return spec_token_ids

    def _max_drafts(self, sample_rows: np.ndarray) -> np.ndarray:
        """How many drafts each sampling row may take: all of them accepted plus the token sampled after them must
        fit max_model_len (and speculative_config's, the drafts' context) and max_tokens; none where structured
        output constrains every token (its grammar would have to check drafts before verification)."""
        batch = self.input_batch
        spec = self.config.speculative_config
        max_model_len = min(self.model_config.max_model_len, spec.max_model_len or self.model_config.max_model_len)
        limits = np.minimum(spec.num_speculative_tokens, max_model_len - 1 - batch.num_tokens[sample_rows])
        for j, row in enumerate(sample_rows.tolist()):
            state = batch.states[row]
            params = state.sampling_params
            if params.structured_outputs is not None:
                limits[j] = 0
            elif params.max_tokens is not None:
                limits[j] = min(limits[j], params.max_tokens - len(state.output_token_ids) - 1)
        return np.maximum(limits, 0)

    def _receive_intermediate_tensors(self, num_tokens: int) -> IntermediateTensors | None:
        """The previous stage's hidden states and residual for this step's ``num_tokens`` tokens (None on the
        first stage). Both sides know the shapes from the SchedulerOutput they share."""
        if self.rank.is_first_pp_rank:
            return None
        shape = (num_tokens, self.model_config.hf_config.hidden_size)
        pp_group = get_pp_group()
        buffers = [torch.empty(shape, dtype=self.kernels.compute_dtype, device=self.device)
                   for _ in IntermediateTensors.KEYS]
        pp_group.recv_tensors(buffers, pp_group.prev_rank)
        return IntermediateTensors(zip(IntermediateTensors.KEYS, buffers))

    def _apply_grammar_bitmask(self, logits: torch.Tensor, sample_rows: np.ndarray, so: SchedulerOutput) -> None:
        """Structured-output rows may only sample what their grammar allows; other rows are left untouched."""
        bitmask_row_of = so.structured_output_request_ids
        req_ids = self.input_batch.req_ids
        logits_rows, bitmask_rows = [], []
        for logits_row, batch_row in enumerate(sample_rows.tolist()):
            bitmask_row = bitmask_row_of.get(req_ids[batch_row])
            if bitmask_row is not None:
                logits_rows.append(logits_row)
                bitmask_rows.append(bitmask_row)
        if logits_rows:
            apply_bitmask(logits, so.grammar_bitmask[bitmask_rows], logits_rows)

    def _split_logprobs(self, n: int, sampling: np.ndarray, sample_rows: np.ndarray, lists: LogprobsLists,
                        num_emitted: list[int]) -> list:
        """Per output index (of the step's n requests): the logprobs rows of the tokens it emitted (one each,
        consecutive in ``lists``), cut to the k it asked for (None if it did not sample or ask)."""
        per_req = [None] * n
        first = 0
        for index, row, count in zip(sampling.tolist(), sample_rows.tolist(), num_emitted):
            k = self.input_batch.states[row].sampling_params.num_logprobs
            rows = range(first, first + count)
            first += count
            if k is not None:
                per_req[index] = LogprobsLists([lists.logprob_token_ids[r][:k + 1] for r in rows],
                                               [lists.logprobs[r][:k + 1] for r in rows],
                                               [lists.sampled_token_ranks[r] for r in rows])
        return per_req

    def _prompt_logprobs(self, hidden_states: torch.Tensor, rows: np.ndarray, num_computed: np.ndarray,
                         query_start_loc: np.ndarray, num_scheduled: np.ndarray) -> dict[str, LogprobsLists]:
        """Logprobs of each next prompt token for the prompt positions computed in this step (the step's j-th
        request is batch row rows[j], its chunk starting at position num_computed[j])."""
        out = {}
        for j, row in enumerate(rows.tolist()):
            state = self.input_batch.states[row]
            k = state.sampling_params.prompt_logprobs
            start = int(num_computed[j])
            num_prompt = len(state.prompt_token_ids)
            if k is None or start >= num_prompt:
                continue
            # Position p predicts prompt token p + 1; the last prompt position predicts a sampled token.
            # A request recomputing after preemption skips the positions it already reported.
            end = min(start + int(num_scheduled[j]), num_prompt - 1)
            first_pos = max(start, state.num_prompt_logprobs_done)
            if end <= first_pos:
                continue
            first = int(query_start_loc[j]) + first_pos - start
            logits = self._compute_logits(hidden_states, np.arange(first, first + end - first_pos))
            state.num_prompt_logprobs_done = end
            if logits is None:  # a TP rank other than 0: it joined the gather, rank 0 reports
                continue
            targets = torch.tensor(state.prompt_token_ids[first_pos + 1:end + 1])
            out[state.req_id] = compute_token_logprobs(logits, targets, k, self.sampler.logprobs_mode).tolists()
        return out


def make_proposer(config: EngineConfig) -> NgramProposer | DraftModelProposer | SuffixDecodingProposer | None:
    """The proposer of the engine's speculative_config method (None without speculation)."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "draft_model":
        return DraftModelProposer(config)
    if spec.method == "suffix":
        return SuffixDecodingProposer(spec)
    return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, spec.num_speculative_tokens,
                         config.model_config.max_model_len)
