"""Chat messages -> prompt token ids, with the model's chat template or one given on the command line."""
from __future__ import annotations

import functools
import json
import os
from typing import Any, Optional, Union

from jinja2 import nodes
from transformers.utils.chat_template_utils import _compile_jinja_template

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessageParam, TokenizeChatRequest


def load_chat_template(chat_template: Optional[Union[str, os.PathLike]]) -> Optional[str]:
    """--chat-template as vLLM's load_chat_template resolves it: a file to read, else the template itself. A path
    object (LLM(chat_template=Path(...)), vLLM's ``Path | str``) is only a file: one that cannot be opened is its
    OSError. Text that cannot be opened is the template as given when it holds any of ``{``, ``}`` or a newline
    (vLLM's JINJA_CHARS: a template needs no ``{{``/``{%``); without them it is a path that failed, refused naming
    why. (vLLM then tries the name in its built-in template folder; pagedllm has none, so that step is skipped.)"""
    if chat_template is None:
        return None
    try:
        with open(chat_template, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        if isinstance(chat_template, os.PathLike):
            raise
        if not any(c in chat_template for c in "{}\n"):
            raise ValueError(f"The supplied chat template ({chat_template}) looks like a file path, but it failed to "
                             f"be opened. Tried: {chat_template}. Reason: {e}") from e
        return chat_template


def check_generation_prompt(request: Union[ChatCompletionRequest, TokenizeChatRequest]) -> None:
    """As vLLM: a request continues its last message or opens a new one, not both. add_generation_prompt is on by
    default, so only a request that sets both is refused (continuing alone turns the generation prompt off)."""
    if request.continue_final_message and request.add_generation_prompt and \
            "add_generation_prompt" in request.model_fields_set:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true.")


def check_chat_template(request: Union[ChatCompletionRequest, TokenizeChatRequest]) -> None:
    """As vLLM without --trust-request-chat-template: a request renders with the server's chat template, so one of
    its own, as a field or among chat_template_kwargs, is refused rather than ignored; nor may the kwargs turn
    tokenizing off."""
    if request.chat_template is not None:
        raise ValueError("chat_template: a chat template passed with the request is refused; the server renders with "
                         "its own (--chat-template or the model's).")
    for key in ("chat_template", "tokenize"):
        if (request.chat_template_kwargs or {}).get(key) is not None:
            raise ValueError(f"chat_template_kwargs cannot set {key}.")


# The content parts read as text (vLLM's TEXT_PART_TYPES), each with the key holding its text: OpenAI's "text" and
# an assistant's "refusal", the Responses API's "input_text" and "output_text", and "thinking".
TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
                  "thinking": "thinking"}


def _text_parts(content: Any, index: int) -> list[dict[str, Any]]:
    """A message's content as OpenAI's text parts ({"type": "text", "text": ...}): OpenAI allows content as a string
    or a list of parts, and a text model reads their text. Each part keeps the keys it carries besides its type and
    text, as vLLM keeps them for a template that reads the parts."""
    if content is None or isinstance(content, str):
        return [] if content is None else [{"type": "text", "text": content}]
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, str):  # vLLM's plain text part
            parts.append({"type": "text", "text": part})
            continue
        part_type = part.get("type")
        key = TEXT_PART_KEYS.get(part_type) if isinstance(part_type, str) else None  # a list or an object: no key
        if key is None:
            raise ValueError(f"messages[{index}].content[{j}]: only text parts are supported, got {part_type!r}.")
        if not isinstance(part.get(key), str):
            raise ValueError(f"messages[{index}].content[{j}].{key} must be a string.")
        parts.append({"type": "text", "text": part[key], **{k: v for k, v in part.items() if k not in ("type", key)}})
    return parts


def _text_content(content: Any, index: int) -> str:
    """The text of a message's content parts, joined by newlines. As vLLM's, a part with no text (an empty string)
    adds no line."""
    return "\n".join(part["text"] for part in _text_parts(content, index) if part["text"])


# vLLM's --chat-template-content-format: how a message's content reaches the chat template, "string" (the text of its
# parts, joined) or "openai" (the list of its parts, for templates that loop over them); "auto" tells from the template.
CHAT_TEMPLATE_CONTENT_FORMATS = ("auto", "string", "openai")


def _under(node: nodes.Node) -> nodes.Node:
    """The value under the filters, tests and slices applied to it (`messages | reverse`, `messages[1:]`)."""
    while True:
        if isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            return node


def _is_name(node: nodes.Node, names: set[str]) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names


