"""OpenAIServing: what the chat and completion endpoints share — length checks, sampling parameters, starting
generation so early errors are HTTP errors, and the SSE framing of streams."""
from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Optional, TypeVar, Union

from pagedllm.entrypoints.logger import RequestLogger
from pagedllm.entrypoints.openai.errors import BadRequestError, to_openai_error
from pagedllm.entrypoints.openai.protocol import PromptLogprob, SamplingRequest, random_uuid
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.utils import peek
from pagedllm.outputs import Logprob, PromptLogprobs, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Logprobs of -inf have no JSON form; OpenAI clients get this floor instead, as from vLLM.
MIN_LOGPROB = -9999.0


def named_field(error: ValueError) -> str:
    """The request field a ValueError names first ("structured_outputs.json is invalid" -> structured_outputs,
    "structured_outputs: ..." -> structured_outputs)."""
    return str(error).split(" ", 1)[0].split(".", 1)[0].rstrip(":")


def sse(data: str) -> str:
    return f"data: {data}\n\n"


def sse_error(exc: Exception) -> str:
    """The last event of a stream that failed (a dead engine, a request the engine refused)."""
    return sse(to_openai_error(exc).to_response().model_dump_json())


def check_output(output: RequestOutput) -> None:
    if output.error is not None:
        raise BadRequestError(output.error)


