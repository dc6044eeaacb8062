"""Pydantic models of the OpenAI-compatible API, with vLLM's extra sampling fields and shapes.

Requests check only types here; parameter values are checked once, by SamplingParams. Its ValueError starts
with the field's name; to_sampling_params renames it to the request's own field, so a 400 can name it.
"""
from __future__ import annotations

import json
import os
import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_serializer, model_validator

from pagedllm.engine.processor import validate_cache_salt
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from pagedllm.entrypoints.openai.tool_protocol import (ChatCompletionToolsParam, DeltaToolCall, NamedToolChoice,
                                                       ToolCall)
from pagedllm.structured_output.params import StructuredOutputsParams


def random_uuid() -> str:
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    # Unknown fields (user, metadata, ...) are ignored, as OpenAI-compatible servers do.
    model_config = ConfigDict(extra="ignore")


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ------------------------------------------------------------------------------------------------ models
class ModelPermission(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"modelperm-{random_uuid()}")
    object: str = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: Optional[str] = None
    is_blocking: bool = False


class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None
    # pagedllm's extra: the sampling parameters the server applies where a request leaves them out (the model's
    # generation config's; empty when it has none), so a client such as `pagedllm chat` can tell.
    default_sampling_params: dict[str, Any] = Field(default_factory=dict)
    permission: list[ModelPermission] = Field(default_factory=list)


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: load the adapter under a name already served, in place of that one


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_int_id: Optional[int] = None


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ------------------------------------------------------------------------------------------------ shared
class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: Optional[int] = None


class CompletionTokenUsageInfo(OpenAIBaseModel):
    reasoning_tokens: Optional[int] = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: Optional[int] = 0
    # With --enable-prompt-tokens-details, the prompt tokens found in the prefix cache, 0 included (vLLM's).
    prompt_tokens_details: Optional[PromptTokenUsageInfo] = None
    # With --reasoning-parser, how many completion tokens were reasoning (vLLM's).
    completion_tokens_details: Optional[CompletionTokenUsageInfo] = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: Optional[int] = None,
           reasoning_tokens: Optional[int] = None) -> "UsageInfo":
        """``cached_tokens``, ``reasoning_tokens``: reported when not None; else their fields are left unset, so a
        stream's chunks (sent with exclude_unset) leave them out, as vLLM's."""
        details = {}
        if cached_tokens is not None:
            details["prompt_tokens_details"] = PromptTokenUsageInfo(cached_tokens=cached_tokens)
        if reasoning_tokens is not None:
            details["completion_tokens_details"] = CompletionTokenUsageInfo(reasoning_tokens=reasoning_tokens)
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens, **details)


class StreamOptions(OpenAIBaseModel):
    include_usage: Optional[bool] = False  # a last chunk with the request's usage
    continuous_usage_stats: Optional[bool] = False  # with include_usage, every chunk with its choice's usage so far

# priority crosses to the engine process as MessagePack, which holds 64 bits (SamplingParams checks its own fields).
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# A request's stop strings: at most 4 in a list, as OpenAI's and vLLM's (VLLM_MAX_STOP_STRINGS) StopParam.
MAX_STOP_STRINGS = int(os.environ.get("PAGEDLLM_MAX_STOP_STRINGS", "4"))
StopParam = Optional[Union[str, Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)]]]


def _a_number(value: Any) -> Any:
    """As vLLM's check_logprobs: a count of logprobs is a JSON number; text such as "2" is refused, not read as one."""
    if value is not None and not isinstance(value, (int, float)):
        raise ValueError("must be an integer.")
    return value


# How many logprobs a request asks for (prompt_logprobs, chat's top_logprobs, completions' logprobs).
LogprobsCount = Annotated[Optional[int], BeforeValidator(_a_number)]
# vLLM's cache_salt, checked with the body (as vLLM's request models do) so that no prompt of the request starts.
CacheSalt = Annotated[Optional[str], AfterValidator(validate_cache_salt)]


