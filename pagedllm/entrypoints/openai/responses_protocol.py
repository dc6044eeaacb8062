"""Pydantic shapes of OpenAI's Responses API (/v1/responses), at the level vLLM serves it: text and function-call
input items, function tools (custom and namespace tools as functions, OpenAI's hosted ones taken and dropped, as
vLLM's), and the Response object with its output items.

A request is served by turning it into a chat request (to_chat_request), so every sampling and tool check is the
chat endpoint's; nothing here generates.
"""
from __future__ import annotations

import json
import time
from typing import Annotated, Any, Iterator, Literal, Optional, Sequence, Union

from pydantic import (ConfigDict, Discriminator, Field, SerializerFunctionWrapHandler, Tag, model_serializer,
                      model_validator)

from pagedllm.entrypoints.openai.protocol import (_INT64_MAX, _INT64_MIN, CacheSalt, ChatCompletionLogProbsContent,
                                                  ChatCompletionRequest, LogprobsCount, OpenAIBaseModel,
                                                  ReasoningEffort, StopParam, UsageInfo, random_uuid)


class InputTextPart(OpenAIBaseModel):
    # output_text parts are an earlier assistant turn given back as input.
    type: Literal["input_text", "output_text"]
    text: str


# An item's status, given back with an output item: one in_progress or incomplete, last in the input, is continued.
ItemStatus = Optional[Literal["in_progress", "completed", "incomplete"]]