def _is_content_of(node: nodes.Node, names: set[str]) -> bool:
    """Whether node is `m.content` or `m['content']` of a variable m in names (under filters, tests, slices)."""
    node = _under(node)
    if isinstance(node, nodes.Getattr):
        return node.attr == "content" and _is_name(node.node, names)
    return isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "content" \
        and _is_name(node.node, names)


def _loops_over_content(template: nodes.Template) -> bool:
    """Whether the template loops over a message's content, as vLLM's _detect_content_format tells: the variables
    holding the messages (`messages` and those set from it), those a loop over them takes each message in, then a loop
    over `message.content`, over a variable named `content` outside macros, or, in a macro, over a parameter that
    calls pass a message's content."""
    messages = {"messages"}
    while new := {a.target.name for a in template.find_all(nodes.Assign)
                  if isinstance(a.target, nodes.Name) and _is_name(_under(a.node), messages)} - messages:
        messages |= new
    message = {loop.target.name for loop in template.find_all(nodes.For)
               if isinstance(loop.target, nodes.Name) and _is_name(_under(loop.iter), messages)}
    content_params = {}  # each loop in a macro: the macro's parameters that calls pass a message's content
    for macro in template.find_all(nodes.Macro):
        params = [arg.name for arg in macro.args]
        passed = set()
        for call in template.find_all(nodes.Call):
            if isinstance(call.node, nodes.Name) and call.node.name == macro.name:
                passed.update(name for name, arg in zip(params, call.args) if _is_content_of(arg, message))
                passed.update(kw.key for kw in call.kwargs if kw.key in params and _is_content_of(kw.value, message))
        content_params.update((id(loop), passed) for loop in macro.find_all(nodes.For))
    for loop in template.find_all(nodes.For):
        if _is_content_of(loop.iter, message) or _is_name(loop.iter, content_params.get(id(loop), {"content"})):
            return True
    return False


@functools.lru_cache(maxsize=32)
def _detect_content_format(chat_template: str) -> str:
    """"openai" for a template that loops over a message's content, else "string" (as for one that does not parse:
    rendering it tells why)."""
    try:
        template = _compile_jinja_template(chat_template).environment.parse(chat_template)
    except Exception:  # jinja2's TemplateSyntaxError, an extension's error
        return "string"
    return "openai" if _loops_over_content(template) else "string"


def resolve_chat_template_content_format(tokenizer: Any, chat_template: Optional[str],
                                         tools: Optional[list[dict[str, Any]]], given: str) -> str:
    """The content format of the template rendering a conversation (chat_template, else the tokenizer's, picked as
    apply_chat_template picks it, by tools where it has several): the given one, or for "auto" the template's."""
    if given not in CHAT_TEMPLATE_CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format must be one of {CHAT_TEMPLATE_CONTENT_FORMATS}, got "
                         f"{given!r}.")
    if given != "auto":
        return given
    try:
        template = tokenizer.get_chat_template(chat_template, tools=tools)
    except ValueError:  # no template: apply_chat_template says so
        return "string"
    return _detect_content_format(template)


def _template_tool_calls(tool_calls: list[Any], index: int) -> list[dict[str, Any]]:
    """An assistant message's tool_calls as chat templates read them, as vLLM's _postprocess_messages gives them:
    each call's arguments an object, not OpenAI's JSON text (templates write them out with `tojson`, which would
    quote the text once more); arguments that are no JSON object become {}, so that a conversation holding one can
    go on. The request's own calls are left as they are."""
    calls = []
    for j, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise ValueError(f"messages[{index}].tool_calls[{j}] must be an object of type 'function' with a "
                             "'function' object.")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = None
        calls.append({**call, "function": {**function, "arguments": arguments if isinstance(arguments, dict) else {}}})
    return calls


def conversation(messages: list[ChatMessageParam], content_format: str = "string") -> list[dict[str, Any]]:
    """The messages as the chat template gets them: content as text, or with content_format "openai" as the list of
    its text parts (a tool message's as text still, as vLLM gives it, for templates that write it out); an assistant
    message's tool_calls with their arguments as objects, and left out when there are none (the template's plain
    assistant turn); and its reasoning, sent back as "reasoning" (the field answers carry it in) or
    "reasoning_content" (the older name), under both names, as vLLM gives it (Qwen3's template reads
    reasoning_content, for the turns after the last user message)."""
    if not messages:
        raise ValueError("messages must contain at least one message.")
    turns = []
    for i, m in enumerate(messages):
        as_parts = content_format == "openai" and m.role != "tool"
        turn = {**m.model_dump(exclude_none=True),
                "content": _text_parts(m.content, i) if as_parts else _text_content(m.content, i)}
        if turn["role"] == "assistant":
            if isinstance(turn.get("tool_calls"), list):
                if turn["tool_calls"]:
                    turn["tool_calls"] = _template_tool_calls(turn["tool_calls"], i)
                else:
                    del turn["tool_calls"]
            reasoning = turn.get("reasoning", turn.get("reasoning_content"))
            if reasoning is not None:
                turn["reasoning"] = turn["reasoning_content"] = reasoning
        turns.append(turn)
    return turns


