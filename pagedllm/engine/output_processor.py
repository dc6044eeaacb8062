"""OutputProcessor (frontend side): engine outputs → detokenized RequestOutputs; finds stop strings.

The engine core only sees token ids. Text, stop strings and logprob decoding happen here, in the frontend
process, and a stop string found here is sent back to the engine as an abort.
"""
from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.parallel_sampling import ParentRequest
from pagedllm.engine.protocol import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics.stats import FinishedRequestStats, IterationStats, RequestStateStats
from pagedllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput, SampleLogprobs
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


class RequestOutputCollector:
    """vLLM's: where one request's outputs wait for its consumer (AsyncLLM.add_request's), which get() takes. As
    vLLM's, outputs the consumer has not taken yet are merged into one (RequestOutput.add): a stream's DELTA outputs
    joined, a CUMULATIVE one replaced by the later, so that a slow consumer gets everything so far at once instead of
    a backlog growing with each step. An error (an engine's death) takes the place of what waits, and get() raises
    it."""

    def __init__(self, output_kind: RequestOutputKind, request_id: str) -> None:
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self.request_id = request_id  # the unique id the request runs under (abort's with internal=True)
        self.output: Union[RequestOutput, BaseException, None] = None
        self.ready = asyncio.Event()

    def put(self, output: Union[RequestOutput, BaseException]) -> None:
        if self.output is None or isinstance(output, BaseException):
            self.output = output
            self.ready.set()
        elif isinstance(self.output, RequestOutput):
            self.output.add(output, aggregate=self.aggregate)

    async def get(self) -> RequestOutput:
        while self.output is None:
            await self.ready.wait()
        return self._take()

    def get_nowait(self) -> Optional[RequestOutput]:
        """The output waiting, or None when none has come yet."""
        return None if self.output is None else self._take()

    def _take(self) -> RequestOutput:
        output, self.output = self.output, None
        self.ready.clear()
        if isinstance(output, BaseException):  # EngineDeadError
            raise output
        return output