class InputMessage(OpenAIBaseModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    # The list first: a bad part's 400 then names it (input[1].content[0].type), not "content is not a string".
    content: Union[list[InputTextPart], str]
    status: ItemStatus = None

    def to_chat_message(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        # Chat templates know no "developer"; OpenAI treats it as the system role.
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


# A custom tool is shown to the model as a function of one string argument under this key (vLLM's shim).
CUSTOM_TOOL_INPUT_KEY = "input"
# A namespace's function is shown to the model as "<namespace>__<name>" (vLLM's flat_namespace_tool_name).
_NAMESPACE_TOOL_SEPARATOR = "__"


def flat_namespace_tool_name(namespace: str, name: str) -> str:
    return f"{namespace}{_NAMESPACE_TOOL_SEPARATOR}{name}"


def encode_custom_tool_input(payload: str) -> str:
    """A custom tool call's input as the arguments of its function shim (vLLM's)."""
    return json.dumps({CUSTOM_TOOL_INPUT_KEY: payload}, ensure_ascii=False)


def decode_custom_tool_input(arguments: str) -> str:
    """A custom tool call's input out of its shim's arguments; arguments that are not the shim's are the input as
    they are (vLLM's)."""
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments
    payload = parsed.get(CUSTOM_TOOL_INPUT_KEY) if isinstance(parsed, dict) else None
    return payload if isinstance(payload, str) else arguments


def decode_custom_tool_input_prefix(arguments: str) -> str:
    """The input read so far out of a shim's arguments still being generated (``{"input": "...`` cut anywhere), so
    that a stream's input deltas join to a prefix of what decode_custom_tool_input gives of the whole (vLLM's reads
    it with partial_json_parser): the string closed where it is cut, dropping an escape cut short; "" before the
    string starts."""
    for cut in range(min(len(arguments), 6) + 1):  # an escape cut short is at most "\\uXXX" (5 characters)
        try:
            parsed = json.loads(arguments[:len(arguments) - cut] + '"}')
        except (ValueError, RecursionError):
            continue
        payload = parsed.get(CUSTOM_TOOL_INPUT_KEY) if isinstance(parsed, dict) else None
        payload = payload if isinstance(payload, str) else ""
        # A high surrogate whose low half has not come yet would be taken back.
        return payload[:-1] if payload and "\ud800" <= payload[-1] <= "\udbff" else payload
    return ""


class FunctionCallInput(OpenAIBaseModel):
    """An earlier function_call output item, given back with its result; one of a namespace's function is called
    by its flat name (vLLM's)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: Optional[str] = None

    def to_chat_message(self) -> dict:
        name = self.name if not self.namespace else flat_namespace_tool_name(self.namespace, self.name)
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": self.call_id, "type": "function", "function": {"name": name, "arguments": self.arguments}}]}


class CustomToolCallInput(OpenAIBaseModel):
    """An earlier custom_tool_call output item: the call of its function shim, its input the shim's argument."""

    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str

    def to_chat_message(self) -> dict:
        return FunctionCallInput(type="function_call", call_id=self.call_id, name=self.name,
                                 arguments=encode_custom_tool_input(self.input)).to_chat_message()


class FunctionCallOutputInput(OpenAIBaseModel):
    """A function's (or a custom tool's: custom_tool_call_output) result, a tool message for the chat template."""
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str
    # A string, or (as OpenAI's and vLLM's take it) content parts, text here; the list first, as InputMessage.content.
    output: Union[list[InputTextPart], str]

    def to_chat_message(self) -> dict:
        text = self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)
        return {"role": "tool", "tool_call_id": self.call_id, "content": text}


class ReasoningInputText(OpenAIBaseModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningInput(OpenAIBaseModel):
    """An earlier reasoning output item, given back as OpenAI's clients give a response's output back as input (with
    --reasoning-parser, a response's output starts with one). As vLLM's, its text (its content's, else its summary's)
    is the reasoning of the assistant turn it belongs to, for the chat template: Qwen3's writes it back for the turns
    after the last user message, so a tool-calling turn keeps its thinking. (A stored response's own reasoning is
    left out of the conversation previous_response_id continues, as vLLM leaves it.)"""

    type: Literal["reasoning"]
    summary: list[ReasoningInputText] = Field(default_factory=list)
    content: Optional[list[ReasoningInputText]] = None
    status: ItemStatus = None

    def to_chat_message(self) -> dict:
        parts = self.content or self.summary
        return {"role": "assistant", "reasoning": parts[0].text if parts else ""}


def chat_messages(items: Sequence[Any]) -> list[dict]:
    """Responses items (input items, or output items given back) as chat messages, in order, as vLLM makes them
    (construct_chat_messages_with_tool_call): an assistant item joins the assistant message before it, a function call
    always (one more of its tool_calls), text or reasoning where that message has none yet. So a turn given back as
    its items (reasoning, text, then its parallel calls) is the one assistant turn with its tool calls that the model
    wrote, not a turn per item, which a chat template renders as turns the model never took."""
    messages: list[dict] = []
    for item in items:
        message = item.to_chat_message()
        last = messages[-1] if messages else None
        if message["role"] == "assistant" and last is not None and last["role"] == "assistant":
            if message.get("tool_calls"):
                last["tool_calls"] = [*(last.get("tool_calls") or []), *message["tool_calls"]]
                continue
            field = "reasoning" if "reasoning" in message else "content"
            if last.get(field) is None:
                last[field] = message[field]
                continue
        messages.append(message)
    return messages


def _input_item_type(item: Any) -> Optional[str]:
    """The tag of an input item: its type, "message" when it has none (OpenAI's easy input message)."""
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)
    return None if kind is None else f"type={kind}"


# Chosen by type, so a bad item is checked against its own kind only and its 400 names the bad field in it; the
# tags are spelled "type=..." so that the error's param leaves them out (errors.error_param).
InputItem = Annotated[Union[Annotated[InputMessage, Tag("type=message")],
                            Annotated[FunctionCallInput, Tag("type=function_call")],
                            Annotated[FunctionCallOutputInput, Tag("type=function_call_output")],
                            Annotated[CustomToolCallInput, Tag("type=custom_tool_call")],
                            Annotated[FunctionCallOutputInput, Tag("type=custom_tool_call_output")],
                            Annotated[ReasoningInput, Tag("type=reasoning")]],
                      Discriminator(_input_item_type, custom_error_type="invalid_input_item",
                                    custom_error_message="an input item's type must be 'message', 'function_call', "
                                                         "'function_call_output', 'custom_tool_call', "
                                                         "'custom_tool_call_output' or 'reasoning'")]


class FunctionTool(OpenAIBaseModel):
    type: Literal["function"]
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class CustomTool(OpenAIBaseModel):
    """OpenAI's custom tool, whose call's input is free text: shown to the model as a function of one string
    (as_function), its call answered as a custom_tool_call item, as vLLM's. One with a grammar format among the
    request's tools is refused (ResponsesRequest._free_form_custom_tools_only)."""
    model_config = ConfigDict(extra="allow")
    type: Literal["custom"]
    name: str
    description: Optional[str] = None
    format: Optional[dict[str, Any]] = None

    def as_function(self) -> FunctionTool:
        return FunctionTool(type="function", name=self.name, description=self.description, parameters={
            "type": "object",
            "properties": {CUSTOM_TOOL_INPUT_KEY: {"type": "string",
                                                   "description": "The freeform text payload for this tool."}},
            "required": [CUSTOM_TOOL_INPUT_KEY], "additionalProperties": False})


class NamespaceTool(OpenAIBaseModel):
    """OpenAI's group of tools under a name: its functions are shown to the model as "<namespace>__<name>", and a
    call of one answered with its own name and the namespace, as vLLM's (which shows none of its custom tools)."""
    type: Literal["namespace"]
    name: str
    description: str
    tools: list[Annotated[Union[FunctionTool, CustomTool], Field(discriminator="type")]]

    def functions(self) -> list[FunctionTool]:
        return [tool.model_copy(update={"name": flat_namespace_tool_name(self.name, tool.name)})
                for tool in self.tools if isinstance(tool, FunctionTool)]


class HostedTool(OpenAIBaseModel):
    """One of OpenAI's tools that its servers run (web search, file search, a code interpreter, an MCP server, ...).
    vLLM takes them (its tools are OpenAI's Tool union) and drops them from what the model is shown (its
    get_function_tools), running none without a tool server, which pagedllm has not: so here, kept only to be
    echoed as given (hence their fields are all kept), never rendered or called."""
    model_config = ConfigDict(extra="allow")
    type: Literal["file_search", "computer", "computer_use", "computer_use_preview", "web_search",
                  "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11", "mcp",
                  "code_interpreter", "image_generation", "local_shell", "shell", "apply_patch", "tool_search"]


Tool = Annotated[Union[FunctionTool, CustomTool, NamespaceTool, HostedTool], Field(discriminator="type")]


class NamedFunctionToolChoice(OpenAIBaseModel):
    """A function (or a custom tool: OpenAI's ToolChoiceCustom) the model must call."""
    type: Literal["function", "custom"]
    name: str


class HostedToolChoice(OpenAIBaseModel):
    """OpenAI's tool_choice naming a hosted tool (its ToolChoiceTypes, ToolChoiceMcp, ToolChoiceApplyPatch,
    ToolChoiceShell): vLLM takes it as it takes a hosted tool, forcing no call (its get_json_schema_from_tools
    constrains only "required" and a named function), so here it asks what "auto" does of the function tools, echoed
    as given."""
    model_config = ConfigDict(extra="allow")
    type: Literal["file_search", "web_search_preview", "computer", "computer_use_preview", "computer_use",
                  "web_search_preview_2025_03_11", "image_generation", "code_interpreter", "mcp", "apply_patch",
                  "shell"]


class AllowedToolsChoice(OpenAIBaseModel):
    """OpenAI's tool_choice limiting the model to some of the tools (its ToolChoiceAllowed). vLLM's
    get_json_schema_from_tools constrains neither its mode nor its tools (only xgrammar's structural tags, which
    pagedllm has not, read them), so here, as a hosted tool's choice, it asks what "auto" does of all the function
    tools, echoed as given."""
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]]