# apply_chat_template's arguments about the tokens it gives back, which chat_template_kwargs do not reach: vLLM
# renders the template's text and tokenizes it itself, so there they do nothing.
_TOKENIZING_ARGS = frozenset({"tokenize", "return_dict", "padding", "truncation", "max_length", "return_tensors",
                              "return_assistant_tokens_mask", "tokenizer_kwargs"})


def template_variables(chat_template_kwargs: Optional[dict[str, Any]]) -> dict[str, Any]:
    """chat_template_kwargs as variables for the template: without apply_chat_template's own arguments about the
    tokens it returns (_TOKENIZING_ARGS), which the caller sets."""
    return {k: v for k, v in (chat_template_kwargs or {}).items() if k not in _TOKENIZING_ARGS}


def effective_chat_template_kwargs(default_chat_template_kwargs: Optional[dict[str, Any]],
                                  chat_template_kwargs: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """A request's chat_template_kwargs over the server's --default-chat-template-kwargs, as vLLM's
    ChatParams.with_defaults: a request's key set to None or "auto" leaves the default (vLLM's merge_kwargs)."""
    if not default_chat_template_kwargs:
        return chat_template_kwargs
    return default_chat_template_kwargs | {key: value for key, value in (chat_template_kwargs or {}).items()
                                           if value is not None and value != "auto"}


def render_chat_request(tokenizer: Any, request: Union[ChatCompletionRequest, TokenizeChatRequest],
                        chat_template: Optional[str], default_chat_template_kwargs: Optional[dict[str, Any]] = None,
                        content_format: str = "auto", with_tools: bool = True) -> str:
    """The prompt text of a chat request, or of /tokenize's messages form, rendered alike: its checks
    (check_generation_prompt, check_chat_template), then the server's template with the request's messages (their
    content in the server's --chat-template-content-format), tools (each with all its fields, those the client left
    out null, as vLLM's model_dump() gives them to the template; none where with_tools is false) and template
    variables (its template_kwargs, over the server's defaults). A ValueError names the field at fault."""
    check_generation_prompt(request)
    check_chat_template(request)
    return render_chat_template(tokenizer, request.messages, chat_template, request.add_generation_prompt,
                                request.continue_final_message,
                                [t.model_dump() for t in request.tools or []] if with_tools else None,
                                effective_chat_template_kwargs(default_chat_template_kwargs, request.template_kwargs()),
                                content_format)


def chat_request_prompt(tokenizer: Any, request: Union[ChatCompletionRequest, TokenizeChatRequest],
                        chat_template: Optional[str], default_chat_template_kwargs: Optional[dict[str, Any]] = None,
                        content_format: str = "auto") -> list[int]:
    """The prompt token ids of render_chat_request's text, with the request's add_special_tokens."""
    return tokenizer.encode(render_chat_request(tokenizer, request, chat_template, default_chat_template_kwargs,
                                                content_format), add_special_tokens=request.add_special_tokens)


def render_chat_template(tokenizer: Any, messages: list[ChatMessageParam], chat_template: Optional[str],
                         add_generation_prompt: bool = True, continue_final_message: bool = False,
                         tools: Optional[list[dict[str, Any]]] = None,
                         chat_template_kwargs: Optional[dict[str, Any]] = None, content_format: str = "auto") -> str:
    """Raises ValueError when the conversation is malformed or the template rejects it. Tools (OpenAI's shape)
    are given to templates that describe them to the model; chat_template_kwargs are more variables for the
    template, under the arguments given here; content_format is how messages' content reaches it
    (CHAT_TEMPLATE_CONTENT_FORMATS)."""
    turns = conversation(messages, resolve_chat_template_content_format(tokenizer, chat_template, tools or None,
                                                                        content_format))
    kwargs = {**template_variables(chat_template_kwargs), "chat_template": chat_template, "tokenize": False,
              "tools": tools or None, "add_generation_prompt": add_generation_prompt and not continue_final_message,
              "continue_final_message": continue_final_message}
    try:
        return tokenizer.apply_chat_template(turns, **kwargs)
    except Exception as e:  # jinja2 TemplateError, raise_exception() in the template, ...
        raise ValueError(f"messages could not be formatted by the chat template: {e}") from e

