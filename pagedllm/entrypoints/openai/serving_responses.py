"""OpenAIServingResponses: /v1/responses on the chat path. The request becomes a chat request, the chat
completion's stream of chunks becomes the Responses SSE events (unstreamed: the Response object they end with, so the
output items are the same either way), so a response's text is the chat completion's for the same messages, and
every check is the chat endpoint's, its errors naming the Responses field.

Finished responses are kept when the request says store (true by default, as OpenAI's) in a bounded in-memory
ResponseStore: GET /v1/responses/{id} returns one, and previous_response_id continues one's conversation. With a
--reasoning-parser, the reasoning it splits off comes first as a reasoning item (vLLM's), which the conversation
previous_response_id continues leaves out, as vLLM's does (given back as an input item, it is that turn's reasoning).

A background request (OpenAI's and vLLM's ``background``) is answered once its generation has started: the response
queued (vLLM's status for it until it ends), stored, which GET /v1/responses/{id} returns as it stands (then as it ends:
completed, incomplete, cancelled or failed). Its generation runs on as a task, apart from the request that started it;
POST /v1/responses/{id}/cancel stops it and aborts its engine request. A streamed background response's events are kept
(_BackgroundRun), so GET /v1/responses/{id}?stream=true&starting_after=N gives them from sequence number N + 1 on, those
sent so far and then the rest as they come; a client that lost the stream rejoins where it was.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from typing import AsyncIterator, Optional, Sequence, Union

from pydantic import BaseModel

from pagedllm.entrypoints.openai.errors import BadRequestError, NotFoundError, OpenAIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionStreamResponse, random_uuid
from pagedllm.entrypoints.openai.responses_protocol import (IncompleteDetails, OutputText, ReasoningText,
                                                            ResponseCustomToolCall, ResponseError,
                                                            ResponseFunctionToolCall, ResponseOutputMessage,
                                                            ResponseReasoningItem, ResponsesRequest,
                                                            ResponsesResponse, ResponseUsage, chat_messages,
                                                            decode_custom_tool_input,
                                                            decode_custom_tool_input_prefix)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

OutputItem = Union[ResponseReasoningItem, ResponseOutputMessage, ResponseFunctionToolCall, ResponseCustomToolCall]

# How many responses the store keeps (the least recently stored or read go first).
RESPONSE_STORE_SIZE = 1000
# How many streamed background responses keep their events once finished, for readers joining late (the oldest
# go first; one still generating is always kept).
BACKGROUND_STREAMS_KEPT = 100

# The chat request's field -> the Responses request's, for the param (and leading word) of a 400.
_RESPONSES_PARAM = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                    "max_tokens": "max_output_tokens", "response_format": "text.format"}


def _renamed(error: OpenAIError) -> OpenAIError:
    if error.param not in _RESPONSES_PARAM:
        return error
    name = _RESPONSES_PARAM[error.param]
    first, sep, rest = error.message.partition(" ")
    field, equals, value = first.partition("=")  # "max_tokens=5000 cannot be ..." names its value too
    message = f"{name}{equals}{value}{sep}{rest}" if field.rstrip(":") == error.param else error.message
    return type(error)(message, name)


class ResponseStore:
    """The stored responses, each with its conversation: the chat messages that led to it (an earlier response's
    conversation, then the input; no instructions, which OpenAI does not carry over), its own output last. In memory
    and bounded, so it costs at most ``capacity`` responses however long the server runs: past that, the least
    recently stored or read is dropped (and is then unknown, as one never stored). Lost when the server stops."""

    def __init__(self, capacity: int = RESPONSE_STORE_SIZE) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, tuple[ResponsesResponse, list[dict]]] = OrderedDict()

    def put(self, response: ResponsesResponse, conversation: list[dict]) -> None:
        self._entries[response.id] = (response, conversation)
        self._entries.move_to_end(response.id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> Optional[tuple[ResponsesResponse, list[dict]]]:
        """The response and its conversation; None for an id never stored or dropped since."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry


class _ResponseBuilder:
    """One response's fixed parts (id, creation time, the request's echoed settings, the message item's id, so the
    streamed items and the final object agree) and the Response object made from a generation's result."""

    def __init__(self, request: ResponsesRequest, model_name: str, history: Sequence[dict],
                 store: ResponseStore, params: SamplingParams) -> None:
        """history: the conversation of the response the request continues (none: empty). params: what the answer
        is sampled with, whose values the response echoes (vLLM's from_request echoes its sampling_params')."""
        self.request = request
        self.params = params
        self.model_name = model_name
        self.id = request.request_id or f"resp_{random_uuid()}"
        self.created_at = int(time.time())  # the response's, whichever state of it is shown (as vLLM's created_time)
        self.message_id = f"msg_{random_uuid()}"
        self.conversation = [*history, *request.input_messages()]
        self.store = store
        self.final: Optional[ResponsesResponse] = None  # the final response, once finish has made it

    def response(self, status: str, output: list, usage: Optional[ResponseUsage] = None,
                 finish_reason: Optional[str] = None, error: Optional[ResponseError] = None) -> ResponsesResponse:
        r = self.request
        incomplete = finish_reason == "length"
        return ResponsesResponse(
            id=self.id, created_at=self.created_at, model=self.model_name,
            status="incomplete" if incomplete else status, output=output,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if incomplete else None, usage=usage,
            error=error, background=r.background is True, instructions=r.instructions,
            max_output_tokens=self.params.max_tokens, temperature=self.params.temperature, top_p=self.params.top_p,
            top_logprobs=self.params.logprobs, presence_penalty=self.params.presence_penalty,
            frequency_penalty=self.params.frequency_penalty, user=r.user, truncation=r.truncation,
            service_tier=r.service_tier, max_tool_calls=r.max_tool_calls,
            tools=r.tools, tool_choice=r.tool_choice,
            parallel_tool_calls=r.parallel_tool_calls is not False, previous_response_id=r.previous_response_id,
            store=r.store is not False, metadata=r.metadata, reasoning=r.reasoning,
            **({"text": r.text} if r.text is not None and r.text.format is not None else {}))

    def finish(self, output: list, usage: Optional[ResponseUsage], finish_reason: Optional[str]
               ) -> ResponsesResponse:
        """The final Response, stored if the request asks. Its items are completed, but for an answer cut by
        max_output_tokens the last one, which was being generated when the cut came, is incomplete (as OpenAI)."""
        cut = finish_reason == "length"
        items = [item.model_copy(update={"status": "incomplete" if cut and i == len(output) - 1 else "completed"})
                 for i, item in enumerate(output)]
        self.final = self.response("completed", items, usage, finish_reason)
        if self.request.store is not False:
            # reasoning is no part of the conversation a later response continues (chat templates drop it too)
            self.store.put(self.final, self.conversation + chat_messages(
                [item for item in items if not isinstance(item, ResponseReasoningItem)]))
        return self.final

    def store_unfinished(self, status: str, error: Optional[ResponseError] = None) -> ResponsesResponse:
        """A background response's state while it has no final output (queued, cancelled, failed), stored."""
        response = self.response(status, [], error=error)
        self.store.put(response, self.conversation)
        return response

    def message(self, text: str) -> ResponseOutputMessage:
        return ResponseOutputMessage(id=self.message_id, content=[OutputText(text=text)])


class _BackgroundRun:
    """A background response's generation: its task and, when streamed, the events sent so far (event i has
    sequence number i), which each reader replays from where it asks and then follows until the run is done."""

    def __init__(self, streamed: bool) -> None:
        self.streamed = streamed
        self.events: list[str] = []
        self.done = False
        self.task: Optional[asyncio.Task] = None
        self._changed = asyncio.Event()

    def add(self, sent: str) -> None:
        """What the response's stream sent: one event or several (an item's opening events come together)."""
        if self.streamed:
            self.events += [event + "\n\n" for event in sent.split("\n\n") if event]
            self._wake()

    def finish(self) -> None:
        self.done = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, starting_after: int) -> AsyncIterator[str]:
        """The events after sequence number ``starting_after``, those sent and those to come, until the end."""
        index = starting_after + 1
        while True:
            while index < len(self.events):
                yield self.events[index]
                index += 1
            if self.done:
                return
            await self._changed.wait()