ToolChoice = Union[Literal["none", "auto", "required"],
                   Annotated[Union[NamedFunctionToolChoice, HostedToolChoice, AllowedToolsChoice],
                             Field(discriminator="type")]]


class TextFormat(OpenAIBaseModel):
    """OpenAI's text.format: plain text, any JSON object, or JSON of a schema (the chat API's response_format)."""
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    description: Optional[str] = None
    # "schema" shadows a BaseModel attribute in pydantic, hence the alias.
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None

    @model_validator(mode="after")
    def _json_schema_is_named(self) -> "TextFormat":
        """As OpenAI's json_schema format (and so vLLM's), whose name is required: a 400 without it, as chat's
        response_format gives."""
        if self.type == "json_schema" and self.name is None:
            raise ValueError("name is required when type is json_schema.")
        return self

    @model_serializer(mode="wrap")
    def _schema_as_openai_names_it(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Dumped with the schema under "schema", OpenAI's key (and vLLM's, which dumps by alias), so a response
        echoes text.format as the request gave it."""
        data = handler(self)
        if "json_schema" in data:
            data["schema"] = data.pop("json_schema")
        return data

    def to_response_format(self) -> Optional[dict]:
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "json_schema": {
            "name": self.name, "description": self.description, "schema": self.json_schema, "strict": self.strict}}


class ResponseTextConfig(OpenAIBaseModel):
    format: Optional[TextFormat] = None


class Reasoning(OpenAIBaseModel):
    """OpenAI's reasoning settings: effort reaches the chat template as chat's reasoning_effort does, turning thinking
    off in templates that read enable_thinking where it is "none" (vLLM's ResponsesRequest.build_chat_params)."""
    effort: Optional[ReasoningEffort] = None


# The ResponsesRequest fields a chat request has too, under the same names.
_SAMPLING_EXTRAS = ("top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "logit_bias", "skip_special_tokens",
                    "include_stop_str_in_output", "priority", "cache_salt", "structured_outputs")


# OpenAI's (and vLLM's) include values: more of the output to return. Of them only the output text's logprobs are
# served; the others name what no response here has (tool results, images, encrypted reasoning).
ResponseIncludable = Literal["code_interpreter_call.outputs", "computer_call_output.output.image_url",
                             "file_search_call.results", "message.input_image.image_url",
                             "message.output_text.logprobs", "reasoning.encrypted_content"]


ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]


