"""OpenAIServingResponses: /v1/responses on the chat path. The request becomes a chat request, the chat
completion (or its stream of chunks) becomes a Response object (or the Responses SSE events), so a response's text
is the chat completion's for the same messages, and every check is the chat endpoint's, its errors naming the
Responses field. Responses are not stored: previous_response_id is refused.
"""
from __future__ import annotations

import json
from typing import AsyncIterator, Optional, Union

from pydantic import BaseModel

from pagedllm.entrypoints.openai.errors import BadRequestError, OpenAIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionResponse, ChatCompletionStreamResponse, random_uuid
from pagedllm.entrypoints.openai.responses_protocol import (IncompleteDetails, OutputText,
                                                            ResponseFunctionToolCall, ResponseOutputMessage,
                                                            ResponsesRequest, ResponsesResponse, ResponseUsage)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat

# The chat request's field -> the Responses request's, for the param (and leading word) of a 400.
_RESPONSES_PARAM = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                    "max_tokens": "max_output_tokens"}


def _renamed(error: OpenAIError) -> OpenAIError:
    if error.param not in _RESPONSES_PARAM:
        return error
    name = _RESPONSES_PARAM[error.param]
    first, sep, rest = error.message.partition(" ")
    message = f"{name}{sep}{rest}" if first.rstrip(":") == error.param else error.message
    return type(error)(message, name)


class _ResponseBuilder:
    """One response's fixed parts (id, the request's echoed settings, the message item's id, so the streamed
    items and the final object agree) and the Response object made from a generation's result."""

    def __init__(self, request: ResponsesRequest, model_name: str) -> None:
        self.request = request
        self.model_name = model_name
        self.id = f"resp_{random_uuid()}"
        self.message_id = f"msg_{random_uuid()}"

    def response(self, status: str, output: list, usage: Optional[ResponseUsage] = None,
                 finish_reason: Optional[str] = None) -> ResponsesResponse:
        r = self.request
        incomplete = finish_reason == "length"
        return ResponsesResponse(
            id=self.id, model=self.model_name, status="incomplete" if incomplete else status, output=output,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if incomplete else None, usage=usage,
            instructions=r.instructions, max_output_tokens=r.max_output_tokens, temperature=r.temperature,
            top_p=r.top_p, tools=r.tools or [], tool_choice=r.tool_choice or "auto",
            parallel_tool_calls=r.parallel_tool_calls is not False, metadata=r.metadata)

    def message(self, text: str) -> ResponseOutputMessage:
        return ResponseOutputMessage(id=self.message_id, content=[OutputText(text=text)])

    def output(self, text: Optional[str], calls: list[dict]) -> list:
        """A message item when there is text or no function call (as OpenAI: a reply is never empty of items),
        then a function_call item per call ({"call_id", "name", "arguments"})."""
        items: list = [self.message(text or "")] if text or not calls else []
        return items + [ResponseFunctionToolCall(**call) for call in calls]