class RequestState:
    def __init__(self, request_id: str, index: int, prompt: Optional[str], prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer: Any, parent: Optional[ParentRequest], arrival_time: float,
                 log_stats: bool, stream_interval: int = 1, lora_request: Optional[LoRARequest] = None,
                 external_req_id: Optional[str] = None, queue: Optional[RequestOutputCollector] = None) -> None:
        """``external_req_id``: the caller's id, which its outputs carry (None: ``request_id`` is). ``queue``: where
        its outputs go (an AsyncLLM generate()'s), instead of the outputs process_outputs returns."""
        self.request_id = request_id
        self.external_req_id = external_req_id or request_id
        self.queue = queue
        self.lora_request = lora_request
        self.index = index
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        # detokenize=False: no text, nor a decoded_token for the logprobs (vLLM's: they cost the time it saves)
        self.tokenizer = tokenizer if params.detokenize else None
        self.output_kind = params.output_kind
        self.parent = parent
        self.detokenizer = (IncrementalDetokenizer(tokenizer, prompt_token_ids, params)
                            if self.tokenizer is not None else None)
        self.token_ids: list[int] = []
        self.logprobs: Optional[SampleLogprobs] = [] if params.num_logprobs is not None else None
        self.cumulative_logprob: Optional[float] = 0.0 if params.num_logprobs is not None else None
        self.prompt_logprobs: Optional[PromptLogprobs] = [None] if params.prompt_logprobs is not None else None
        self.num_sent_tokens = 0
        self.num_cached_tokens = 0
        self.stream_interval = stream_interval
        self.stats = RequestStateStats(arrival_time=arrival_time, queued_ts=arrival_time) if log_stats else None

    def record_timing(self, out: EngineCoreOutput, now: float, stats: IterationStats) -> None:
        req = self.stats
        if out.first_scheduled_time:
            req.scheduled_ts = out.first_scheduled_time
        req.num_preemptions = max(req.num_preemptions, out.num_preemptions)
        if not out.new_token_ids:
            return
        if not req.first_token_ts:
            req.first_token_ts, req.first_token_latency = now, now - req.arrival_time
            stats.num_prompt_tokens += len(self.prompt_token_ids)
            stats.num_cached_prompt_tokens += out.num_cached_tokens
            stats.time_to_first_tokens_iter.append(req.first_token_latency)
        else:
            stats.inter_token_latencies_iter.append(now - req.last_token_ts)
        req.last_token_ts = now
        req.num_generation_tokens += len(out.new_token_ids)
        stats.num_generation_tokens += len(out.new_token_ids)

    def finished_stats(self, finish_reason: str, now: float) -> FinishedRequestStats:
        req = self.stats
        scheduled = req.scheduled_ts or now
        first_token = req.first_token_ts or scheduled  # none generated: no prefill phase, no decode phase
        last_token = req.last_token_ts if req.first_token_ts else scheduled
        decode_time = last_token - first_token
        num_tokens = len(self.token_ids)
        return FinishedRequestStats(
            finish_reason, now - req.arrival_time, max(scheduled - req.arrival_time, 0.0),
            len(self.prompt_token_ids), num_tokens, prefill_time=max(first_token - scheduled, 0.0),
            decode_time=decode_time, inference_time=max(last_token - scheduled, 0.0),
            mean_time_per_output_token=decode_time / (num_tokens - 1) if num_tokens > 1 else 0.0,
            num_preemptions=req.num_preemptions, num_cached_tokens=self.num_cached_tokens,
            max_tokens_param=self.params.max_tokens)

    def decode_token(self, token_id: int, context: list[int] = ()) -> Optional[str]:
        """A logprob's token as text: decoded alone, or, when that ends inside a character (byte-fallback tokens of
        a character split over several), with the tokens before it (``context``, the sequence's): the text it
        completes, or "" for a leading part (vLLM's _correct_decoded_token)."""
        if self.tokenizer is None:
            return None
        text = self.tokenizer.decode([token_id])
        return _completed_text(self.tokenizer, token_id, context) if text.endswith("\ufffd") else text

    def _logprob_dicts(self, lists, context: list[int]) -> list[dict[int, Logprob]]:
        """LogprobsLists rows → {token: Logprob}; column 0 is the chosen token with its true rank. ``context``: the
        sequence's tokens before the first row; each row's chosen token extends it for the next."""
        out = []
        context = list(context[-_MAX_CONTEXT_TOKENS:])
        for ids, lps, rank in zip(lists.logprob_token_ids, lists.logprobs, lists.sampled_token_ranks):
            entry = {ids[0]: Logprob(lps[0], rank, self.decode_token(ids[0], context))}
            for k, (tok, lp) in enumerate(zip(ids[1:], lps[1:]), 1):
                entry.setdefault(tok, Logprob(lp, k, self.decode_token(tok, context)))
            out.append(entry)
            context = (context + [ids[0]])[-_MAX_CONTEXT_TOKENS:]
        return out

    def update(self, out: EngineCoreOutput) -> tuple[Optional[FinishReason], Any]:
        """Folds one engine output in; returns (finish reason, stop reason), a stop string possibly found here. The
        tokens after the one completing a stop string (a step of accepted drafts brings several) are dropped from
        ``out`` with their logprobs, as vLLM trims them."""
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        if out.new_token_ids and not self.token_ids:  # the prompt ran: its prefix-cache hit is known (an abort's too)
            self.num_cached_tokens = out.num_cached_tokens
        if self.detokenizer is not None and out.new_token_ids:
            match = self.detokenizer.update(out.new_token_ids, stop_terminated=finish_reason == FinishReason.STOP)
            if match is not None:  # a stop string ends it, also in the step the engine ended it by length
                stop_str, num_kept = match
                finish_reason, stop_reason = FinishReason.STOP, stop_str
                del out.new_token_ids[num_kept:]
                if out.new_logprobs is not None:
                    out.new_logprobs = out.new_logprobs.first(num_kept)
        generated_before = len(self.token_ids)
        self.token_ids.extend(out.new_token_ids)
        if out.new_prompt_logprobs is not None and self.prompt_logprobs is not None:
            position = len(self.prompt_logprobs)  # of the first prompt token these rows score
            self.prompt_logprobs.extend(self._logprob_dicts(
                out.new_prompt_logprobs, self.prompt_token_ids[max(position - _MAX_CONTEXT_TOKENS, 0):position]))
        if out.new_logprobs is not None and self.logprobs is not None:
            # the last tokens before this step's (never the whole sequence: this runs every step)
            context = (self.prompt_token_ids[-_MAX_CONTEXT_TOKENS:]
                       + self.token_ids[max(generated_before - _MAX_CONTEXT_TOKENS, 0):generated_before])
            entries = self._logprob_dicts(out.new_logprobs, context)
            self.logprobs.extend(entries)
            for entry, tok in zip(entries, out.new_token_ids):
                self.cumulative_logprob += entry[tok].logprob
        return finish_reason, stop_reason

    def make_output(self, finish_reason: Optional[FinishReason], stop_reason: Any,
                    error: Optional[str], num_cached_tokens: int) -> Optional[RequestOutput]:
        finished = finish_reason is not None
        if not finished and (self.output_kind == RequestOutputKind.FINAL_ONLY or
                             len(self.token_ids) == self.num_sent_tokens):
            # Nothing to send yet: a prompt chunk's prompt logprobs wait for the first token, which carries them
            # all (as vLLM sends them once, complete); a stream's delta would otherwise repeat them per chunk.
            return None
        delta = self.output_kind == RequestOutputKind.DELTA
        if delta and not finished and 0 < self.num_sent_tokens and \
                len(self.token_ids) - self.num_sent_tokens < self.stream_interval:
            # vLLM's stream_interval, which holds back a stream's deltas only: the first token at once, then every
            # stream_interval tokens (a CUMULATIVE output comes every step, as vLLM's)
            return None
        text = self.detokenizer.get_next_output_text(finished, delta) if self.detokenizer else ""
        start = self.num_sent_tokens if delta else 0
        logprobs = self.logprobs[start:] if self.logprobs is not None else None
        completion = CompletionOutput(
            index=self.index, text=text, token_ids=self.token_ids[start:],
            cumulative_logprob=self.cumulative_logprob, logprobs=logprobs,
            finish_reason=str(finish_reason) if finished else None, stop_reason=stop_reason)
        prompt_logprobs = self.prompt_logprobs if not delta or self.num_sent_tokens == 0 else None
        self.num_sent_tokens = len(self.token_ids)
        return RequestOutput(self.external_req_id, self.prompt, self.prompt_token_ids, prompt_logprobs, [completion],
                             finished, num_cached_tokens=num_cached_tokens, error=error, metrics=self.stats,
                             lora_request=self.lora_request)