class ResponsesRequest(OpenAIBaseModel):
    model: Optional[str] = None
    input: Union[list[InputItem], str]  # the list first, as InputMessage.content
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    # A list, never null (a 400), as vLLM's field, which is not Optional.
    tools: list[Tool] = Field(default_factory=list)
    # Never null (a 400), as vLLM's (OpenAI's ToolChoice).
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: Optional[bool] = True
    stream: Optional[bool] = False
    # OpenAI's reusable prompt template ({"id", "version", "variables"}): refused (create_responses), as vLLM refuses
    # it, rather than answered without it.
    prompt: Any = None
    # A stored response (see serving_responses.ResponseStore) whose conversation this request continues.
    previous_response_id: Optional[str] = None
    # Keep the finished response for GET /v1/responses/{id} and previous_response_id (OpenAI's default: true).
    store: Optional[bool] = True
    metadata: Optional[dict[str, str]] = None
    text: Optional[ResponseTextConfig] = None  # the output's format: structured output, as chat's response_format
    reasoning: Optional[Reasoning] = None
    include: Optional[list[ResponseIncludable]] = None
    # The alternatives per token of the output text's logprobs (with include's "message.output_text.logprobs").
    top_logprobs: LogprobsCount = None
    # Generate after the reply: the POST returns the response queued, GET /v1/responses/{id} follows it (with
    # stream, its events from any point), POST /v1/responses/{id}/cancel stops it. Needs store.
    background: Optional[bool] = False
    # vLLM's sampling extras (its ResponsesRequest.to_sampling_params applies them), given to the chat request as
    # they are, so their checks and 400s are chat's, naming the same fields.
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stop: StopParam = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = Field(default=0, ge=_INT64_MIN, le=_INT64_MAX)
    cache_salt: CacheSalt = None
    # vLLM's output constraint, as chat's ({"json" | "regex" | "choice" | "grammar" | ...}): in place of text.format,
    # never beside it (create_responses refuses both).
    structured_outputs: Optional[dict[str, Any]] = None
    # vLLM's: the response's id (a random "resp_..." when None), under which it is stored, read back and cancelled.
    request_id: Optional[str] = None
    # vLLM's: false leaves a --reasoning-parser's reasoning item out of the output (generated all the same).
    include_reasoning: bool = True
    # vLLM's: more variables for the chat template (Qwen3's enable_thinking, ...), as chat's field.
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # Echoed in the response, as vLLM's; truncation "auto" keeps the prompt's last max_model_len - 1 tokens (vLLM's
    # truncate_prompt_tokens -1) where "disabled" refuses a prompt too long (a 400).
    user: Optional[str] = None
    truncation: Optional[Literal["auto", "disabled"]] = "disabled"
    # Only echoed, as vLLM's (which has one tier and caps no tool calls); another tier is a 400, as vLLM's.
    service_tier: ServiceTier = "auto"
    max_tool_calls: Optional[int] = None

    @model_validator(mode="after")
    def _no_tools_call_none(self) -> "ResponsesRequest":
        """As vLLM's check_tool_usage: without tools, tool_choice "auto" (the default) is "none", echoed so, not
        chat's 400 for a choice that needs tools; "required" or a named function is still that 400."""
        if not self.tools and self.tool_choice == "auto":
            self.tool_choice = "none"
        return self

    @model_validator(mode="after")
    def _free_form_custom_tools_only(self) -> "ResponsesRequest":
        """As vLLM's check_custom_tool_format: a custom tool with a grammar format is a 400 (a namespace's, never
        shown to the model, is not looked at)."""
        if any(isinstance(tool, CustomTool) and (tool.format or {}).get("type") == "grammar" for tool in self.tools):
            raise ValueError("Custom tools with a grammar format are not supported; only free-form text custom tools "
                             "are accepted.")
        return self

    @model_validator(mode="after")
    def _named_tool_choice_is_flat(self) -> "ResponsesRequest":
        """As vLLM's _resolve_named_tool_choice: a named tool_choice of a namespace's function by its own name is
        the function of that name in the one namespace that has it (a 400 where several have it), its flat name
        then echoed; a flat or top-level name is kept."""
        choice = self.tool_choice
        if not isinstance(choice, NamedFunctionToolChoice) or choice.name in self.custom_tool_names or any(
                tool.name == choice.name for tool in self.function_tools):
            return self
        candidates = [flat_name for flat_name, function, _ in self._namespace_functions()
                      if function.name == choice.name]
        if len(candidates) > 1:
            raise ValueError(f"Tool choice '{choice.name}' is ambiguous: it is defined in more than one namespace "
                             f"({', '.join(candidates)}). Select it by its full '<namespace>__<name>' name.")
        if candidates:
            self.tool_choice = choice.model_copy(update={"name": candidates[0]})
        return self

    @property
    def function_tools(self) -> list[FunctionTool]:
        """The tools the model is shown and may call, in the request's order (vLLM's get_function_tools): a
        namespace's functions under their flat names, a custom tool as its function shim; the hosted ones are
        dropped."""
        functions: list[FunctionTool] = []
        for tool in self.tools:
            if isinstance(tool, NamespaceTool):
                functions += tool.functions()
            elif isinstance(tool, CustomTool):
                functions.append(tool.as_function())
            elif isinstance(tool, FunctionTool):
                functions.append(tool)
        return functions

    @property
    def custom_tool_names(self) -> frozenset[str]:
        """The names of the custom tools (vLLM's custom_tool_names): a call of one is a custom_tool_call."""
        return frozenset(tool.name for tool in self.tools if isinstance(tool, CustomTool))

    def namespace_of(self, name: str) -> tuple[str, Optional[str]]:
        """A called function's name and namespace as the output item gives them: a flat name of a namespace's
        function split back (vLLM's resolve_responses_tool_call_name), any other name as it is, with none."""
        for flat_name, function, namespace in self._namespace_functions():
            if flat_name == name:
                return function.name, namespace
        return name, None

    def _namespace_functions(self) -> Iterator[tuple[str, FunctionTool, str]]:
        """Each namespace's functions (not its custom tools, which are never shown), as (flat name, the function,
        the namespace's name)."""
        for tool in self.tools:
            if isinstance(tool, NamespaceTool):
                for function in tool.tools:
                    if isinstance(function, FunctionTool):
                        yield flat_namespace_tool_name(tool.name, function.name), function, tool.name

    @property
    def chat_tool_choice(self) -> Union[str, dict]:
        """tool_choice as the chat request takes it, for function_tools. vLLM's "auto", a hosted tool's choice and
        allowed_tools constrain nothing (a call, if any, is read as "auto" reads it), and, with no function tool,
        leave the answer plain text: chat's "none" (whose "auto" would need tools); "required" and a named function
        are chat's, so a choice no function tool can meet is its 400, as vLLM's."""
        tool_choice = self.tool_choice
        if isinstance(tool_choice, NamedFunctionToolChoice):
            return {"type": "function", "function": {"name": tool_choice.name}}
        if isinstance(tool_choice, (HostedToolChoice, AllowedToolsChoice)) or tool_choice == "auto":
            return "auto" if self.function_tools else "none"
        return tool_choice

    @property
    def output_logprobs(self) -> bool:
        """Whether the output text comes with its tokens' logprobs (vLLM's is_include_output_logprobs)."""
        return "message.output_text.logprobs" in (self.include or ())

    @property
    def continues_final_message(self) -> bool:
        """As vLLM's should_continue_final_message for a message: an input whose last item is a message still
        in_progress or incomplete (an answer cut short, given back) is continued where it stopped, not answered by a
        new turn. (vLLM's also names a reasoning item, and then fails on it: here that one is taken as any
        reasoning item is, the answer a new turn after it.)"""
        last = self.input[-1] if isinstance(self.input, list) and self.input else None
        return isinstance(last, InputMessage) and last.status in ("in_progress", "incomplete")

    def input_messages(self) -> list[dict]:
        """The input as chat messages (a string is one user message)."""
        return chat_messages([InputMessage(role="user", content=self.input)] if isinstance(self.input, str)
                             else self.input)

    def to_chat_request(self, history: Sequence[dict] = ()) -> ChatCompletionRequest:
        """The same generation as a chat request: instructions become the system message, then the ``history`` (the
        chat messages of an earlier response's conversation, which OpenAI gives no instructions of), then the input.
        Every response is made from the chat stream, with its usage (which response.completed carries): the events
        of a streamed one, the final response of an unstreamed one (so their output items agree), and what a reader
        joining a background one later replays."""
        # Empty instructions are none (vLLM's construct_input_messages): no empty system message, which would take
        # the place of a template's default one.
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += [*history, *self.input_messages()]
        return ChatCompletionRequest.model_validate({
            "model": self.model, "messages": messages, "max_completion_tokens": self.max_output_tokens,
            "add_generation_prompt": not self.continues_final_message,
            "continue_final_message": self.continues_final_message,
            "temperature": self.temperature, "top_p": self.top_p, "tool_choice": self.chat_tool_choice,
            "tools": None if not self.function_tools else [
                {"type": "function", "function": t.model_dump(include={"name", "description", "parameters"})}
                for t in self.function_tools],
            "parallel_tool_calls": self.parallel_tool_calls, "stream": True, "logprobs": self.output_logprobs,
            "top_logprobs": self.top_logprobs if self.output_logprobs else None,
            "reasoning_effort": None if self.reasoning is None else self.reasoning.effort,
            "chat_template_kwargs": self.chat_template_kwargs, "include_reasoning": self.include_reasoning,
            **{name: getattr(self, name) for name in _SAMPLING_EXTRAS},
            "stream_options": {"include_usage": True},
            "truncate_prompt_tokens": -1 if self.truncation == "auto" else None,
            "response_format": None if self.text is None or self.text.format is None
            else self.text.format.to_response_format()})