class OpenAIServingResponses:
    def __init__(self, serving_chat: OpenAIServingChat) -> None:
        self.serving_chat = serving_chat

    async def create_responses(self, request: ResponsesRequest
                               ) -> Union[ResponsesResponse, AsyncIterator[str]]:
        """A Response, or for stream=True the Responses SSE events; raises OpenAIError before generating."""
        if request.previous_response_id is not None:
            raise BadRequestError("previous_response_id is not supported: this server does not store responses.",
                                  "previous_response_id")
        chat_request = request.to_chat_request()
        try:
            result = await self.serving_chat.create_chat_completion(chat_request)
        except OpenAIError as e:
            raise _renamed(e) from e
        builder = _ResponseBuilder(request, self.serving_chat.models.check_model(request.model))
        if isinstance(result, ChatCompletionResponse):
            return self._from_chat(builder, result)
        return self._stream(builder, result)

    @staticmethod
    def _from_chat(builder: _ResponseBuilder, chat: ChatCompletionResponse) -> ResponsesResponse:
        choice = chat.choices[0]
        calls = [{"call_id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls]
        usage = ResponseUsage(input_tokens=chat.usage.prompt_tokens, output_tokens=chat.usage.completion_tokens,
                              total_tokens=chat.usage.total_tokens)
        return builder.response("completed", builder.output(choice.message.content, calls), usage,
                                choice.finish_reason)

    async def _stream(self, builder: _ResponseBuilder, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """The events OpenAI sends, in its order; function calls are sent whole once the text is done (the
        chat stream's tool-call parser hands them over by then)."""
        events = _EventStream()
        yield events.send("response.created", response=builder.response("in_progress", []))
        yield events.send("response.in_progress", response=builder.response("in_progress", []))
        text, message_open, finish_reason, usage = "", False, None, None
        calls: dict[int, dict] = {}
        async for data in chunks:
            payload = data.removeprefix("data: ").strip()
            if payload == "[DONE]":
                break
            body = json.loads(payload)
            if "error" in body:  # the chat stream failed: OpenAI's stream ends with an error event
                yield events.send("error", **{k: body["error"][k] for k in ("code", "message", "param")})
                return
            chunk = ChatCompletionStreamResponse.model_validate(body)
            if chunk.usage is not None:
                usage = ResponseUsage(input_tokens=chunk.usage.prompt_tokens,
                                      output_tokens=chunk.usage.completion_tokens,
                                      total_tokens=chunk.usage.total_tokens)
            for choice in chunk.choices:
                finish_reason = choice.finish_reason or finish_reason
                for delta_call in choice.delta.tool_calls or ():
                    call = calls.setdefault(delta_call.index, {"call_id": "", "name": "", "arguments": ""})
                    call["call_id"] = delta_call.id or call["call_id"]
                    if delta_call.function is not None:
                        call["name"] += delta_call.function.name or ""
                        call["arguments"] += delta_call.function.arguments or ""
                if choice.delta.content:
                    if not message_open:
                        message_open = True
                        yield _open_message(events, builder)
                    text += choice.delta.content
                    yield events.send("response.output_text.delta", item_id=builder.message_id, output_index=0,
                                      content_index=0, delta=choice.delta.content, logprobs=[])
        output = builder.output(text, [calls[i] for i in sorted(calls)])
        for index, item in enumerate(output):
            if isinstance(item, ResponseOutputMessage):
                if not message_open:
                    yield _open_message(events, builder)
                yield events.send("response.output_text.done", item_id=item.id, output_index=index,
                                  content_index=0, text=text, logprobs=[])
                yield events.send("response.content_part.done", item_id=item.id, output_index=index,
                                  content_index=0, part=item.content[0])
            else:
                yield events.send("response.output_item.added", output_index=index,
                                  item=item.model_copy(update={"status": "in_progress", "arguments": ""}))
                yield events.send("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                                  delta=item.arguments)
                yield events.send("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                  arguments=item.arguments)
            yield events.send("response.output_item.done", output_index=index, item=item)
        final = builder.response("completed", output, usage, finish_reason)
        yield events.send("response.incomplete" if final.status == "incomplete" else "response.completed",
                          response=final)


def _open_message(events: "_EventStream", builder: _ResponseBuilder) -> str:
    """The events opening the message item (always output 0: function calls come after it)."""
    item = ResponseOutputMessage(id=builder.message_id, status="in_progress")
    return (events.send("response.output_item.added", output_index=0, item=item)
            + events.send("response.content_part.added", item_id=builder.message_id, output_index=0,
                          content_index=0, part=OutputText(text="")))


class _EventStream:
    """Responses SSE framing: `event: <type>` and `data: {...}` with the type and a sequence_number counting the
    stream's events from 0, as OpenAI sends them."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def send(self, type: str, **fields) -> str:
        data = {"type": type, "sequence_number": self.sequence_number,
                **{k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v for k, v in fields.items()}}
        self.sequence_number += 1
        return f"event: {type}\ndata: {json.dumps(data)}\n\n"