class OpenAIServing:
    # The endpoint's name in the log line of its default sampling parameters.
    endpoint = "request"

    def __init__(self, engine_client: Any, models: OpenAIServingModels, *,
                 request_logger: Optional[RequestLogger] = None, enable_prompt_tokens_details: bool = False) -> None:
        """request_logger: logs each request as it is submitted (--enable-log-requests); None logs none.
        enable_prompt_tokens_details: usage reports the prompt tokens the prefix cache held (vLLM's flag)."""
        self.engine_client = engine_client
        self.models = models
        self.request_logger = request_logger
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.tokenizer = engine_client.tokenizer
        model_config = engine_client.model_config
        self.max_model_len = model_config.max_model_len
        # The generation config's defaults, for what a request leaves out (vLLM's default_sampling_params).
        self.default_sampling_params = model_config.get_diff_sampling_param()
        if self.default_sampling_params:
            source = "model" if model_config.generation_config == "auto" else model_config.generation_config
            logger.info("Using default %s sampling params from %s: %s", self.endpoint, source,
                        self.default_sampling_params)

    def _cached_tokens(self, num_cached_tokens: int, always: bool = False) -> Optional[int]:
        """The cached prompt tokens a usage reports, 0 included: None (not reported) without
        --enable-prompt-tokens-details (vLLM's), unless ``always`` (the Responses API reports them whatever the
        flag)."""
        return num_cached_tokens if always or self.enable_prompt_tokens_details else None

    def _truncated(self, request: SamplingRequest, token_ids: list[int]) -> list[int]:
        """The prompt's tokens cut to truncate_prompt_tokens (vLLM's): the last ones, or with truncation_side
        "right" the first; -1 means max_model_len - 1, the most that leaves room for a token of output (vLLM's
        max_truncation_tokens). More than max_model_len is a 400."""
        limit = request.truncate_prompt_tokens
        if limit is None:
            return token_ids
        if limit == -1:
            limit = self.max_model_len - 1
        if limit > self.max_model_len:
            raise BadRequestError(f"truncate_prompt_tokens={limit} cannot be greater than max_model_len="
                                  f"{self.max_model_len}. Please request a smaller truncation size.",
                                  "truncate_prompt_tokens")
        if request.truncation_side == "right":
            return token_ids[:limit]
        return token_ids[max(len(token_ids) - limit, 0):]

    def _max_tokens(self, num_prompt_tokens: int, max_tokens: Optional[int], prompt_param: str,
                    max_tokens_param: str = "max_tokens") -> int:
        """The completion budget: what was asked for, or by default the generation config's max_tokens, at most the
        rest of the context (all of it when there is none), as vLLM 0.32's get_max_tokens. 400 for a prompt that
        leaves no room, and (as vLLM's TokenizeParams) for a budget asked for past max_model_len, which no prompt
        leaves room for; one past only what the prompt leaves is cut to it."""
        if max_tokens is not None and max_tokens > self.max_model_len:
            raise BadRequestError(f"{max_tokens_param}={max_tokens} cannot be greater than max_model_len="
                                  f"{self.max_model_len}. Please request fewer output tokens.", max_tokens_param)
        if num_prompt_tokens >= self.max_model_len:  # vLLM's text (its renderer's), and for a prompt that fills it
            why = ("exceeds this limit even without any output tokens" if num_prompt_tokens > self.max_model_len
                   else "leaves no room for any output tokens")
            raise BadRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt contains "
                f"{num_prompt_tokens} input tokens, which {why}. Please reduce the length of the input prompt.",
                prompt_param)
        if max_tokens is None:
            max_tokens = self.default_sampling_params.get("max_tokens", self.max_model_len)
        return min(max_tokens, self.max_model_len - num_prompt_tokens)

    def _sampling_params(self, request: SamplingRequest, max_tokens: int, **kwargs
                         ) -> Union[SamplingParams, BeamSearchParams]:
        try:
            request.check_stream_options()
            if request.use_beam_search:
                if kwargs.get("tool_call_constraint") is not None:
                    raise ValueError("tool_choice 'required' or a named function is not supported with "
                                     "use_beam_search.")
                return request.to_beam_search_params(max_tokens, self.default_sampling_params,
                                                     self.engine_client.processor.max_logprobs)
            return request.to_sampling_params(max_tokens, self.default_sampling_params, **kwargs)
        except ValueError as e:
            raise BadRequestError(str(e), named_field(e)) from e

    @staticmethod
    def _request_id(prefix: str, request: SamplingRequest) -> str:
        """The response's id: the client's (X-Request-Id or request_id, as vLLM's _base_request_id) or a random one."""
        return f"{prefix}-{request.request_id or random_uuid()}"

    def _generate(self, prompt: dict, params: Union[SamplingParams, BeamSearchParams], request_id: str,
                  priority: int, model: Optional[str]) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for one prompt, with the LoRA adapter ``model`` names (if it names one). Beam
        search yields one final output holding the n beams, best first, so a stream carries each choice whole in
        one chunk (as vLLM streams beam search). Clients may send the same X-Request-Id at once: the engine runs
        each request under a unique id of its own (assign_request_id)."""
        lora_request = self.models.lora_request(model)
        if self.request_logger is not None:  # a chat prompt's text is its template's output, as vLLM logs it
            ids = prompt["prompt_token_ids"]
            text = prompt.get("prompt") or self.tokenizer.decode(ids)
            self.request_logger.log_inputs(request_id, text, ids, params, lora_request)
        if isinstance(params, BeamSearchParams):
            results = self.engine_client.beam_search(prompt, request_id, params, priority, lora_request)
        else:
            results = self.engine_client.generate(prompt, params, request_id, priority=priority,
                                                  lora_request=lora_request)
        if self.request_logger is not None and self.request_logger.log_outputs:
            return self.request_logger.outputs_logged(request_id, results)
        return results

    @staticmethod
    async def _start(results: AsyncIterator[T], request: SamplingRequest, prompt_param: str) -> AsyncIterator[T]:
        try:
            return await peek(results)
        except ValueError as e:  # the engine's Processor rejected the prompt or a sampling parameter it checks
            if named_field(e) not in SamplingParams.__struct_fields__:
                raise BadRequestError(str(e), prompt_param) from e
            error = request.rename_error(e)
            raise BadRequestError(str(error), named_field(error)) from e

    def _token_str(self, token_id: int, logprob: Optional[Logprob], as_id: Optional[bool] = False) -> str:
        """A logprob's token as text, or ``as_id`` (vLLM's return_tokens_as_token_ids) "token_id:<id>"."""
        if as_id:
            return f"token_id:{token_id}"
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id])

    @staticmethod
    def _prompt_logprobs(prompt_logprobs: Optional[PromptLogprobs]) -> Optional[list]:
        if prompt_logprobs is None:
            return None
        return [None if step is None else
                {token_id: PromptLogprob(logprob=max(lp.logprob, MIN_LOGPROB), rank=lp.rank,
                                         decoded_token=lp.decoded_token) for token_id, lp in step.items()}
                for step in prompt_logprobs]
