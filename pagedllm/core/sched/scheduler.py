"""Scheduler: each step hands a token budget to running requests first, then to waiting ones.

There is no prefill or decode phase. Every request has num_computed_tokens and a target (its token count);
a step closes part of each gap. A prompt larger than the budget left is chunked across steps. When KV blocks
run out, the lowest-priority running request is preempted by recompute.

Speculative decoding extends a running request's target by the draft tokens its worker proposed
(num_tokens_with_spec): they take budget and KV slots like any token, and after verification the rejected
ones give both back (num_computed_tokens moves back, blocks only they reached are freed). Drafts are never in
a request's known tokens, so no block holding one is ever hashed into the prefix cache.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Optional

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_cache_utils import KVCacheBlock
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.core.sched.request_queue import SchedulingPolicy, create_request_queue
from pagedllm.core.sched.spec_budget import SpecDecodeBudget
from pagedllm.core.sched.utils import check_stop
from pagedllm.engine.protocol import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from pagedllm.worker.outputs import ModelRunnerOutput

if TYPE_CHECKING:
    from pagedllm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 structured_output_manager: Optional["StructuredOutputManager"] = None,
                 pipeline_parallel_size: int = 1, num_speculative_tokens: int = 0,
                 num_lookahead_tokens: int = 0, max_loras: int = 0) -> None:
        """With ``pipeline_parallel_size`` > 1 the workers are pipeline stages: scheduled running requests carry
        their tokens, and each batch takes about 1/pp of the requests so that pp batches keep every stage busy.

        ``num_lookahead_tokens``: KV slots each scheduled request gets past its step's tokens for the proposer to
        write (a draft model's); they are scratch, given back when the step's results come in.

        ``max_loras`` (0: LoRA off): the most adapters the running requests may use at once, so that every step's
        fit the workers' slots."""
        if cache_config.num_blocks is None:
            raise ValueError("cache_config.num_blocks must be set before building the Scheduler")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_model_len = scheduler_config.max_model_len
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens
        self.policy = scheduler_config.policy
        self.block_size = cache_config.block_size
        self.num_lookahead_tokens = num_lookahead_tokens
        # The KV slots a step gives a request at most (EngineConfig.max_step_slots): under a sliding window they bound
        # its blocks (max_blocks), at admission as in the engine's auto-fit and the worker's start-up line.
        self.kv_cache_manager = KVCacheManager(cache_config.num_blocks, cache_config.block_size,
                                               self.max_model_len, cache_config.enable_prefix_caching,
                                               group_windows=cache_config.group_windows,
                                               max_step_tokens=self.max_num_scheduled_tokens + num_lookahead_tokens)
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Waiting requests passed over for a reason other than the step's capacity (a grammar compiling, no LoRA
        # slot free) and not scheduled since, vLLM's deferred_waiting: the stats' num_skipped_waiting_reqs.
        self.deferred_waiting: set[str] = set()
        # Finished since the last schedule(): the workers must drop their state.
        self.finished_req_ids: set[str] = set()
        # Outputs for requests refused at admission, delivered with the next update_from_output().
        self._rejected_outputs: list[EngineCoreOutput] = []
        # Requests preempted between steps (reset_prefix_cache): the next step tells the workers to drop their rows.
        self._preempted_between_steps: set[str] = set()
        self.num_preemptions = 0
        # Steps that ran tokens, and those tokens, since start-up (the engine view's steps/s and tokens/step).
        self.num_steps = self.num_step_tokens = 0
        self.structured_output_manager = structured_output_manager
        self.pipeline_parallel_size = pipeline_parallel_size
        self.use_pp = pipeline_parallel_size > 1
        # Requests in a batch still executing (pipeline parallel keeps several in flight): not scheduled again, and
        # not preempted, until update_from_output has that batch's tokens.
        self.in_flight: set[str] = set()
        self.num_speculative_tokens = num_speculative_tokens
        self.spec_decode_num_drafts = self.spec_decode_num_draft_tokens = self.spec_decode_num_accepted_tokens = 0
        self.spec_decode_num_accepted_tokens_per_pos = [0] * num_speculative_tokens
        self.spec_budget = SpecDecodeBudget() if num_speculative_tokens else None
        self.max_loras = max_loras

    # ----------------------------------------------------------------------------------------- requests
    def add_request(self, request: Request) -> None:
        """Queues ``request``; an id the scheduler still holds is a ValueError, raised before anything changes, as
        vLLM's refuses a duplicate (its assertion): the frontends refuse one first, so this guards direct callers
        of the engine core, whose duplicate would otherwise replace the running request's entry, leaving its
        blocks to no one and its outputs to the newcomer."""
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id!r} is already in the scheduler.")
        error = self._admission_error(request)
        if error is not None:
            self.reject(request, error)
            return
        if request.sampling_params.structured_outputs is not None:
            if self.structured_output_manager is None:
                self.reject(request, "structured output is not enabled in this engine.")
                return
            self.structured_output_manager.grammar_init(request)
            request.status = RequestStatus.WAITING_FOR_FSM
            self.deferred_waiting.add(request.request_id)
        self.requests[request.request_id] = request
        self.waiting.add_request(request)

    def reject(self, request: Request, error: str) -> None:
        """Finishes a request that can never run; its output (with the error) goes out with the next update."""
        request.status = RequestStatus.FINISHED_IGNORED
        request.error = error
        self._rejected_outputs.append(EngineCoreOutput(
            request.request_id, [], finish_reason=request.get_finished_reason(), error=error))

    def _admission_error(self, request: Request) -> Optional[str]:
        """Why a request can never run, if so; such a request would otherwise wait or preempt forever."""
        if request.num_prompt_tokens == 0:
            return "The prompt is empty."
        if request.num_prompt_tokens >= self.max_model_len:
            return (f"The prompt ({request.num_prompt_tokens} tokens) is too long: this model's maximum context "
                    f"length is {self.max_model_len} tokens, and at least one token must be generated.")
        max_tokens = request.max_tokens if request.max_tokens is not None else self.max_model_len
        peak_tokens = min(request.num_prompt_tokens + max_tokens + self.num_lookahead_tokens, self.max_model_len)
        peak_blocks = self.kv_cache_manager.max_blocks(peak_tokens)
        if peak_blocks > self.kv_cache_manager.num_blocks:
            return (f"The request needs up to {peak_tokens} tokens of KV cache "
                    f"({peak_blocks} blocks at once) but the whole cache holds "
                    f"{self.kv_cache_manager.num_blocks} blocks of {self.block_size} tokens.")
        return None

    def finish_requests(self, request_ids: Iterable[str] | str, finished_status: RequestStatus) -> None:
        """Ends requests from outside the step loop (abort, stop string found by the frontend)."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove_request(request)
            request.status = finished_status
            self._free_request(request)

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.deferred_waiting.discard(request.request_id)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_requests(self) -> bool:
        return bool(self.get_num_unfinished_requests() or self.finished_req_ids or self._rejected_outputs)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forgets the prefix cache; refused (False) while a request holds blocks. With ``reset_running_requests``
        every running request is preempted first (the last first, so that they resume in their order), as vLLM's:
        their blocks go back, and they recompute their tokens when they resume. Requests in a batch still executing
        (pipeline parallel) are not preempted, so that the reset may still be refused."""
        if reset_running_requests:
            for request in [r for r in reversed(self.running) if r.request_id not in self.in_flight]:
                self.running.remove(request)
                self._preempt(request)
                self._preempted_between_steps.add(request.request_id)
        return self.kv_cache_manager.reset_prefix_cache()

    # ----------------------------------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        token_budget = self.max_num_scheduled_tokens
        num_scheduled_tokens: dict[str, int] = {}
        new_blocks_of: dict[str, tuple[Sequence[KVCacheBlock], ...]] = {}
        spec_tokens: dict[str, list[int]] = {}
        scheduled_running: list[Request] = []
        preempted: list[Request] = []

        if self.spec_budget is not None:
            decodes = [r for r in self.running if r.num_computed_tokens == r.num_tokens - 1]
            self.spec_budget.trim_drafts(decodes, only_decodes=len(decodes) == len(self.running) and not self.waiting)

        # A batch's share of the requests under pipeline parallelism (all of them otherwise).
        max_batch_reqs = -(-(len(self.running) + len(self.waiting)) // self.pipeline_parallel_size)
        # Prompt tokens this step may take: capped while running requests decode in it, so that their next token
        # does not wait behind a whole budget of prefills.
        prefill_budget = token_budget
        cap = self.scheduler_config.max_prefill_tokens_with_decodes
        if cap and self.scheduler_config.enable_chunked_prefill and any(
                not _prefilling(r) and r.request_id not in self.in_flight for r in self.running):
            prefill_budget = cap
        # A long prompt's share of a step: capped so that it does not starve the other requests, unless there are
        # none (vLLM's schedule(): the cap is not applied to the only request).
        threshold = self.scheduler_config.long_prefill_token_threshold
        if len(self.running) + len(self.waiting) <= 1:
            threshold = 0

        # Running requests first, in order.
        req_index = 0
        while req_index < len(self.running) and token_budget > 0 and len(num_scheduled_tokens) < max_batch_reqs:
            request = self.running[req_index]
            if request.request_id in self.in_flight:
                req_index += 1
                continue
            num_new_tokens = request.num_tokens_with_spec - request.num_computed_tokens
            prefilling = _prefilling(request)
            if num_new_tokens > 1:  # decodes (1 token) skip the caps
                num_new_tokens = self._cap_new_tokens(
                    request, num_new_tokens, min(token_budget, prefill_budget) if prefilling else token_budget,
                    threshold)
            if num_new_tokens <= 0:
                req_index += 1
                continue
            while True:
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request, num_new_tokens, num_lookahead_tokens=self.num_lookahead_tokens)
                if new_blocks is not None:
                    break
                victim = self._pick_preemption_victim()
                if victim is None:  # every other running request is in flight: wait for a batch to return
                    break
                if self.running.index(victim) < req_index:
                    req_index -= 1  # the priority policy may pick one already passed this step
                self.running.remove(victim)
                if victim.request_id in num_scheduled_tokens:
                    if _prefilling(victim):
                        prefill_budget += num_scheduled_tokens[victim.request_id]
                    token_budget += num_scheduled_tokens.pop(victim.request_id)
                    new_blocks_of.pop(victim.request_id)
                    spec_tokens.pop(victim.request_id, None)
                    scheduled_running.remove(victim)
                    # Its allocation this step registered the blocks its tokens would fill, which no step computes now.
                    self.kv_cache_manager.uncache_uncomputed_blocks(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                break
            scheduled_running.append(request)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            new_blocks_of[request.request_id] = new_blocks
            # The drafts that fit after the known tokens (caps may have cut some off).
            num_spec = num_new_tokens + request.num_computed_tokens - request.num_tokens
            if num_spec > 0:
                spec_tokens[request.request_id] = request.spec_token_ids[:num_spec]
            token_budget -= num_new_tokens
            if prefilling:
                prefill_budget -= num_new_tokens
            req_index += 1

        # Then waiting requests, unless this step had to preempt (the cache is too tight to admit more).
        scheduled_new: list[Request] = []
        scheduled_resumed: list[Request] = []
        skipped_waiting: list[Request] = []
        running_loras = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        lora_blocked = False
        while not preempted and self.waiting and min(token_budget, prefill_budget) > 0:
            if len(self.running) >= self.max_num_running_reqs or len(num_scheduled_tokens) >= max_batch_reqs:
                break
            request = self.waiting.peek_request()
            if request.status == RequestStatus.WAITING_FOR_FSM and not self._grammar_ready(request):
                if request.is_finished():  # its grammar failed to compile
                    self.waiting.pop_request()
                    self._free_request(request)
                else:
                    skipped_waiting.append(self.waiting.pop_request())
                    self.deferred_waiting.add(request.request_id)
                continue
            lora = request.lora_request
            if lora is not None and (lora_blocked or (lora.lora_int_id not in running_loras
                                                      and len(running_loras) >= self.max_loras)):
                # Every adapter slot is taken: it waits, and so does every adapter request behind it (the running
                # adapters then drain and free a slot for it, rather than new requests keeping them busy for
                # ever); requests for the base model go on.
                lora_blocked = True
                skipped_waiting.append(self.waiting.pop_request())
                self.deferred_waiting.add(request.request_id)
                continue
            hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_new_tokens = request.num_tokens - num_hit_tokens
            if not self.scheduler_config.enable_chunked_prefill and num_new_tokens > token_budget:
                break  # the head does not fit whole; shorter ones behind it must not jump ahead
            num_new_tokens = self._cap_new_tokens(request, num_new_tokens, min(token_budget, prefill_budget),
                                                  threshold, num_hit_tokens)
            # With scheduler_reserve_full_isl a request is admitted once its whole prompt fits, as vLLM's, not to be
            # preempted half-computed.
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_new_tokens, hit_blocks, num_hit_tokens, self.num_lookahead_tokens,
                full_sequence_must_fit=self.scheduler_config.scheduler_reserve_full_isl)
            if new_blocks is None:
                break
            self.kv_cache_manager.record_prefix_cache_stats(request, num_hit_tokens)
            self.waiting.pop_request()
            self.deferred_waiting.discard(request.request_id)
            self.running.append(request)
            if lora is not None:
                running_loras.add(lora.lora_int_id)
            (scheduled_resumed if request.status == RequestStatus.PREEMPTED else scheduled_new).append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
                request.first_scheduled_time = time.time()
            num_scheduled_tokens[request.request_id] = num_new_tokens
            new_blocks_of[request.request_id] = new_blocks
            token_budget -= num_new_tokens
            prefill_budget -= num_new_tokens
        for request in reversed(skipped_waiting):  # back at the front, in their order
            self.waiting.prepend_request(request)

        output = self._make_output(scheduled_new, scheduled_resumed, scheduled_running, num_scheduled_tokens,
                                   new_blocks_of, preempted)
        output.scheduled_spec_decode_tokens = spec_tokens
        output.propose_drafts = self.spec_budget is None or self.spec_budget.proposals_wanted
        self._add_grammar_bitmask(output)
        # Advance at schedule time: the step's KV will exist by the time the next step is planned.
        for req_id, n in num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += n
        self.in_flight.update(num_scheduled_tokens)
        self.finished_req_ids = set()
        return output

    def _grammar_ready(self, request: Request) -> bool:
        """Moves a request whose grammar has compiled back to WAITING; one whose compile failed is finished. Any
        error fails that request only, as vLLM's: a ValueError names what is wrong with the spec; anything else (the
        tokenizer's vocabulary could not be read for the grammar, say) is the engine's, and logged."""
        try:
            ready = request.structured_output_request.is_ready()
        except ValueError as e:
            self.reject(request, str(e))
            return False
        except Exception as e:
            logger.exception("request %s: its structured_outputs grammar could not be built", request.request_id)
            self.reject(request, f"The structured_outputs grammar could not be built: {type(e).__name__}: {e}")
            return False
        if ready:
            request.status = RequestStatus.WAITING
        return ready

    def _add_grammar_bitmask(self, output: SchedulerOutput) -> None:
        """Fills the token bitmask of every structured-output request scheduled this step, as vLLM does; the
        model runner, which alone decides which rows sample, applies the rows it samples."""
        if self.structured_output_manager is None:
            return
        requests = self.requests
        constrained = [requests[req_id] for req_id in output.num_scheduled_tokens
                       if requests[req_id].structured_output_request is not None
                       and requests[req_id].structured_output_request.constrains_next_token]
        if constrained:
            output.structured_output_request_ids = {r.request_id: row for row, r in enumerate(constrained)}
            output.grammar_bitmask = self.structured_output_manager.grammar_bitmask(constrained)

    def waiting_for_grammars(self) -> list[Request]:
        """Waiting requests whose grammar is still compiling."""
        return [r for r in self.waiting if r.status == RequestStatus.WAITING_FOR_FSM]

    def _cap_new_tokens(self, request: Request, num_new_tokens: int, token_budget: int, threshold: int,
                        num_computed_tokens: Optional[int] = None) -> int:
        """The tokens a request computes this step: at most ``threshold`` (0: no cap) and the budget left, and never
        a position at max_model_len."""
        if threshold:
            num_new_tokens = min(num_new_tokens, threshold)
        computed = request.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        # Positions never reach max_model_len: a request stops when it has that many tokens.
        return min(num_new_tokens, token_budget, self.max_model_len - 1 - computed)

    def _pick_preemption_victim(self) -> Optional[Request]:
        """The request to preempt among those not in flight (None if every one is)."""
        candidates = [r for r in self.running if r.request_id not in self.in_flight]
        if not candidates:
            return None
        if self.policy == SchedulingPolicy.PRIORITY:
            # Largest priority value, then latest arrival; of equals the first running (vLLM's key: no request id).
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]  # FCFS: the newest

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: drop its KV (cached full blocks may survive) and requeue it first."""
        self.kv_cache_manager.free(request)
        request.set_spec_token_ids([])
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(request)

    def _make_output(self, new_reqs: list[Request], resumed: list[Request], running: list[Request],
                     num_scheduled_tokens: dict[str, int],
                     new_blocks_of: dict[str, tuple[Sequence[KVCacheBlock], ...]],
                     preempted: list[Request]) -> SchedulerOutput:
        kv = self.kv_cache_manager
        new_reqs_data = [NewRequestData.from_request(r, kv.get_block_ids(r.request_id)) for r in new_reqs]
        cached = CachedRequestData(
            req_ids=[r.request_id for r in running] + [r.request_id for r in resumed],
            resumed_from_preemption=[False] * len(running) + [True] * len(resumed),
            resumed_req_token_ids=[None] * len(running) + [list(r.all_token_ids) for r in resumed],
            new_block_ids=([kv.new_block_ids(new_blocks_of[r.request_id]) for r in running]
                           + [kv.get_block_ids(r.request_id) for r in resumed]),
            num_computed_tokens=[r.num_computed_tokens for r in running] + [r.num_computed_tokens for r in resumed],
        )
        if self.use_pp:
            cached.new_token_ids = [r.all_token_ids[r.num_computed_tokens:r.num_computed_tokens
                                                    + num_scheduled_tokens[r.request_id]] for r in running]
            cached.new_token_ids += [[] for _ in resumed]
        total_num_scheduled_tokens = sum(num_scheduled_tokens.values())
        if total_num_scheduled_tokens:
            self.num_steps += 1
            self.num_step_tokens += total_num_scheduled_tokens
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs_data,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total_num_scheduled_tokens,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=self._take_preempted_req_ids(preempted),
        )

    def _take_preempted_req_ids(self, preempted: list[Request]) -> set[str]:
        """The requests this step preempted, and those preempted since the last step (which may resume in this
        one: the workers drop a preempted request's row before they add the resumed ones)."""
        req_ids = {r.request_id for r in preempted if r.status == RequestStatus.PREEMPTED}
        req_ids |= {req_id for req_id in self._preempted_between_steps if req_id in self.requests}
        self._preempted_between_steps = set()
        return req_ids

    # ----------------------------------------------------------------------------------------- update
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        """Appends sampled tokens, applies stop conditions, frees finished requests, and reports."""
        outputs: list[EngineCoreOutput] = self._rejected_outputs
        self._rejected_outputs = []
        index_of = model_runner_output.req_id_to_index
        sampled_token_ids = model_runner_output.sampled_token_ids
        all_logprobs = model_runner_output.logprobs
        prompt_logprobs_dict = model_runner_output.prompt_logprobs_dict
        scheduled_spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        proposed_spec_tokens = model_runner_output.spec_token_ids
        requests = self.requests
        max_model_len = self.max_model_len
        stopped_requests = []
        self.in_flight.difference_update(scheduler_output.num_scheduled_tokens)
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(req_id)
            if request is None:
                continue  # aborted while the step ran
            i = index_of[req_id]
            new_token_ids = sampled_token_ids[i]
            drafts = scheduled_spec_tokens.get(req_id)
            if drafts and new_token_ids:
                self._apply_verification(request, len(drafts), len(new_token_ids) - 1)
            if self.num_lookahead_tokens:  # the proposer's scratch slots, past the request's computed tokens
                self.kv_cache_manager.free_blocks_beyond(request, request.num_computed_tokens)
            request.set_spec_token_ids([])
            finish_reason = None
            so_request = request.structured_output_request
            for num_appended, token_id in enumerate(new_token_ids, 1):
                request.append_output_token_id(token_id)
                if check_stop(request, max_model_len) or (
                        so_request is not None and self._grammar_rejects(request, token_id)):
                    del new_token_ids[num_appended:]
                    finish_reason = request.get_finished_reason()
                    stopped_requests.append(request)
                    break
            if finish_reason is None and proposed_spec_tokens is not None:
                request.set_spec_token_ids(self._usable_drafts(request, proposed_spec_tokens[i]))
            prompt_logprobs = prompt_logprobs_dict.get(req_id) if prompt_logprobs_dict else None
            if not new_token_ids and prompt_logprobs is None:
                continue
            logprobs = all_logprobs[i] if all_logprobs else None
            if logprobs is not None:  # only the tokens kept: a stop among accepted drafts cuts the rest
                logprobs = logprobs.first(len(new_token_ids))
            outputs.append(EngineCoreOutput(
                req_id, new_token_ids, logprobs, prompt_logprobs, finish_reason,
                request.stop_reason, request.error if finish_reason is not None else None,
                request.num_cached_tokens if request.num_cached_tokens > 0 else 0,
                request.first_scheduled_time if request.num_output_tokens == len(new_token_ids) else 0.0,
                request.num_preemptions))
        if stopped_requests:
            stopped_ids = {r.request_id for r in stopped_requests}
            self.running = [r for r in self.running if r.request_id not in stopped_ids]
            for request in stopped_requests:
                self._free_request(request)
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.make_stats(), timestamp=time.monotonic())

    def _apply_verification(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """The worker accepted ``num_accepted`` of the request's ``num_drafts`` drafts: the rejected ones' KV is
        not the request's, so its computed tokens move back and blocks only they reached are given back."""
        SpecDecodeBudget.record_verification(request, num_drafts, num_accepted)
        self.spec_decode_num_drafts += 1
        self.spec_decode_num_draft_tokens += num_drafts
        self.spec_decode_num_accepted_tokens += num_accepted
        per_pos = self.spec_decode_num_accepted_tokens_per_pos
        for pos in range(min(num_accepted, len(per_pos))):
            per_pos[pos] += 1
        num_rejected = num_drafts - num_accepted
        if num_rejected > 0:
            request.num_computed_tokens -= num_rejected
            self.kv_cache_manager.free_blocks_beyond(request, request.num_computed_tokens)

    def record_step_time(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        """How long the workers took for a step: decode steps (every request computing its one known token and its
        drafts) feed the cost fit that dynamic speculation weighs drafts by."""
        if self.spec_budget is None or scheduler_output.scheduled_new_reqs or not scheduler_output.decodes_only():
            return
        num_drafts = sum(len(drafts) for drafts in scheduler_output.scheduled_spec_decode_tokens.values())
        self.spec_budget.observe_step(scheduler_output.total_num_scheduled_tokens, num_drafts, seconds)

    def _usable_drafts(self, request: Request, drafts: list[int]) -> list[int]:
        """Drafts cut so that all accepted, plus the token sampled after them, would neither pass max_tokens nor
        reach max_model_len: no step computes tokens the request could never keep."""
        limit = self.max_model_len - 1 - request.num_tokens
        if request.max_tokens is not None:
            limit = min(limit, request.max_tokens - request.num_output_tokens - 1)
        return drafts[:max(limit, 0)]

    @staticmethod
    def _grammar_rejects(request: Request, token_id: int) -> bool:
        """Advances the request's grammar with a token that did not stop the request. The grammar ends on one of the
        request's stop tokens, which stops the request (check_stop) but under ignore_eos for EOS and the generation
        config's: then the request goes on unconstrained, the ended grammar reading no more tokens, as vLLM's. A token
        the grammar rejects (its mask left nothing to sample: allowed_token_ids or bad_words took every token it
        allows) ends the request with an error, as vLLM ends it FINISHED_ERROR, never as a "stop" whose output breaks
        the constraint."""
        so_request = request.structured_output_request
        if not so_request.reasoning_ended:  # the grammar starts after the token that ends the reasoning
            so_request.observe_reasoning_token(token_id)
            return False
        grammar = so_request.grammar
        if grammar.is_terminated() or grammar.accept_token(token_id):
            return False
        logger.error("request %s: token %d does not follow its grammar; stopping it", request.request_id, token_id)
        request.error = (f"The sampled token {token_id} does not follow the request's structured_outputs "
                         "constraint: its other sampling controls (allowed_token_ids, bad_words) left no token "
                         "the constraint allows.")
        request.status = RequestStatus.FINISHED_STOPPED
        return True

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting) - len(self.deferred_waiting),
            num_skipped_waiting_reqs=len(self.deferred_waiting), kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
            prefix_cache_requests=kv.prefix_cache_requests, prefix_cache_resets=kv.prefix_cache_resets,
            num_preemptions=self.num_preemptions,
            spec_decode_num_drafts=self.spec_decode_num_drafts,
            spec_decode_num_draft_tokens=self.spec_decode_num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_decode_num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(self.spec_decode_num_accepted_tokens_per_pos),
            running_lora_adapters=_count_adapters(self.running), waiting_lora_adapters=_count_adapters(self.waiting))


def _prefilling(request: Request) -> bool:
    """Whether the request has more to compute than its one uncomputed known token (and its drafts): its prompt, or
    after a preemption its prompt and its outputs again (vLLM's prefill_end, max(num_prompt_tokens, num_tokens - 1)),
    which costs a step what a prompt does."""
    return request.num_computed_tokens < max(request.num_prompt_tokens, request.num_tokens - 1)


def _count_adapters(requests) -> dict[str, int]:
    return dict(Counter(r.lora_request.lora_name for r in requests if r.lora_request is not None))