# The tokens before a logprob's token that can hold the first bytes of the character it completes (UTF-8: 4).
_MAX_CONTEXT_TOKENS = 4


def _completed_text(tokenizer: Any, token_id: int, context: list[int]) -> str:
    """The text ``token_id`` completes after ``context``: decoded with the fewest context tokens that end its
    character, less the text of the context tokens before the character's first bytes; "" when even four do not
    (a leading part of the character: its text goes with the token that completes it)."""
    for num_context in range(1, min(len(context), _MAX_CONTEXT_TOKENS) + 1):
        tail = context[len(context) - num_context:]
        decoded = tokenizer.decode(tail + [token_id])
        if decoded.endswith("\ufffd"):
            continue
        clean_end = len(tail)  # the context tokens before the ones holding the character's first bytes
        while clean_end > 0 and tokenizer.decode([tail[clean_end - 1]]).endswith("\ufffd"):
            clean_end -= 1
        prefix = tokenizer.decode(tail[:clean_end]) if clean_end else ""
        # what the character's tokens add (normalisation may change the prefix's text: their common part)
        return decoded[len(os.path.commonprefix([prefix, decoded])):]
    return ""


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    # Requests that a stop string ended here: the engine core must abort them.
    reqs_to_abort: list[str] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Any, log_stats: bool = False, stream_interval: int = 1) -> None:
        """``log_stats``: each request keeps its RequestStateStats (its outputs' metrics), which process_outputs'
        iteration stats are gathered from (pass those only then). ``stream_interval``: the engine's (vLLM's), the
        least number of tokens between a running request's DELTA outputs."""
        self.tokenizer = tokenizer
        self.log_stats = log_stats
        self.stream_interval = stream_interval
        self.request_states: dict[str, RequestState] = {}

    def add_requests(self, requests: list[EngineCoreRequest], prompt: Optional[str],
                     parent: Optional[ParentRequest] = None, queue: Optional[RequestOutputCollector] = None) -> None:
        """One request's engine requests (an n > 1 request's children, parallel_sampling.fan_out), all or none: an
        id already running (the front-ends' ids are unique, assign_request_id) refuses them before any is added, so
        that undoing the request never touches another's. ``queue``: where their outputs go (RequestState's)."""
        for request in requests:
            if request.request_id in self.request_states:
                of = f" (a sequence of request {parent.request_id!r})" if parent is not None else ""
                raise ValueError(f"Request id {request.request_id!r}{of} is already running.")
        for index, request in enumerate(requests):
            self.request_states[request.request_id] = RequestState(
                request.request_id, index, prompt, request.prompt_token_ids, request.sampling_params,
                self.tokenizer, parent, request.arrival_time, self.log_stats,
                max(request.sampling_params.stream_interval or 1, self.stream_interval), request.lora_request,
                request.external_req_id, queue)

    def abort_requests(self, request_ids: list[str], internal: bool = False) -> OutputProcessorOutput:
        """Ends the requests with finish_reason "abort". As vLLM's: each id is a caller's (external_req_id), which
        stands for every request added under it, or with ``internal`` an engine request's or an n > 1 request's own
        (which stands for all its sequences). Their last outputs go where all their outputs go (to a queue, an
        AsyncLLM consumer's stream ending with it, else returned), and reqs_to_abort has the engine requests ended,
        for the engine core to abort."""
        result = OutputProcessorOutput()
        for request_id in request_ids:
            for engine_request_id in self._engine_requests_of(request_id, internal):
                state = self.request_states.pop(engine_request_id)
                result.reqs_to_abort.append(engine_request_id)
                self._emit(state, state.make_output(FinishReason.ABORT, None, None, state.num_cached_tokens), result)
        return result

    def _engine_requests_of(self, request_id: str, internal: bool) -> list[str]:
        if not internal:
            return [engine_id for engine_id, state in self.request_states.items()
                    if state.external_req_id == request_id]
        if request_id in self.request_states:
            return [request_id]
        return [engine_id for engine_id, state in self.request_states.items()
                if state.parent is not None and state.parent.request_id == request_id]

    def propagate_error(self, error: BaseException, request_ids: Optional[list[str]] = None) -> int:
        """vLLM's: the error to the queue of each request (of those engine requests; None: of all), whose
        generate() raises it; returns how many queues (generate() calls) it went to."""
        states = map(self.request_states.get, request_ids) if request_ids is not None else self.request_states.values()
        queues = {id(state.queue): state.queue for state in states if state is not None and state.queue is not None}
        for queue in queues.values():
            queue.put(error)
        return len(queues)

    def get_num_unfinished_requests(self) -> int:
        """The engine requests still running here (an n > 1 request's sequences each), as vLLM's."""
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def unfinished_request_ids(self) -> list[str]:
        """The engine requests still running here (an n > 1 request's children each)."""
        return list(self.request_states)

    def process_outputs(self, engine_core_outputs: list[EngineCoreOutput],
                        iteration_stats: Optional[IterationStats] = None) -> OutputProcessorOutput:
        result = OutputProcessorOutput()
        now = time.time()
        for out in engine_core_outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue  # aborted by the client meanwhile
            if iteration_stats is not None:
                state.record_timing(out, now, iteration_stats)
            finish_reason, stop_reason = state.update(out)
            if finish_reason is not None:
                del self.request_states[out.request_id]
                if out.finish_reason is None:
                    result.reqs_to_abort.append(out.request_id)
                if iteration_stats is not None:
                    # A request that ended with an error (refused by the engine, or its grammar) is no success:
                    # vLLM counts its FINISHED_ERROR ones under finished_reason="error".
                    reason = "error" if out.error is not None else str(finish_reason)
                    iteration_stats.finished_requests.append(state.finished_stats(reason, now))
                    self._observe_sequence_finished(state, iteration_stats)
            self._emit(state, state.make_output(finish_reason, stop_reason, out.error, out.num_cached_tokens),
                       result)
        return result

    def process_engine_outputs(self, outputs: EngineCoreOutputs, stat_loggers: list) -> OutputProcessorOutput:
        """process_outputs for one batch from an engine core; then every stat logger records the batch's scheduler
        stats, and its iteration stats where it held request outputs: as vLLM's, a batch of none (a chunked
        prefill's step, the idle report after an abort) is no iteration, which would put a 0 in
        iteration_tokens_total. The engine's index is the keyword engine_idx, as vLLM's StatLoggerBase.record
        takes it (after its mm_cache_stats)."""
        iteration_stats = IterationStats() if stat_loggers and outputs.outputs else None
        processed = self.process_outputs(outputs.outputs, iteration_stats)
        for stat_logger in stat_loggers:
            stat_logger.record(outputs.scheduler_stats, iteration_stats, engine_idx=outputs.engine_index)
        return processed

    @staticmethod
    def _observe_sequence_finished(state: RequestState, stats: IterationStats) -> None:
        """A user request's n and its longest sequence, once its last sequence finishes (vLLM's
        request_params_n and request_max_num_generation_tokens)."""
        num_tokens = len(state.token_ids)
        if state.parent is not None:
            num_tokens = state.parent.observe_num_generation_tokens(num_tokens)
            if num_tokens is None:
                return
        stats.n_params_iter.append(state.parent.n if state.parent is not None else 1)
        stats.max_num_generation_tokens_iter.append(num_tokens)

    def _emit(self, state: RequestState, request_output: Optional[RequestOutput],
              result: OutputProcessorOutput) -> None:
        if request_output is not None and state.parent is not None:
            request_output = state.parent.add_child_output(
                request_output, state.output_kind == RequestOutputKind.FINAL_ONLY)
        if request_output is None:
            return
        if state.queue is not None:
            state.queue.put(request_output)
        else:
            result.request_outputs.append(request_output)

    def abort_all(self) -> OutputProcessorOutput:
        """Ends every request here with finish_reason "abort" (shutdown), as abort_requests does."""
        return self.abort_requests(list(self.request_states), internal=True)

    def abort_outputs(self) -> EngineCoreOutputs:
        """An "abort" output for each engine request here, as vLLM's engine core sends one for each request that
        sleep() or pause_generation() (mode "abort") ends: processed as any batch (process_engine_outputs), they end
        the requests' outputs and the stat loggers count them finished, finished_reason "abort", as vLLM's (where a
        caller's abort() is counted nowhere). The engine core still has to be told to abort them."""
        return EngineCoreOutputs(outputs=[EngineCoreOutput(request_id, [], finish_reason=FinishReason.ABORT,
                                                           num_cached_tokens=state.num_cached_tokens)
                                          for request_id, state in self.request_states.items()])