# ------------------------------------------------------------------------------------------------ output
class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    # Its tokens' logprobs, where the request's include asks for them (vLLM's: None where not).
    logprobs: Optional[list[ChatCompletionLogProbsContent]] = None


class ResponseOutputMessage(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"msg_{random_uuid()}")
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)

    def to_chat_message(self) -> dict:
        """This output given back as input, as the next turn of a conversation."""
        return InputMessage(role="assistant", content="".join(part.text for part in self.content)).to_chat_message()


class ReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ResponseReasoningItem(OpenAIBaseModel):
    """vLLM's reasoning output item: what a --reasoning-parser split off the answer."""

    id: str = Field(default_factory=lambda: f"rs_{random_uuid()}")
    type: Literal["reasoning"] = "reasoning"
    summary: list = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ResponseFunctionToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"fc_{random_uuid()}")
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    namespace: Optional[str] = None  # the namespace tool whose function this calls (OpenAI's and vLLM's field)

    def to_chat_message(self) -> dict:
        """This output given back as input, as the next turn of a conversation."""
        return FunctionCallInput(type="function_call", call_id=self.call_id, name=self.name,
                                 arguments=self.arguments, namespace=self.namespace).to_chat_message()


class ResponseCustomToolCall(OpenAIBaseModel):
    """A call of a custom tool (vLLM's: its function shim's call, the shim's argument its input)."""
    id: str = Field(default_factory=lambda: f"ctc_{random_uuid()}")
    type: Literal["custom_tool_call"] = "custom_tool_call"
    call_id: str
    name: str
    input: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"

    def to_chat_message(self) -> dict:
        """This output given back as input, as the next turn of a conversation."""
        return CustomToolCallInput(type="custom_tool_call", call_id=self.call_id, name=self.name,
                                   input=self.input).to_chat_message()


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)

    @classmethod
    def of_chat(cls, usage: UsageInfo) -> "ResponseUsage":
        """A chat usage as the Responses API reports it, the prompt's cached tokens always (vLLM's)."""
        details = usage.prompt_tokens_details
        cached_tokens = (details.cached_tokens or 0) if details else 0
        completion_details = usage.completion_tokens_details
        reasoning_tokens = (completion_details.reasoning_tokens or 0) if completion_details else 0
        return cls(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                   total_tokens=usage.total_tokens,
                   input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
                   output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens))


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(OpenAIBaseModel):
    code: str
    message: str


class ResponsesResponse(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    model: str
    status: Literal["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]
    incomplete_details: Optional[IncompleteDetails] = None
    error: Optional[ResponseError] = None
    background: bool = False
    output: list[Union[ResponseReasoningItem, ResponseOutputMessage, ResponseFunctionToolCall,
                       ResponseCustomToolCall]] = Field(
        default_factory=list)
    usage: Optional[ResponseUsage] = None
    # The request's settings, echoed as OpenAI does.
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None  # the budget the answer had: the request's, else the context's rest
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_logprobs: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    user: Optional[str] = None
    truncation: Optional[Literal["auto", "disabled"]] = "disabled"
    service_tier: ServiceTier = "auto"
    max_tool_calls: Optional[int] = None
    tools: list[Tool] = Field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    previous_response_id: Optional[str] = None
    store: bool = True
    metadata: Optional[dict[str, str]] = None
    text: ResponseTextConfig = Field(default_factory=lambda: ResponseTextConfig(format=TextFormat(type="text")))
    reasoning: Optional[Reasoning] = None