class JsonSchemaResponseFormat(OpenAIBaseModel):
    name: str  # required (a 400 without it), as OpenAI's and vLLM's
    description: Optional[str] = None
    # "schema" shadows a BaseModel attribute in pydantic, hence the alias.
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: Optional[JsonSchemaResponseFormat] = None
    # vLLM's structural_tag: xgrammar's format, or the legacy structures ({"begin", "schema", "end"}) and triggers.
    format: Optional[Any] = None
    structures: Optional[list[dict[str, Any]]] = None
    triggers: Optional[list[str]] = None

    def to_structured_outputs(self) -> Optional[StructuredOutputsParams]:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "structural_tag":  # as vLLM's structured_outputs_from_response_format
            if self.format is None and (self.structures is None or self.triggers is None):
                raise ValueError("response_format.format (or the legacy structures and triggers) is required when "
                                 "type is structural_tag.")
            return StructuredOutputsParams(structural_tag=json.dumps(self.model_dump(
                include={"type", "format", "structures", "triggers"}, exclude_none=True)))
        if self.json_schema is None or self.json_schema.json_schema is None:
            raise ValueError("response_format.json_schema.schema is required when type is json_schema.")
        return StructuredOutputsParams(json=self.json_schema.json_schema)


class SamplingRequest(OpenAIBaseModel):
    """The fields chat and completion requests share; None means the default."""

    model: Optional[str] = None
    # vLLM's: the id the response carries after its "cmpl-" / "chatcmpl-" (a random one when None); an X-Request-Id
    # header takes its place (the route puts it here).
    request_id: Optional[str] = None
    n: Optional[int] = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: StopParam = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    # vLLM's: keep only this many prompt tokens (-1: max_model_len), the last ones (truncation_side "left", the
    # default) or the first ("right").
    truncate_prompt_tokens: Optional[int] = Field(default=None, ge=-1)
    truncation_side: Optional[Literal["left", "right"]] = None
    # vLLM's extra sampling parameters.
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: LogprobsCount = None
    # vLLM's: with logprobs asked for, each generated token's alternatives are these token ids (in place of the top
    # ones), all of them returned. Not an empty list (a 400), as vLLM's field: it would ask for nothing, silently.
    logprob_token_ids: Optional[list[int]] = Field(default=None, min_length=1)
    # vLLM's, checked by SamplingParams (an integer, not a bool); refused by a server without --reasoning-parser.
    thinking_token_budget: Any = None
    priority: int = Field(default=0, ge=_INT64_MIN, le=_INT64_MAX)
    # vLLM's: a stream's chunks every this many tokens at least (the server's --stream-interval the least).
    stream_interval: Optional[int] = Field(default=None, ge=1)
    # vLLM's: the answer carries the prompt's token ids and each choice's generated ones (a stream: the prompt's in
    # its first chunk, then each chunk's new ones).
    return_token_ids: Optional[bool] = None
    # vLLM's: logprobs name each token "token_id:<id>" (identifiable whether or not its text is valid UTF-8); None:
    # the server's --return-tokens-as-token-ids.
    return_tokens_as_token_ids: Optional[bool] = None
    # Salts the prefix cache's block hashes: only requests with the same salt share cached blocks.
    cache_salt: CacheSalt = None
    # vLLM's beam search extras: n beams, best first.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    # Token id (a string in JSON) -> bias; SamplingParams turns the keys into ints.
    logit_bias: Optional[dict[str, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    # A list, never null (a 400), as vLLM's field, which is not Optional.
    bad_words: list[str] = Field(default_factory=list)
    # OpenAI's {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}.
    response_format: Optional[ResponseFormat] = None
    # vLLM's extra: {"json" | "regex" | "choice" | "grammar" | "json_object" | "structural_tag": ...}.
    structured_outputs: Optional[dict[str, Any]] = None

    def check_stream_options(self) -> None:
        """As vLLM: stream_options need stream (an empty object is as none, as vLLM reads it); prompt logprobs have no
        place in a stream."""
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise ValueError("stream_options can only be defined when stream=True.")
        if self.stream and self.prompt_logprobs:
            raise ValueError("prompt_logprobs are not available when stream=True.")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def include_continuous_usage(self) -> bool:
        """Whether every chunk of the stream carries its choice's usage so far (vLLM's continuous_usage_stats)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens"

    def _or_default(self, name: str, default_sampling_params: dict, fallback: Any) -> Any:
        """The request's own value of a sampling field; else the model's generation config's; else ``fallback``
        (the engine's default)."""
        value = getattr(self, name)
        return value if value is not None else default_sampling_params.get(name, fallback)

    def requested_logprobs(self) -> Optional[int]:
        """How many alternatives per generated token the request asks for (None: no logprobs; -1: all there are)."""
        raise NotImplementedError

    def to_beam_search_params(self, max_tokens: int, default_sampling_params: dict, max_logprobs: int
                              ) -> BeamSearchParams:
        """As vLLM's: beam_width is n, which the engine's max_logprobs (a count, Processor.max_logprobs) bounds;
        the sampling knobs do not apply. Logprobs are served from each beam's step candidates (so at most 2 * n
        alternatives per token, as vLLM's); prompt logprobs are refused rather than left out (a beam search
        computes none)."""
        if self.logprob_token_ids:
            raise ValueError("logprob_token_ids is not supported with use_beam_search.")
        logprobs = self.requested_logprobs()
        if logprobs is not None and logprobs < -1:
            raise self.rename_error(ValueError(f"logprobs must be non-negative, or -1 for all there are, got "
                                               f"{logprobs}."))
        if self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported with use_beam_search.")
        if self.structured_outputs_params() is not None:
            name = "structured_outputs" if self.structured_outputs is not None else "response_format"
            raise ValueError(f"{name} is not supported with use_beam_search.")
        try:
            params = BeamSearchParams(
                beam_width=self.n if self.n is not None else 1, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                temperature=self._or_default("temperature", default_sampling_params, 0.0),
                length_penalty=self.length_penalty, include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens)
            params.verify_width(max_logprobs)
            return params
        except ValueError as e:
            field, _, rest = str(e).partition(" ")
            renamed = {"beam_width": "n", "max_tokens": self.max_tokens_param}
            raise ValueError(f"{renamed.get(field, field)} {rest}") from e

    def structured_outputs_params(self) -> Optional[StructuredOutputsParams]:
        """The output constraint asked for with response_format or structured_outputs (not both)."""
        if self.structured_outputs is not None:
            if self.response_format is not None and self.response_format.type != "text":
                raise ValueError("structured_outputs cannot be combined with response_format; use one.")
            if not isinstance(self.structured_outputs, dict):
                raise ValueError("structured_outputs must be an object.")
            # Keys it has not are ignored, as vLLM's pydantic reads its StructuredOutputsParams dataclass; so are its
            # private ones, which the server sets.
            fields = StructuredOutputsParams.__struct_fields__
            return StructuredOutputsParams(**{k: v for k, v in self.structured_outputs.items()
                                              if k in fields and not k.startswith("_")})
        if self.response_format is not None:
            return self.response_format.to_structured_outputs()
        return None

    @property
    def renamed_params(self) -> dict[str, str]:
        """SamplingParams field -> this request's name for it, where they differ: errors name the request's."""
        return {}

    @property
    def constraint_field(self) -> str:
        """The request field the output constraint came from, for errors about it (SamplingParams calls every
        constraint structured_outputs)."""
        if self.structured_outputs is None and self.response_format is not None:
            return "response_format.json_schema" if self.response_format.type == "json_schema" else "response_format"
        return "structured_outputs"

    def rename_error(self, error: ValueError) -> ValueError:
        """``error`` (starting with a SamplingParams field) naming this request's field instead."""
        field, _, rest = str(error).partition(" ")
        if field.split(".", 1)[0] == "structured_outputs":
            return ValueError(f"{self.constraint_field} {rest}")
        return ValueError(f"{self.renamed_params[field]} {rest}") if field in self.renamed_params else error

    def _sampling_params(self, max_tokens: int, default_sampling_params: dict, logprobs: Optional[int],
                         prompt_logprobs: Optional[int],
                         structured_outputs: Optional[StructuredOutputsParams] = None) -> SamplingParams:
        """default_sampling_params: the model's generation config's (ModelConfig.get_diff_sampling_param), for the
        fields the request leaves out. structured_outputs overrides the request's own constraint (tool calls bring
        theirs)."""
        if structured_outputs is None:
            structured_outputs = self.structured_outputs_params()
        if self.logprob_token_ids and logprobs is None:
            raise ValueError("logprob_token_ids needs logprobs to be set (chat: true).")
        try:
            return SamplingParams(
                n=self.n if self.n is not None else 1,
                temperature=self._or_default("temperature", default_sampling_params, 1.0),
                top_p=self._or_default("top_p", default_sampling_params, 1.0),
                top_k=self._or_default("top_k", default_sampling_params, 0),
                min_p=self._or_default("min_p", default_sampling_params, 0.0),
                seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
                stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                # as vLLM's: the ids stand in for the count of logprobs (top_logprobs, or completions' logprobs)
                logprobs=None if self.logprob_token_ids else logprobs,
                logprob_token_ids=self.logprob_token_ids, prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                presence_penalty=self._or_default("presence_penalty", default_sampling_params, 0.0),
                frequency_penalty=self._or_default("frequency_penalty", default_sampling_params, 0.0),
                repetition_penalty=self._or_default("repetition_penalty", default_sampling_params, 1.0),
                logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
                structured_outputs=structured_outputs, stream_interval=self.stream_interval,
                thinking_token_budget=self.thinking_token_budget,
                # as vLLM's requests: a stream sends what each step adds, an answer is sent whole when it is done
                output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY)
        except ValueError as e:
            raise self.rename_error(e) from e


# ------------------------------------------------------------------------------------------------ completions
class CompletionRequest(SamplingRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    # An integer, never null (a 400), as vLLM's CompletionRequest.n; chat's n may be null, read as 1.
    n: int = 1
    max_tokens: Optional[int] = 16
    echo: bool = False
    logprobs: LogprobsCount = None
    add_special_tokens: bool = True
    # OpenAI's text after the completion (fill-in-the-middle): refused, as vLLM refuses it for every model without a
    # FIM renderer (which no model pagedllm runs has), rather than ignored.
    suffix: Optional[str] = None

    @model_validator(mode="before")
    @classmethod
    def nulls_are_the_defaults(cls, data: Any) -> Any:
        """"max_tokens": null means OpenAI's default of 16 for completions, as vLLM reads it (chat's null fills
        the context); "echo": null is no echo, as vLLM's (bool | None) reads it."""
        if isinstance(data, dict):
            data = {**data, **{name: cls.model_fields[name].default for name in ("max_tokens", "echo")
                               if name in data and data[name] is None}}
        return data

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) back, nothing generated (as vLLM answers it, which
        lm-evaluation-harness's loglikelihood requests use)."""
        return self.echo and self.max_tokens == 0

    def requested_logprobs(self) -> Optional[int]:
        return self.logprobs

    def to_sampling_params(self, max_tokens: int, default_sampling_params: dict) -> SamplingParams:
        if self.echo_only and self.logprob_token_ids:
            raise ValueError("logprob_token_ids is not supported when echo=True and max_tokens=0, which generate no "
                             "tokens.")
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = self.logprobs  # echoed prompt tokens get logprobs too
        return self._sampling_params(max_tokens, default_sampling_params, self.logprobs, prompt_logprobs)

    def to_beam_search_params(self, max_tokens: int, default_sampling_params: dict, max_logprobs: int
                              ) -> BeamSearchParams:
        """As vLLM's: an echoed prompt would need prompt logprobs, which a beam search does not compute."""
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported with use_beam_search, which computes no prompt "
                             "logprobs.")
        return super().to_beam_search_params(max_tokens, default_sampling_params, max_logprobs)


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int]
    token_logprobs: list[Optional[float]]
    tokens: list[str]
    top_logprobs: list[Optional[dict[str, float]]]


class PromptLogprob(OpenAIBaseModel):
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[None, int, str] = None
    prompt_logprobs: Optional[list[Optional[dict[int, PromptLogprob]]]] = None
    # return_token_ids: the prompt's and this choice's generated token ids
    prompt_token_ids: Optional[list[int]] = None
    token_ids: Optional[list[int]] = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[None, int, str] = None
    # return_token_ids: the prompt's (in a choice's first chunk) and this chunk's generated token ids
    prompt_token_ids: Optional[list[int]] = None
    token_ids: Optional[list[int]] = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = None


# ------------------------------------------------------------------------------------------------ chat
class ChatMessageParam(OpenAIBaseModel):
    """One message in; extra keys (name, tool_calls, ...) are kept for the chat template."""

    model_config = ConfigDict(extra="allow")
    role: str
    # Parts are OpenAI's objects, or (as vLLM takes them) plain strings of text.
    content: Union[str, list[Union[dict[str, Any], str]], None] = None


class ChatTemplateFields(OpenAIBaseModel):
    """What a chat request (and /tokenize's messages form) says about its rendering, as vLLM's fields: more
    variables for the chat template (Qwen3's enable_thinking, ...), under the request's own fields; and a template of
    its own, refused (chat_utils.check_chat_template) as vLLM refuses it without --trust-request-chat-template."""
    chat_template_kwargs: Optional[dict[str, Any]] = None
    chat_template: Optional[str] = None
    # vLLM's: special tokens (BOS) added on top of those the template writes; off, as templates write their own.
    add_special_tokens: bool = False

    def template_kwargs(self) -> dict[str, Any]:
        """The variables the chat template gets besides the messages, the tools and the generation prompt's
        flags."""
        return self.chat_template_kwargs or {}


# OpenAI's reasoning effort (chat's reasoning_effort, the Responses API's reasoning.effort), as vLLM takes it.
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ChatCompletionRequest(SamplingRequest, ChatTemplateFields):
    messages: list[ChatMessageParam]
    max_tokens: Optional[int] = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: LogprobsCount = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: the answer starts with the last message's text when it continues that message (the roles are the same).
    echo: bool = False
    tools: Optional[list[ChatCompletionToolsParam]] = None
    # None: left out without tools, or given as null (left out beside tools it is "auto": tools_mean_auto).
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = True
    # vLLM's: with --reasoning-parser, whether the answer carries the reasoning it split off the content.
    include_reasoning: bool = True
    # OpenAI's, which vLLM gives the chat template (gpt-oss's reads it); "none" also turns thinking off in templates
    # that read enable_thinking (Qwen3's), any other value on, unless chat_template_kwargs say.
    reasoning_effort: Optional[ReasoningEffort] = None
    # vLLM's: the documents a RAG template (Command R's, Granite's) shows the model.
    documents: Optional[list[dict[str, str]]] = None
    # vLLM's: the answer carries the prompt's text, as the chat template rendered it (a stream: in each choice's first
    # chunk).
    return_prompt_text: Optional[bool] = None

    @model_validator(mode="before")
    @classmethod
    def tools_mean_auto(cls, data: Any) -> Any:
        """As vLLM's check_tool_usage: tools with no tool_choice are "auto", which needs a tool-call format; a
        tool_choice given as null stays None, which asks for none (resolve_tool_choice)."""
        if isinstance(data, dict) and data.get("tools") and "tool_choice" not in data:
            data = {**data, "tool_choice": "auto"}
        return data

    def template_kwargs(self) -> dict[str, Any]:
        """As vLLM's build_chat_params: reasoning_effort and documents, where given, over chat_template_kwargs; and
        enable_thinking from reasoning_effort under them."""
        kwargs = dict(super().template_kwargs())
        if self.reasoning_effort is not None:
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        given = {"reasoning_effort": self.reasoning_effort, "documents": self.documents}
        return {**kwargs, **{k: v for k, v in given.items() if v is not None}}

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def to_sampling_params(self, max_tokens: int, default_sampling_params: dict,
                           tool_call_constraint: Optional[StructuredOutputsParams] = None) -> SamplingParams:
        """tool_call_constraint: the grammar a required/named tool_choice imposes. As vLLM's adjust_request, it
        replaces the request's own constraint (response_format or structured_outputs, still checked), but for a
        structured_outputs json, regex or choice beside a named function, which vLLM refuses."""
        logprobs = self.requested_logprobs()
        own_constraint = self.structured_outputs_params()
        if (isinstance(self.tool_choice, NamedToolChoice) and self.structured_outputs is not None
                and own_constraint.kind in ("json", "regex", "choice")):
            raise ValueError("structured_outputs json, regex or choice cannot be combined with a named function "
                             "tool_choice: use one or the other.")
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:  # as vLLM's: top_logprobs (0 by default) for the prompt too
            prompt_logprobs = self.top_logprobs or 0
        return self._sampling_params(max_tokens, default_sampling_params, logprobs, prompt_logprobs,
                                     own_constraint if tool_call_constraint is None else tool_call_constraint)

    def requested_logprobs(self) -> Optional[int]:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true.")
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def renamed_params(self) -> dict[str, str]:
        return {"logprobs": "top_logprobs", "max_tokens": self.max_tokens_param}

    @property
    def constraint_field(self) -> str:
        """A required or named tool_choice constrains the output by the tools' schemas (in place of the request's
        own constraint)."""
        if self.tools and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)):
            return "tools"
        return super().constraint_field