class OpenAIServingResponses:
    def __init__(self, serving_chat: OpenAIServingChat) -> None:
        self.serving_chat = serving_chat
        self.store = ResponseStore()
        # Background responses: those generating, and the streamed ones' runs kept for late readers.
        self._running: dict[str, _BackgroundRun] = {}
        self._streams: OrderedDict[str, _BackgroundRun] = OrderedDict()

    def retrieve_responses(self, response_id: str, stream: bool = False, starting_after: Optional[int] = None
                           ) -> Union[ResponsesResponse, AsyncIterator[str]]:
        """A stored response (GET /v1/responses/{id}) as it stands; with ``stream``, a streamed background
        response's events after sequence number ``starting_after`` (default: all). 404 for one not stored (or
        dropped since)."""
        entry = self.store.get(response_id)
        run = self._streams.get(response_id)
        if entry is None and (run is None or not stream):
            raise _not_found(response_id)
        if not stream:
            return entry[0]
        if run is None:
            raise BadRequestError(f"Response with id '{response_id}' was not created with background and stream: "
                                  "it has no events to stream.", "stream")
        if starting_after is not None and starting_after < -1:
            raise BadRequestError(f"starting_after must be at least -1, got {starting_after}.", "starting_after")
        return run.follow(-1 if starting_after is None else starting_after)

    async def cancel_responses(self, response_id: str) -> ResponsesResponse:
        """Stops a background response still generating (POST /v1/responses/{id}/cancel) and aborts its engine
        request; returns it, cancelled. 404 for an unknown id; 400 for a response not generating in the
        background (a synchronous one, or one already finished), as vLLM."""
        run = self._running.get(response_id)
        if run is None:
            if self.store.get(response_id) is None and response_id not in self._streams:
                raise _not_found(response_id)
            raise BadRequestError("Cannot cancel a synchronous response.", "response_id")
        run.task.cancel()
        await asyncio.wait([run.task])
        entry = self.store.get(response_id)
        if entry is None:  # the bounded store dropped it while it ran
            raise _not_found(response_id)
        return entry[0]

    async def create_responses(self, request: ResponsesRequest
                               ) -> Union[ResponsesResponse, AsyncIterator[str]]:
        """A Response, or for stream=True the Responses SSE events; raises OpenAIError before generating. In the
        background, the response queued (streamed: its events so far and to come) once generation has
        started."""
        if request.background and request.store is False:
            raise BadRequestError("background responses need store: a background response is read back by its "
                                  "id.", "background")
        if request.prompt is not None:
            raise BadRequestError("prompt template is not supported", "prompt")
        if request.structured_outputs is not None and request.text is not None and request.text.format is not None:
            raise BadRequestError("Cannot specify both structured_outputs and text.format", "structured_outputs")
        history: list[dict] = []
        if request.previous_response_id is not None:
            previous = self.store.get(request.previous_response_id)
            if previous is None:  # a 404, as vLLM answers it
                raise NotFoundError(f"Previous response with id '{request.previous_response_id}' not found.",
                                    "previous_response_id")
            if previous[0].status == "queued":
                raise BadRequestError(f"Previous response with id '{request.previous_response_id}' is still in "
                                      "progress.", "previous_response_id")
            history = previous[1]
        chat_request = request.to_chat_request(history)
        try:
            params, result = await self.serving_chat.start_chat_completion(chat_request, cached_tokens_always=True)
        except OpenAIError as e:
            raise _renamed(e) from e
        builder = _ResponseBuilder(request, self.serving_chat.models.check_model(request.model), history,
                                   self.store, params)
        if request.background:
            return self._start_in_background(builder, result)
        if request.stream:
            return self._stream(builder, result)
        return await self._unstreamed(builder, result)

    def _start_in_background(self, builder: _ResponseBuilder, chunks: AsyncIterator[str]
                             ) -> Union[ResponsesResponse, AsyncIterator[str]]:
        run = _BackgroundRun(streamed=bool(builder.request.stream))
        queued = builder.store_unfinished("queued")
        run.task = asyncio.get_running_loop().create_task(self._generate_in_background(builder, chunks, run))
        self._running[builder.id] = run
        if run.streamed:
            self._streams[builder.id] = run
            finished = [i for i, kept in self._streams.items() if kept.done]
            for response_id in finished[:max(len(finished) - BACKGROUND_STREAMS_KEPT, 0)]:
                del self._streams[response_id]
            return run.follow(-1)
        return queued

    async def _generate_in_background(self, builder: _ResponseBuilder, chunks: AsyncIterator[str],
                                      run: _BackgroundRun) -> None:
        """Runs the response's event stream to its end; builder.finish stores the final response. A stream that
        ends in an error event (or an exception) leaves it failed, a cancel cancelled."""
        error: Optional[ResponseError] = None
        try:
            async for sent in self._stream(builder, chunks):
                run.add(sent)
                if (body := _error_event(sent)) is not None:
                    error = ResponseError(code=str(body.get("code")), message=body.get("message") or "")
            if error is not None:
                builder.store_unfinished("failed", error)
        except asyncio.CancelledError:
            builder.store_unfinished("cancelled")
            raise
        except Exception as e:  # the response fails; the server serves on
            logger.exception("Background response %s failed", builder.id)
            builder.store_unfinished("failed", ResponseError(code="server_error", message=str(e)))
        finally:
            run.finish()
            self._running.pop(builder.id, None)

    async def _unstreamed(self, builder: _ResponseBuilder, chunks: AsyncIterator[str]) -> ResponsesResponse:
        """The final response of the events a stream of it sends, so that its output items are the streamed
        response's (text after a function call a message of its own, as streamed); an error event is raised as the
        error it reports, with its status."""
        async for sent in self._stream(builder, chunks):
            if (body := _error_event(sent)) is not None:
                error = OpenAIError(body["message"], body.get("param"))
                error.status_code = body["code"]
                raise error
        return builder.final

    async def _stream(self, builder: _ResponseBuilder, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """The events OpenAI sends, in its order: output items one after another, each done before the next is
        added (as vLLM's SimpleStreamingEventProcessor closes the current item before it opens one). Items are
        numbered as they open: a message at its first text (text after a function call opens another message), a
        function call at its first delta (which carries its id and name), its arguments then streaming as the chat
        stream's tool-call parser reads them (a custom tool's call its input, read out of its shim's), one call after
        another; the last item is done once the answer is."""
        events = _EventStream()
        yield events.send("response.created", response=builder.response("in_progress", []))
        yield events.send("response.in_progress", response=builder.response("in_progress", []))
        output: list = []  # the items so far; the last one is open (being generated), the others done
        texts: dict[int, str] = {}  # each message's text, by output index
        # With include's output logprobs: each message's, by output index, and those of text not sent yet (held).
        logprobs_on, text_logprobs, held_logprobs = builder.request.output_logprobs, {}, []
        reasoning_texts: dict[int, str] = {}  # each reasoning item's text, by output index
        message_index, finish_reason, usage = None, None, None  # message_index: the open item, if it is a message
        # The text is the chat content: as generated, or with tool calls read out of it, stripped (chat's content
        # then), each message's, so that whitespace around the calls opens no message. held: whitespace not sent yet.
        held, strip = "", builder.request.chat_tool_choice != "none"
        call_indices: dict[int, int] = {}  # the chat stream's tool-call index -> the call's output index
        shim_arguments: dict[int, str] = {}  # each custom tool call's function shim's arguments, by output index

        def finished(index: int) -> OutputItem:
            """Item ``index`` as it is done: completed, a message or reasoning with all its text."""
            item = output[index]
            if isinstance(item, ResponseOutputMessage):
                logprobs = text_logprobs[index] if logprobs_on else None
                item = item.model_copy(update={"content": [OutputText(text=texts[index], logprobs=logprobs)]})
            elif isinstance(item, ResponseReasoningItem):
                item = item.model_copy(update={"content": [ReasoningText(text=reasoning_texts[index])]})
            elif isinstance(item, ResponseCustomToolCall):
                item = item.model_copy(update={"input": decode_custom_tool_input(shim_arguments[index])})
            return item.model_copy(update={"status": "completed"})

        def open_item(item: OutputItem) -> str:
            """Ends the open item (if any) and opens ``item`` after it."""
            sent = ""
            if output:
                output[-1] = finished(len(output) - 1)
                sent = _item_done(events, len(output) - 1, output[-1])
            output.append(item)
            index = len(output) - 1
            if isinstance(item, ResponseOutputMessage):
                texts[index], text_logprobs[index] = "", []
                return sent + _open_message(events, item.id, index)
            sent += events.send("response.output_item.added", output_index=index, item=item)
            if isinstance(item, ResponseReasoningItem):
                reasoning_texts[index] = ""
                sent += events.send("response.content_part.added", item_id=item.id, output_index=index,
                                    content_index=0, part=ReasoningText(text=""))
            return sent

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
                usage = ResponseUsage.of_chat(chunk.usage)
            for choice in chunk.choices:
                finish_reason = choice.finish_reason or finish_reason
                if choice.delta.reasoning:  # what a --reasoning-parser split off: a reasoning item's text
                    if not output or not isinstance(output[-1], ResponseReasoningItem):
                        yield open_item(ResponseReasoningItem(status="in_progress"))
                        message_index = None
                    index = len(output) - 1
                    reasoning_texts[index] += choice.delta.reasoning
                    yield events.send("response.reasoning_text.delta", item_id=output[index].id,
                                      output_index=index, content_index=0, delta=choice.delta.reasoning)
                held += choice.delta.content or ""
                if choice.delta.content and choice.logprobs is not None:  # the tokens of this text (not a call's)
                    held_logprobs += choice.logprobs.content or ()
                if strip and message_index is None:
                    held = held.lstrip()  # leading whitespace (before or between tool calls) opens no message
                delta = held.rstrip() if strip else held  # trailing whitespace waits: it may end the answer
                if delta:
                    held = held[len(delta):]
                    if message_index is None:
                        # The answer's first message keeps the builder's id, as the unstreamed response has it.
                        yield open_item(builder.message("") if not texts else ResponseOutputMessage())
                        message_index = len(output) - 1
                    texts[message_index] += delta
                    text_logprobs[message_index] += held_logprobs
                    yield events.send("response.output_text.delta", item_id=output[message_index].id,
                                      output_index=message_index, content_index=0, delta=delta,
                                      logprobs=[logprob.model_dump() for logprob in held_logprobs])
                    held_logprobs = []
                for delta_call in choice.delta.tool_calls or ():
                    function = delta_call.function
                    if delta_call.index not in call_indices:
                        if function.name in builder.request.custom_tool_names:
                            shim_arguments[len(output)] = ""
                            yield open_item(ResponseCustomToolCall(call_id=delta_call.id, name=function.name,
                                                                   input="", status="in_progress"))
                        else:
                            name, namespace = builder.request.namespace_of(function.name)
                            yield open_item(ResponseFunctionToolCall(call_id=delta_call.id, name=name,
                                                                     namespace=namespace, arguments="",
                                                                     status="in_progress"))
                        call_indices[delta_call.index] = len(output) - 1
                        message_index, held_logprobs = None, []  # held whitespace's: no message takes it
                    index = call_indices[delta_call.index]
                    if index in shim_arguments and function is not None and function.arguments:
                        # A custom tool's input streams as it is read out of its shim's arguments (vLLM's).
                        shim_arguments[index] += function.arguments
                        read = decode_custom_tool_input_prefix(shim_arguments[index])
                        if len(read) > len(output[index].input) and read.startswith(output[index].input):
                            more, output[index].input = read[len(output[index].input):], read
                            yield events.send("response.custom_tool_call_input.delta", item_id=output[index].id,
                                              output_index=index, delta=more)
                    elif function is not None and function.arguments:
                        output[index].arguments += function.arguments
                        yield events.send("response.function_call_arguments.delta", item_id=output[index].id,
                                          output_index=index, delta=function.arguments)
        if not output:  # no text and no call: an empty message (OpenAI's output is never empty)
            yield open_item(builder.message(""))
        output[-1] = finished(len(output) - 1)
        final = builder.finish(output, usage, finish_reason)
        yield _item_done(events, len(final.output) - 1, final.output[-1])
        # vLLM's last event, also for an answer cut by max_output_tokens: its response's status is "incomplete" then
        # (OpenAI's stream would end with a response.incomplete event instead).
        yield events.send("response.completed", response=final)


def _error_event(sent: str) -> Optional[dict]:
    """The fields of an error event ({"code", "message", "param"}: OpenAI's stream error); None for another event."""
    return json.loads(sent.partition("data: ")[2]) if sent.startswith("event: error\n") else None


def _not_found(response_id: str) -> NotFoundError:
    return NotFoundError(f"Response with id '{response_id}' not found.", "response_id")


def _open_message(events: "_EventStream", item_id: str, output_index: int) -> str:
    """The events opening a message item."""
    item = ResponseOutputMessage(id=item_id, status="in_progress")
    return (events.send("response.output_item.added", output_index=output_index, item=item)
            + events.send("response.content_part.added", item_id=item_id, output_index=output_index,
                          content_index=0, part=OutputText(text="")))


def _item_done(events: "_EventStream", output_index: int, item: OutputItem) -> str:
    """The events ending an output item, given as it is done."""
    if isinstance(item, ResponseOutputMessage):
        sent = (events.send("response.output_text.done", item_id=item.id, output_index=output_index,
                            content_index=0, text=item.content[0].text,
                            logprobs=[logprob.model_dump() for logprob in item.content[0].logprobs or ()])
                + events.send("response.content_part.done", item_id=item.id, output_index=output_index,
                              content_index=0, part=item.content[0]))
    elif isinstance(item, ResponseReasoningItem):
        sent = (events.send("response.reasoning_text.done", item_id=item.id, output_index=output_index,
                            content_index=0, text=item.content[0].text)
                + events.send("response.content_part.done", item_id=item.id, output_index=output_index,
                              content_index=0, part=item.content[0]))
    elif isinstance(item, ResponseCustomToolCall):
        sent = events.send("response.custom_tool_call_input.done", item_id=item.id, output_index=output_index,
                           input=item.input)
    else:
        sent = events.send("response.function_call_arguments.done", item_id=item.id, output_index=output_index,
                           arguments=item.arguments)
    return sent + events.send("response.output_item.done", output_index=output_index, item=item)


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
