"""LLM: the offline API, as vLLM users know it — generate(), chat(), beam_search(), reset_prefix_cache(); its pooling
API (encode(), embed(), classify(), score()) refuses as vLLM's does for a generative model."""
from __future__ import annotations

import itertools
import logging
import os
from typing import Any, Callable, Iterable, NoReturn, Optional, Sequence, Union

import msgspec
import torch
from tqdm.auto import tqdm

from pagedllm.beam_search import BeamSearchInstance, BeamSearchOutput
from pagedllm.config import check_optional_dict
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.exceptions import not_a_pooling_model
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.processor import cache_salt_of
from pagedllm.gc_utils import gc_paused
from pagedllm.entrypoints.openai.chat_utils import (conversation, load_chat_template,
                                                   resolve_chat_template_content_format, template_variables)
from pagedllm.entrypoints.openai.protocol import ChatMessageParam
from pagedllm.inputs import PromptType
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics.reader import Metric
from pagedllm.models.resolve import DEFAULT_MODEL
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

Conversation = list[dict[str, Any]]
# Whether to show a progress bar, or the tqdm-like callable that makes it (vLLM's use_tqdm).
UseTqdm = Union[bool, Callable[..., tqdm]]


class LLM:
    """Generates text for a batch of prompts with continuous batching and a paged KV cache.

    Keyword arguments are EngineArgs fields: dtype, max_model_len, max_num_seqs, max_num_batched_tokens,
    block_size, enable_prefix_caching, kv_cache_memory (bytes or "2GiB"), kv_cache_dtype, seed, scheduling_policy, ...
    """

    def __init__(self, model: str = DEFAULT_MODEL, *, disable_log_stats: bool = True,
                 chat_template: Optional[Union[str, os.PathLike]] = None, **kwargs: Any) -> None:
        """``disable_log_stats=False`` (vLLM's, off by default offline) keeps the engine's metrics for
        get_metrics(), and logs the server's stats line every PAGEDLLM_LOG_STATS_INTERVAL seconds while it runs.
        ``chat_template`` (vLLM's): the Jinja template, or a file (its path, or a path object) holding it, that
        chat() renders with when a call gives none (else the tokenizer's); read, and a bad one refused, before the
        engine starts."""
        self.chat_template = load_chat_template(chat_template)
        # The engine stops with it (LLMEngine.shutdown): on shutdown(), when it is garbage-collected (with this
        # object, unless kept elsewhere), or at the interpreter's exit.
        with gc_paused():  # a model built in this process is a start-up heap too (gc_utils.py)
            self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, disable_log_stats=disable_log_stats,
                                                                    **kwargs))
        self.tokenizer = self.llm_engine.tokenizer
        self.model_config = self.llm_engine.model_config  # vLLM's
        # vLLM's: the tasks the model serves and the runner it runs under ("generate" here, always).
        self.supported_tasks = self.llm_engine.get_supported_tasks()
        self.runner_type = self.model_config.runner_type
        self._request_counter = itertools.count()
        self._model_repr: Optional[str] = None  # __repr__'s, once asked
        # enqueue()'s requests, in their order, until wait_for_completion returns them: each one's output once
        # finished (None until then).
        self._enqueued: dict[str, Optional[RequestOutput]] = {}
        # The generation config's defaults (ModelConfig.get_diff_sampling_param), read once, as vLLM's LLM.
        self.default_sampling_params = self.llm_engine.config.model_config.get_diff_sampling_param()
        if self.default_sampling_params:
            logger.info("Using default sampling params from the generation config: %s",
                        self.default_sampling_params)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLM":
        """vLLM's: the LLM that ``engine_args`` configure."""
        return cls(**vars(engine_args))

    def get_tokenizer(self) -> Any:
        """vLLM's: the model's tokenizer; with skip_tokenizer_init, which loads none, a ValueError (vLLM's)."""
        return self.llm_engine.get_tokenizer()

    def get_world_size(self, include_dp: bool = True) -> int:
        """vLLM's: the engine's ranks, tensor x pipeline parallel, times data_parallel_size with ``include_dp``."""
        pc = self.llm_engine.config.parallel_config
        return pc.world_size * (pc.data_parallel_size if include_dp else 1)

    def reset_mm_cache(self) -> None:
        """vLLM's: empties the multi-modal caches; this engine's models take text only, so there are none (vLLM's
        call on a text-only model does nothing either)."""

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() sample with when given no sampling_params: the model's generation config's
        values over SamplingParams' defaults (these alone with generation_config="vllm")."""
        return SamplingParams(**self.default_sampling_params)

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
                 use_tqdm: UseTqdm = True, priority: Optional[Union[int, Sequence[int]]] = None,
                 lora_request: Optional[Union[LoRARequest, Sequence[Optional[LoRARequest]]]] = None,
                 tokenization_kwargs: Optional[dict[str, Any]] = None,
                 mm_processor_kwargs: Optional[dict[str, Any]] = None) -> list[RequestOutput]:
        """Outputs come back in the order of the prompts, whatever order they finish in. ``lora_request`` and
        ``priority``: one for every prompt, or one per prompt (as vLLM's; None: the base model, priority 0).
        ``use_tqdm``: a progress bar, or none (False), or one made by this tqdm-like callable (vLLM's: say,
        ``functools.partial(tqdm, leave=False)``), called with its total, desc and dynamic_ncols. Requests
        enqueue() left waiting run too; their outputs wait for wait_for_completion(). vLLM's
        ``tokenization_kwargs`` go to the tokenizer for text prompts (e.g. truncation with max_length);
        ``mm_processor_kwargs`` (a multi-modal processor's) have nothing to act on with a text-only model. While the
        engine sleeps, no prompts (and no request left in it) is vLLM's ``[]``; prompts are a RuntimeError."""
        prompts = _prompt_to_seq(prompts)
        self._check_awake(unless_engine_idle=not prompts)
        return self._run_engine(self._add_requests(prompts, sampling_params, priority, lora_request,
                                                   tokenization_kwargs=tokenization_kwargs,
                                                   mm_processor_kwargs=mm_processor_kwargs), use_tqdm)

    def enqueue(self, prompts: Union[PromptType, Sequence[PromptType]],
                sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
                lora_request: Optional[Union[LoRARequest, Sequence[Optional[LoRARequest]]]] = None,
                priority: Optional[Union[int, Sequence[int]]] = None, use_tqdm: UseTqdm = True,
                tokenization_kwargs: Optional[dict[str, Any]] = None,
                mm_processor_kwargs: Optional[dict[str, Any]] = None) -> list[str]:
        """vLLM's: queues the prompts' requests (checked as generate() checks them) without running them; their
        request ids. wait_for_completion() runs them and returns their outputs. ``use_tqdm``: a progress bar while
        they are rendered, as generate()'s. As vLLM's, the engine may be asleep meanwhile: ``sleep(level=0)``
        first, then ``wake_up(tags=["scheduling"])``, so that no request starts before all are queued.
        ``tokenization_kwargs`` and ``mm_processor_kwargs``: generate()'s."""
        request_ids = self._add_requests(prompts, sampling_params, priority, lora_request, use_tqdm,
                                         tokenization_kwargs, mm_processor_kwargs)
        self._enqueued.update(dict.fromkeys(request_ids))
        return request_ids

    def wait_for_completion(self, output_type: Optional[Union[type, tuple[type, ...]]] = None, *,
                            use_tqdm: UseTqdm = True) -> list[RequestOutput]:
        """vLLM's: runs the requests enqueue() queued until all have finished; their outputs, in the order they were
        queued (vLLM's, by request id). ``output_type``: the outputs' type(s) the caller expects, as vLLM's; this
        engine's are RequestOutput (it runs no pooling models), so one that does not take them is a ValueError. As
        vLLM's, the engine may be asleep if it holds none of them: those ``sleep(mode="wait")`` ran to their end (or
        ``sleep()`` aborted) are returned."""
        if output_type is not None and not _is_subclass(RequestOutput, output_type):
            raise ValueError(f"output_type must be RequestOutput (or a tuple of types holding it), the outputs of "
                             f"this engine; got {output_type!r}")
        self._check_awake(unless_engine_idle=True)
        request_ids = list(self._enqueued)
        outputs = self._run_engine(request_ids, use_tqdm)
        for request_id in request_ids:
            del self._enqueued[request_id]
        return outputs

    def _add_requests(self, prompts: Union[PromptType, Sequence[PromptType]],
                      sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]],
                      priority: Optional[Union[int, Sequence[int]]],
                      lora_request: Optional[Union[LoRARequest, Sequence[Optional[LoRARequest]]]],
                      use_tqdm: UseTqdm = False, tokenization_kwargs: Optional[dict[str, Any]] = None,
                      mm_processor_kwargs: Optional[dict[str, Any]] = None) -> list[str]:
        """Queues the prompts' requests, all checked first: bad input leaves none behind; their ids."""
        check_optional_dict("mm_processor_kwargs", mm_processor_kwargs)
        prompts = _prompt_to_seq(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        # Only each request's last output is returned: asked for alone (FINAL_ONLY, as vLLM's LLM sets it), on a copy
        # so that the caller's params keep their output_kind for other uses.
        params_list = [msgspec.structs.replace(params, output_kind=RequestOutputKind.FINAL_ONLY) for params in
                       _one_per_prompt("sampling_params", sampling_params, SamplingParams, len(prompts))]
        priorities = _one_per_prompt("priority", 0 if priority is None else priority, int, len(prompts))
        lora_requests = _one_per_prompt("lora_request", lora_request, (LoRARequest, type(None)), len(prompts))
        processed = [self.llm_engine.processor.process(str(next(self._request_counter)), prompt, params,
                                                       priority=priorities[i], lora_request=lora_requests[i],
                                                       tokenization_kwargs=tokenization_kwargs)
                     for i, (prompt, params) in enumerate(_maybe_tqdm(zip(prompts, params_list), use_tqdm,
                                                                      "Rendering prompts", len(prompts)))]
        try:
            for text, request in processed:
                self.llm_engine.add_processed_request(text, request)
        except BaseException:
            self._abort_all()
            raise
        return [request.request_id for _, request in processed]

    def _check_awake(self, unless_engine_idle: bool = False) -> None:
        """generate() and wait_for_completion() run the engine until their requests finish: asleep, nothing would
        run until wake_up, and vLLM's loop would wait for ever. ``unless_engine_idle``: an engine holding no request
        has sent every output (those of the requests sleep(mode="wait") finished): the loop only collects them."""
        if self.llm_engine.asleep and not (unless_engine_idle and self._engine_holds_no_request()):
            raise RuntimeError("The engine is asleep (sleep()); call wake_up() before generating.")

    def _engine_holds_no_request(self) -> bool:
        stats = self.llm_engine.get_stats()
        return stats.num_running_reqs + stats.num_waiting_reqs + stats.num_skipped_waiting_reqs == 0

    def _abort_all(self) -> None:
        """After Ctrl-C or a dead engine: no request runs on, or waits in the next call (those enqueued neither)."""
        self.llm_engine.abort_request(self.llm_engine.output_processor.unfinished_request_ids(), internal=True)
        self._enqueued.clear()

    def chat(self, messages: Union[Conversation, list[Conversation]],
             sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
             use_tqdm: UseTqdm = True,
             lora_request: Optional[Union[LoRARequest, Sequence[Optional[LoRARequest]]]] = None,
             priority: Optional[Union[int, Sequence[int]]] = None, chat_template: Optional[str] = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: Optional[list[dict[str, Any]]] = None,
             chat_template_kwargs: Optional[dict[str, Any]] = None,
             tokenization_kwargs: Optional[dict[str, Any]] = None,
             mm_processor_kwargs: Optional[dict[str, Any]] = None) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation or a list of them, then generates; as vLLM's, with
        its arguments in its order, ``tools`` (OpenAI's function shape) and ``chat_template_kwargs`` (e.g. Qwen3's
        ``enable_thinking``) go to the template, and each output's ``prompt`` is the rendered text. Continuing the
        last message (``continue_final_message``) needs ``add_generation_prompt=False``: asking for both is a
        ValueError, as vLLM's (transformers refuses them together). Messages are read as the server reads them
        (chat_utils.conversation): content given as OpenAI's list of parts is their text, joined by newlines, or with
        ``chat_template_content_format`` "openai" (with "auto", the default, for templates that loop over a
        message's content) the list of its text parts. The arguments given here override ``chat_template_kwargs``
        (those given as None do not), as vLLM's merge_kwargs. ``tokenization_kwargs`` (vLLM's) go to the tokenizer
        for the rendered text, over vLLM's add_special_tokens=False (the template writes its own); generate()'s
        ``mm_processor_kwargs``."""
        return self._chat(messages, sampling_params, use_tqdm, lora_request, priority, chat_template,
                          chat_template_content_format, add_generation_prompt, continue_final_message, tools,
                          chat_template_kwargs, tokenization_kwargs, mm_processor_kwargs, enqueue=False)

    def enqueue_chat(self, messages: Union[Conversation, list[Conversation]],
                     sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
                     use_tqdm: UseTqdm = True,
                     lora_request: Optional[Union[LoRARequest, Sequence[Optional[LoRARequest]]]] = None,
                     priority: Optional[Union[int, Sequence[int]]] = None, chat_template: Optional[str] = None,
                     chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
                     continue_final_message: bool = False, tools: Optional[list[dict[str, Any]]] = None,
                     chat_template_kwargs: Optional[dict[str, Any]] = None,
                     tokenization_kwargs: Optional[dict[str, Any]] = None,
                     mm_processor_kwargs: Optional[dict[str, Any]] = None) -> list[str]:
        """vLLM's: the conversations rendered as chat() renders them, their requests queued as enqueue() queues
        prompts; their request ids, for wait_for_completion(). ``use_tqdm``: a progress bar while they render;
        ``tokenization_kwargs`` and ``mm_processor_kwargs``: chat()'s."""
        return self._chat(messages, sampling_params, use_tqdm, lora_request, priority, chat_template,
                          chat_template_content_format, add_generation_prompt, continue_final_message, tools,
                          chat_template_kwargs, tokenization_kwargs, mm_processor_kwargs, enqueue=True)

    def _chat(self, messages: Union[Conversation, list[Conversation]],
              sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]], use_tqdm: UseTqdm,
              lora_request: Optional[Union[LoRARequest, Sequence[Optional[LoRARequest]]]],
              priority: Optional[Union[int, Sequence[int]]], chat_template: Optional[str],
              chat_template_content_format: str, add_generation_prompt: bool, continue_final_message: bool,
              tools: Optional[list[dict[str, Any]]], chat_template_kwargs: Optional[dict[str, Any]],
              tokenization_kwargs: Optional[dict[str, Any]], mm_processor_kwargs: Optional[dict[str, Any]], *,
              enqueue: bool) -> Union[list[RequestOutput], list[str]]:
        """chat() and enqueue_chat(), whose arguments (the same, vLLM's, in its order) come here alike: each
        conversation rendered (its text, then its token ids), then the prompts run as generate() runs them, or with
        ``enqueue`` queued as enqueue() queues them. ``use_tqdm``'s bar is chat()'s of the requests finishing and
        enqueue_chat()'s of the conversations rendering (it runs nothing), as vLLM's."""
        check_optional_dict("tokenization_kwargs", tokenization_kwargs)
        tokenizer = self.get_tokenizer()
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        explicit = {"chat_template": self.chat_template if chat_template is None else chat_template, "tools": tools,
                    "continue_final_message": continue_final_message, "add_generation_prompt": add_generation_prompt}
        template_args = template_variables(chat_template_kwargs)
        template_args.update((k, v) for k, v in explicit.items() if v is not None)
        if template_args.get("continue_final_message") and template_args.get("add_generation_prompt"):
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true; pass "
                             "add_generation_prompt=False to continue the final message.")
        content_format = resolve_chat_template_content_format(tokenizer, template_args.get("chat_template"),
                                                              template_args.get("tools"), chat_template_content_format)
        prompts = []
        for turns in _maybe_tqdm(conversations, use_tqdm if enqueue else False, "Rendering conversations",
                                 len(conversations)):
            turns = conversation([ChatMessageParam.model_validate(m) for m in turns], content_format)
            # Rendered once, then tokenized without special tokens (the template writes its own) unless
            # tokenization_kwargs say, as vLLM's _preprocess_chat: by default the ids transformers'
            # apply_chat_template(tokenize=True) gives, with one rendering.
            text = tokenizer.apply_chat_template(turns, tokenize=False, **template_args)
            token_ids = tokenizer.encode(text, **{"add_special_tokens": False, **(tokenization_kwargs or {})})
            prompts.append({"prompt": text, "prompt_token_ids": token_ids})
        if enqueue:
            return self.enqueue(prompts, sampling_params, lora_request, priority, use_tqdm=False,
                                mm_processor_kwargs=mm_processor_kwargs)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, priority=priority,
                             lora_request=lora_request, mm_processor_kwargs=mm_processor_kwargs)

    def beam_search(self, prompts: Union[PromptType, Sequence[PromptType]], params: BeamSearchParams,
                    lora_request: Optional[Union[LoRARequest, Sequence[Optional[LoRARequest]]]] = None,
                    use_tqdm: bool = False, concurrency_limit: Optional[int] = None) -> list[BeamSearchOutput]:
        """vLLM's frontend beam search (see pagedllm.beam_search): each step runs every live beam of the prompts
        searched together as one batch of one-token requests. Outputs come back in the order of the prompts.
        ``lora_request``: one adapter for every prompt, or one per prompt (None: the base model);
        ``concurrency_limit``: how many prompts are searched together (None: all)."""
        tokenizer = self.get_tokenizer()  # the beams' text
        prompts = _prompt_to_seq(prompts)
        lora_requests = _one_per_prompt("lora_request", lora_request, (LoRARequest, type(None)), len(prompts))
        if concurrency_limit is not None and (not isinstance(concurrency_limit, int) or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit must be a positive integer, got {concurrency_limit!r}.")
        processor = self.llm_engine.processor
        params.verify_width(processor.max_logprobs)
        instances = []
        for prompt in prompts:
            token_ids = processor.tokenize(prompt)[1]
            processor.validate_prompt(token_ids)
            if len(token_ids) + params.max_tokens > processor.model_config.max_model_len:
                raise ValueError(f"max_tokens must fit in max_model_len={processor.model_config.max_model_len} "
                                 f"after the prompt's {len(token_ids)} tokens, got {params.max_tokens}.")
            instances.append(BeamSearchInstance(token_ids, params, processor.eos_token_id, cache_salt_of(prompt)))
        step_params = params.step_sampling_params()
        together = concurrency_limit or max(len(instances), 1)
        for start in range(0, len(instances), together):
            group = list(zip(instances[start:start + together], lora_requests[start:start + together]))
            for _ in tqdm(range(params.max_tokens), desc="Beam search steps", disable=not use_tqdm):
                live = [(instance, lora) for instance, lora in group if not instance.finished]
                if not live:
                    break
                beams = [(instance.step_prompt(beam), lora) for instance, lora in live for beam in instance.beams]
                outputs = self.generate([prompt for prompt, _ in beams], step_params, use_tqdm=False,
                                        lora_request=[lora for _, lora in beams])
                for instance, _ in live:
                    num_beams = len(instance.beams)
                    instance.step(outputs[:num_beams])
                    outputs = outputs[num_beams:]
        return [instance.output(tokenizer) for instance in instances]

    def encode(self, prompts: Union[PromptType, Sequence[PromptType]], pooling_params: Any = None, *,
               use_tqdm: UseTqdm = True,
               lora_request: Optional[Union[LoRARequest, Sequence[Optional[LoRARequest]]]] = None,
               pooling_task: Optional[str] = None, tokenization_kwargs: Optional[dict[str, Any]] = None) -> NoReturn:
        """vLLM's pooling API, with its arguments: pooled hidden states need a pooling model, and every model here
        generates (runner_type), so this is the ValueError vLLM's encode() raises for a generative model, after the
        one check vLLM's makes first (a plugin's ``data`` prompt given for another pooling task). embed() and
        classify() are encode() with their pooling task, as vLLM's."""
        if isinstance(prompts, dict) and "data" in prompts and pooling_task != "plugin":
            raise ValueError("The 'data' field is only supported for the 'plugin' pooling task.")
        raise _not_a_pooling_model("encode")

    def embed(self, prompts: Union[PromptType, Sequence[PromptType]], *, use_tqdm: UseTqdm = True,
              pooling_params: Any = None,
              lora_request: Optional[Union[LoRARequest, Sequence[Optional[LoRARequest]]]] = None,
              tokenization_kwargs: Optional[dict[str, Any]] = None) -> NoReturn:
        """vLLM's: encode() with pooling_task "embed" (so encode()'s ValueError)."""
        self.encode(prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request, pooling_task="embed",
                    tokenization_kwargs=tokenization_kwargs)

    def classify(self, prompts: Union[PromptType, Sequence[PromptType]], *, pooling_params: Any = None,
                 use_tqdm: UseTqdm = True,
                 lora_request: Optional[Union[LoRARequest, Sequence[Optional[LoRARequest]]]] = None,
                 tokenization_kwargs: Optional[dict[str, Any]] = None) -> NoReturn:
        """vLLM's: encode() with pooling_task "classify" (so encode()'s ValueError)."""
        self.encode(prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request, pooling_task="classify",
                    tokenization_kwargs=tokenization_kwargs)

    def score(self, data_1: Any, data_2: Any, /, *, use_tqdm: UseTqdm = True, pooling_params: Any = None,
              lora_request: Optional[Union[LoRARequest, Sequence[Optional[LoRARequest]]]] = None,
              tokenization_kwargs: Optional[dict[str, Any]] = None, chat_template: Optional[str] = None) -> NoReturn:
        """vLLM's, with its arguments: scores need a pooling model (an embedding or a cross-encoder one), so this is
        the ValueError vLLM's raises first for a generative model."""
        raise _not_a_pooling_model("score")

    def _run_engine(self, request_ids: list[str], use_tqdm: UseTqdm) -> list[RequestOutput]:
        """Steps until every request has finished; the outputs of ``request_ids``, in their order. Those of
        enqueue()'s other requests are kept for wait_for_completion."""
        try:
            return self._run_until_finished(request_ids, use_tqdm)
        except BaseException:  # Ctrl-C, a dead engine
            self._abort_all()
            raise

    def _run_until_finished(self, request_ids: list[str], use_tqdm: UseTqdm) -> list[RequestOutput]:
        finished = {r: self._enqueued[r] for r in request_ids if self._enqueued.get(r) is not None}
        wanted = set(request_ids)
        progress = None
        if use_tqdm:
            make_progress = use_tqdm if callable(use_tqdm) else tqdm
            progress = make_progress(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
            progress.update(len(finished))
        engine = self.llm_engine
        while engine.has_unfinished_requests():
            for output in engine.step():
                if not output.finished:
                    continue
                if output.request_id in wanted:
                    finished[output.request_id] = output
                    if progress is not None:
                        progress.update(1)
                elif output.request_id in self._enqueued:
                    self._enqueued[output.request_id] = output
        if progress is not None:
            progress.close()
        return [finished[r] for r in request_ids]

    def collective_rpc(self, method: Union[str, Callable[..., Any]], timeout: Optional[float] = None,
                       args: tuple = (), kwargs: Optional[dict[str, Any]] = None) -> list[Any]:
        """vLLM's: runs ``method`` on every worker and returns their results in rank order. ``method``: a method of
        pagedllm's Worker by name, or a function called with the worker as its first argument, then ``args`` and
        ``kwargs`` (sent with cloudpickle to an engine or workers in other processes, so a lambda or a closure will
        do). A method that raises fails the call with a RuntimeError naming it, the rank and its exception; the
        engine serves on. ``timeout``: seconds to wait for worker processes (None: as long as they take), after
        which the call fails with a TimeoutError (the method runs on; later calls wait for it)."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def apply_model(self, func: Callable[[torch.nn.Module], Any]) -> list[Any]:
        """vLLM's: ``func`` called with each worker's model (its slice, with tensor or pipeline parallelism); the
        results in rank order. Return small things: they are pickled to this process."""
        return self.llm_engine.apply_model(func)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's: puts the engine to sleep until wake_up(). Level 0 only stops scheduling; levels 1 and 2 also drop
        the KV cache, its memory given back and its contents forgotten (on the CPU the weights, in host memory
        already, stay: vLLM's level 1 offloads them there). ``mode``: "abort" ends requests in flight, "wait"
        sleeps once they have finished (their outputs for wait_for_completion after wake_up; as vLLM's, only with the
        engine in a process of its own), "keep" keeps them for after wake_up. generate() and chat() while asleep
        raise."""
        self.llm_engine.sleep(level, mode)

    def release_kv_cache_memory(self) -> None:
        """vLLM's: after ``sleep(level=0)``, gives back the KV cache's memory as ``sleep(level=1)`` does (requests kept
        are recomputed after); ``wake_up(tags=["kv_cache"])`` makes it anew. Not paused first, a RuntimeError."""
        self.llm_engine.release_kv_cache_memory()

    def wake_up(self, tags: Optional[list[str]] = None) -> bool:
        """vLLM's: wakes the engine (``tags`` None), or part of it: of "weights", "kv_cache" (made anew, empty) and
        "scheduling". Returns whether it is fully awake, as it must be to generate."""
        return self.llm_engine.wake_up(tags)

    def start_profile(self, profile_prefix: Optional[str] = None, *, delay_iterations: Optional[int] = None,
                      max_iterations: Optional[int] = None) -> None:
        """vLLM's: every worker starts tracing with torch's profiler, as the engine's ``profiler_config`` says
        (``LLM(profiler_config={"profiler": "torch", "torch_profiler_dir": DIR})``; without, a RuntimeError);
        stop_profile() writes one trace per rank to that directory, its name beginning with ``profile_prefix``.
        vLLM's ``delay_iterations`` and ``max_iterations``: None or 0 only (config.check_profile_iterations)."""
        self.llm_engine.start_profile(profile_prefix, delay_iterations=delay_iterations,
                                      max_iterations=max_iterations)

    def stop_profile(self) -> None:
        self.llm_engine.stop_profile()

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Empties the prefix cache (refused, returning False, while requests hold blocks; with
        ``reset_running_requests``, vLLM's, the running ones are preempted first). ``reset_connector``, vLLM's, resets
        its KV connector's cache too: pagedllm has no connector, so there is nothing more to reset (vLLM's answer
        without one)."""
        return self.llm_engine.reset_prefix_cache(reset_running_requests, reset_connector)

    def get_metrics(self) -> list[Metric]:
        """vLLM's: a snapshot of the engine's Prometheus metrics (the server's /metrics, ``pagedllm:`` names; see
        pagedllm/metrics/reader.py). Needs ``LLM(disable_log_stats=False)``."""
        return self.llm_engine.get_metrics()

    def get_stats(self):
        """Scheduler statistics: running/waiting requests, KV usage, prefix-cache and preemption totals."""
        return self.llm_engine.get_stats()

    def shutdown(self) -> None:
        """Stops the engine process (also done when this object is garbage-collected, or the interpreter exits)."""
        self.llm_engine.shutdown()

    def __repr__(self) -> str:
        """vLLM's: the model's module tree (its first worker's, as torch prints it: each layer's settings, a run of
        identical layers once), asked of the engine the first time and kept, since it never changes."""
        if self._model_repr is None:
            self._model_repr = self.apply_model(repr)[0]
        return self._model_repr


def _not_a_pooling_model(method: str) -> ValueError:
    """vLLM's LLM.<method>() error for its pooling API on a generative model."""
    return not_a_pooling_model(f"LLM.{method}() is only supported for pooling models.")


def _prompt_to_seq(prompts: Union[PromptType, Sequence[PromptType]]) -> list[PromptType]:
    """One prompt (text, a dict, or a non-empty list of token ids) as a batch of one, else the prompts, as vLLM's
    prompt_to_seq: ``[1, 2, 3]`` is one prompt of three tokens, ``[[1, 2], [3]]`` two prompts."""
    if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)):
        return [prompts]
    return list(prompts)


def _maybe_tqdm(items: Iterable, use_tqdm: UseTqdm, desc: str, total: int) -> Iterable:
    """``items``, through a progress bar unless ``use_tqdm`` is False (vLLM's maybe_tqdm)."""
    if not use_tqdm:
        return items
    make_progress = use_tqdm if callable(use_tqdm) else tqdm
    return make_progress(items, desc=desc, total=total, dynamic_ncols=True)


def _is_subclass(cls: type, types: Any) -> bool:
    """issubclass, False (not a TypeError) where ``types`` is not a type or a tuple of types."""
    try:
        return issubclass(cls, types)
    except TypeError:
        return False


def _one_per_prompt(name: str, value, single: type | tuple[type, ...], num_prompts: int) -> list:
    """``value`` for every prompt when it is one (an instance of ``single``), else its items, one per prompt."""
    if isinstance(value, single):
        return [value] * num_prompts
    values = list(value)
    if len(values) != num_prompts:
        raise ValueError(f"{name}: got {len(values)} for {num_prompts} prompts; pass one, or one per prompt.")
    return values