class ChatMessage(OpenAIBaseModel):
    role: str
    content: Optional[str] = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    # vLLM's: the reasoning a --reasoning-parser split off the content.
    reasoning: Optional[str] = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> dict:
        """As vLLM's (and OpenAI's): a message without tool calls has no tool_calls field, rather than an empty one
        (which a client may take for calls made, or send back to a template that tests whether it is defined); nor
        a reasoning field without reasoning."""
        data = handler(self)
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
        if data.get("reasoning") is None:
            data.pop("reasoning", None)
        return data


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: Optional[list[int]] = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: Optional[list[ChatCompletionLogProbsContent]] = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = "stop"
    stop_reason: Union[None, int, str] = None
    token_ids: Optional[list[int]] = None  # return_token_ids: the generated token ids


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: Optional[list[Optional[dict[int, PromptLogprob]]]] = None
    prompt_token_ids: Optional[list[int]] = None  # return_token_ids
    prompt_text: Optional[str] = None  # return_prompt_text


class DeltaMessage(OpenAIBaseModel):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[None, int, str] = None
    token_ids: Optional[list[int]] = None  # return_token_ids: this chunk's generated token ids


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = None
    # return_token_ids, return_prompt_text: in each choice's first chunk
    prompt_token_ids: Optional[list[int]] = None
    prompt_text: Optional[str] = None


# ------------------------------------------------------------------------------------------------ tokenizer
class TokenizeCompletionRequest(OpenAIBaseModel):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: Optional[bool] = False


class TokenizeChatRequest(ChatTemplateFields):
    model: Optional[str] = None
    messages: list[ChatMessageParam]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: Optional[bool] = False
    # As chat's: given to the chat template, which may describe them to the model (and so count their tokens).
    tools: Optional[list[ChatCompletionToolsParam]] = None


TokenizeRequest = Union[TokenizeCompletionRequest, TokenizeChatRequest]


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(OpenAIBaseModel):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
