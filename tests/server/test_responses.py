"""/v1/responses through the official openai client: the greedy chat answer as a Response, streamed as the
Responses events, a function call with its arguments streamed, stored responses (GET, previous_response_id),
background responses (read back, rejoined as a stream, cancelled), and 400s naming the field."""
from __future__ import annotations

import json
import time

import openai
import pytest

from pagedllm.entrypoints.openai.responses_protocol import ResponseFunctionToolCall, ResponsesRequest, ResponsesResponse
from pagedllm.entrypoints.openai.serving_responses import ResponseStore
from pagedllm.sampling_params import SamplingParams
from tests.server.conftest import MAX_MODEL_LEN
from tests.server.test_load import wait_until_idle

MODEL = "smollm2-135m-instruct"
QUESTION = "What is the capital of France?"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 30}},
           "required": ["city"]}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER}


@pytest.fixture(scope="module")
def client(server):
    return server.get_client()


@pytest.fixture(scope="module")
def chat_text(client) -> str:
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                          temperature=0, max_tokens=20)
    return chat.choices[0].message.content


def test_response_is_the_greedy_chat_answer(client, chat_text):
    response = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=20)
    assert response.id.startswith("resp_") and response.object == "response"
    assert "Paris" in response.output_text and response.output_text == chat_text
    [message] = response.output
    assert (message.type, message.role, message.content[0].type) == ("message", "assistant", "output_text")
    usage = response.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    # the chat_text fixture's prompt was this one: its whole blocks come from the prefix cache (vLLM reports them
    # whatever --enable-prompt-tokens-details says)
    assert usage.input_tokens_details.cached_tokens == (usage.input_tokens - 1) // 16 * 16 > 0
    if usage.output_tokens == 20:  # cut by max_output_tokens
        assert (response.status, response.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    else:
        assert response.status == "completed"

    # The same question as a message list with input_text parts.
    listed = client.responses.create(model=MODEL, temperature=0, max_output_tokens=20, input=[
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    assert listed.output_text == chat_text


def test_stream_sends_the_responses_events(client, chat_text):
    events = list(client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=20,
                                          stream=True))
    types = [e.type for e in events]
    deltas = [i for i, t in enumerate(types) if t == "response.output_text.delta"]
    assert deltas and deltas == list(range(deltas[0], deltas[-1] + 1))
    assert types[:deltas[0]] == ["response.created", "response.in_progress", "response.output_item.added",
                                 "response.content_part.added"]
    assert types[deltas[-1] + 1:-1] == ["response.output_text.done", "response.content_part.done",
                                        "response.output_item.done"]
    assert types[-1] == "response.completed"  # vLLM's, also where max_output_tokens cut the answer
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(events[i].delta for i in deltas)
    assert text == chat_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens > 0


def test_output_text_logprobs_come_when_included(client):
    """vLLM's include "message.output_text.logprobs" with top_logprobs: each output token's logprob and its top
    alternatives, in the output text and in the deltas that stream it; none without the include."""
    ask = {"model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": 6,
           "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    response = client.responses.create(**ask)
    logprobs = response.output[0].content[0].logprobs
    assert len(logprobs) == response.usage.output_tokens
    assert "".join(lp.token for lp in logprobs) == response.output_text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in logprobs)
    events = list(client.responses.create(**ask, stream=True))
    assert [lp.model_dump() for e in events if e.type == "response.output_text.delta" for lp in e.logprobs] == [
        lp.model_dump() for lp in logprobs]
    assert events[-1].response.output[0].content[0].logprobs == logprobs
    assert client.responses.create(**{**ask, "include": None}).output[0].content[0].logprobs is None


def test_events_are_framed_as_openai_sends_them(server):
    with server.http() as http:
        body = http.post("/v1/responses", json={"model": MODEL, "input": QUESTION, "max_output_tokens": 2,
                                                "stream": True}).text
    first = body.split("\n\n")[0].split("\n")
    assert first[0] == "event: response.created"
    assert json.loads(first[1].removeprefix("data: "))["type"] == "response.created"
    *_, last_type, last_data = body.rstrip().split("\n")
    assert last_type == "event: response.completed"  # vLLM's, with the response cut by max_output_tokens
    assert json.loads(last_data.removeprefix("data: "))["response"]["incomplete_details"] == {
        "reason": "max_output_tokens"}


def test_cut_answer_is_incomplete_down_to_its_message(client):
    ask = {"model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": 2}
    response = client.responses.create(**ask)
    assert (response.status, response.output[0].status) == ("incomplete", "incomplete")
    events = list(client.responses.create(**ask, stream=True))
    [added] = [e.item for e in events if e.type == "response.output_item.added"]
    [done] = [e.item for e in events if e.type == "response.output_item.done"]
    assert (added.status, done.status) == ("in_progress", "incomplete")
    assert events[-1].type == "response.completed" and events[-1].response.status == "incomplete"
    assert events[-1].response.output[0].status == "incomplete"
    whole = client.responses.create(**{**ask, "max_output_tokens": 200})  # the greedy answer ends well before
    assert (whole.status, whole.output[0].status) == ("completed", "completed")


def test_an_incomplete_message_given_back_last_is_continued(client):
    """As vLLM's should_continue_final_message: an input ending with a message still in_progress or incomplete (an
    answer cut short, given back) is continued where it stopped, not answered by a new assistant turn."""
    ask = {"model": MODEL, "temperature": 0, "max_output_tokens": 200}
    whole = client.responses.create(**ask, input=QUESTION)
    cut = client.responses.create(**{**ask, "max_output_tokens": 3}, input=QUESTION)
    assert cut.output[0].status == "incomplete" and whole.output_text.startswith(cut.output_text)
    rest = client.responses.create(**ask, input=[{"role": "user", "content": QUESTION}, cut.output[0].model_dump()])
    assert cut.output_text + rest.output_text == whole.output_text


def test_only_a_message_given_back_last_is_continued():
    """A last reasoning item in_progress or incomplete is not continued (vLLM's should_continue_final_message names
    it, then fails on it): as an assistant turn with no text, continuing it would open the answer after the turn
    closed, not where the reasoning stopped."""
    for status, continued in (("incomplete", True), ("in_progress", True), ("completed", False), (None, False)):
        message = {"type": "message", "role": "assistant", "content": "Paris is", "status": status}
        reasoning = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "The user asks"}],
                     "status": status}
        for item, expected in ((message, continued), (reasoning, False)):
            request = ResponsesRequest.model_validate({"model": MODEL, "input": [{"role": "user", "content": "Hi"},
                                                                                   item]})
            assert request.continues_final_message is expected, (item["type"], status)


def test_required_tool_choice_gives_a_function_call(client):
    ask = {"model": MODEL, "input": "What is the weather like in Paris?", "tools": [TOOL], "tool_choice": "required",
           "temperature": 0, "max_output_tokens": 60}
    response = client.responses.create(**ask)
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    assert isinstance(json.loads(call.arguments)["city"], str)

    events = list(client.responses.create(**ask, stream=True))
    arguments = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert arguments == [call.arguments]
    # The arguments stream as they are generated: several deltas, joined the non-streamed arguments.
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 2 and "".join(deltas) == call.arguments
    assert events[-1].type == "response.completed"
    [streamed] = [item for item in events[-1].response.output if item.type == "function_call"]
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)


def test_auto_tool_choice_without_tools_is_none(client):
    """As vLLM's: tool_choice "auto" without tools asks nothing of tools: answered, echoing "none" (as a request with
    no tool_choice and no tools does); "required" without tools is still a 400."""
    for extra in ({"tool_choice": "auto"}, {"tool_choice": "auto", "tools": []}, {}):
        assert client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, **extra).tool_choice == "none"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input=QUESTION, tool_choice="required")
    assert info.value.body["param"] == "tool_choice"


def test_stored_response_is_retrieved_and_continued(client):
    ask = {"model": MODEL, "temperature": 0, "max_output_tokens": 8}
    first = client.responses.create(**ask, input="My name is Ada.", instructions="Answer in one sentence.")
    assert first.store and client.responses.retrieve(first.id) == first
    events = list(client.responses.create(**ask, input=QUESTION, stream=True))
    assert client.responses.retrieve(events[-1].response.id) == events[-1].response
    unstored = client.responses.create(**ask, input=QUESTION, store=False)
    for response_id in (unstored.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError) as info:
            client.responses.retrieve(response_id)
        assert info.value.body == {"message": f"Response with id '{response_id}' not found.",
                                   "type": "NotFoundError", "param": "response_id", "code": 404}

    # Continuing it is answering its input and output, then the new input (its instructions are not carried).
    follow_up = "What is my name?"
    continued = client.responses.create(**ask, input=follow_up, previous_response_id=first.id)
    by_hand = client.responses.create(**ask, store=False, input=[
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": follow_up}])
    assert continued.previous_response_id == first.id
    assert continued.usage.input_tokens == by_hand.usage.input_tokens
    assert continued.output_text == by_hand.output_text


def test_a_turn_given_back_as_items_is_one_assistant_message():
    """As vLLM builds the conversation: a response's output given back as input (text, its parallel function calls)
    is one assistant message with all its tool calls, as the model wrote the turn, not an assistant turn per item;
    the stored conversation a previous_response_id continues is made the same way."""
    from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
    from pagedllm.entrypoints.openai.serving_responses import _ResponseBuilder

    calls = [{"type": "function_call", "call_id": f"call_{i}", "name": "get_weather", "arguments": f'{{"city": "{c}"}}'}
             for i, c in enumerate(["Paris", "Rome"])]
    # a call's output is a string or, as OpenAI's and vLLM's take it, a list of text parts
    parts = [{"type": "input_text", "text": "sun"}, {"type": "input_text", "text": "ny"}]
    results = [{"type": "function_call_output", "call_id": "call_0", "output": "sunny"},
               {"type": "function_call_output", "call_id": "call_1", "output": parts}]
    request = ResponsesRequest.model_validate({"tools": [TOOL], "input": [
        {"role": "user", "content": "Weather in Paris and Rome?"}, {"type": "reasoning", "summary": []},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]}, *calls, *results,
        {"role": "assistant", "content": "Sunny in both."}]})
    messages = [m.model_dump(exclude_none=True) for m in request.to_chat_request().messages]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool", "assistant"]
    assert messages[1]["content"] == "Checking."
    assert [call["id"] for call in messages[1]["tool_calls"]] == ["call_0", "call_1"]
    assert [m["content"] for m in messages[2:4]] == ["sunny", "sunny"]

    # A reasoning item is the reasoning of the turn it opens, as vLLM gives it to the template (its content's text,
    # else its summary's).
    thoughts = [({"content": [{"type": "reasoning_text", "text": "Two calls."}], "summary": []}, "Two calls."),
                ({"summary": [{"type": "summary_text", "text": "In short."}]}, "In short.")]
    for reasoning, text in thoughts:
        thought = ResponsesRequest.model_validate({"tools": [TOOL], "input": [
            {"role": "user", "content": "Weather in Paris and Rome?"}, {"type": "reasoning", **reasoning}, *calls,
            *results]}).to_chat_request().messages[1].model_dump(exclude_none=True)
        assert thought["reasoning"] == text and len(thought["tool_calls"]) == 2

    builder = _ResponseBuilder(ResponsesRequest(input="Weather in Paris and Rome?"), MODEL, [], ResponseStore(),
                               SamplingParams())
    output = [builder.message("Checking."), *(ResponseFunctionToolCall.model_validate(c) for c in calls)]
    builder.finish(output, None, "tool_calls")
    [user, assistant] = builder.store.get(builder.id)[1]
    assert assistant["content"] == "Checking." and len(assistant["tool_calls"]) == 2


def test_empty_instructions_are_none():
    """As vLLM's: no system message for empty instructions (it would replace the template's default one)."""
    from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest

    for instructions in ("", None):
        chat = ResponsesRequest(input=QUESTION, instructions=instructions).to_chat_request()
        assert [m.role for m in chat.messages] == ["user"]


def test_request_id_is_the_responses_id(client):
    """vLLM's request_id field: the response is created, stored and read back under it."""
    response = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2,
                                       extra_body={"request_id": "resp_chosen"})
    assert response.id == "resp_chosen" and client.responses.retrieve("resp_chosen") == response


def test_store_is_bounded_and_drops_the_least_recently_used():
    store = ResponseStore(capacity=2)
    a, b, c = (ResponsesResponse(id=f"resp_{name}", model=MODEL, status="completed") for name in "abc")
    store.put(a, [])
    store.put(b, [])
    assert store.get(a.id) == (a, [])  # a read keeps it
    store.put(c, [])
    assert store.get(b.id) is None and store.get(a.id) and store.get(c.id)


def test_a_response_keeps_its_creation_time(monkeypatch):
    """created_at is when the response was created, in every state of it shown (queued, then done)."""
    from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
    from pagedllm.entrypoints.openai.serving_responses import _ResponseBuilder

    now = [1000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    builder = _ResponseBuilder(ResponsesRequest(input="x", background=True), MODEL, [], ResponseStore(),
                               SamplingParams())
    queued = builder.store_unfinished("queued")
    now[0] += 5
    done = builder.finish([builder.message("Hi.")], None, "stop")
    assert queued.created_at == done.created_at == 1000


def test_a_response_echoes_the_sampling_it_was_generated_with(client):
    """As vLLM's from_request (its sampling params'): temperature, top_p and max_output_tokens the answer was
    generated with (the request's, else the generation config's, else the engine's defaults, and the budget the
    context left), not null; and the request's reasoning settings, user and truncation."""
    from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
    from pagedllm.entrypoints.openai.serving_responses import _ResponseBuilder

    response = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, temperature=0.5, top_p=0.9,
                                       reasoning={"effort": "low"}, user="ada", truncation="auto")
    assert (response.temperature, response.top_p, response.reasoning.effort) == (0.5, 0.9, "low")
    assert (response.max_output_tokens, response.user, response.truncation) == (2, "ada", "auto")
    unbounded = client.responses.create(model=MODEL, input=QUESTION, temperature=0, top_p=0.5, stream=True)
    *_, last = unbounded
    assert last.response.max_output_tokens == MAX_MODEL_LEN - last.response.usage.input_tokens
    assert (last.response.top_p, last.response.truncation, last.response.user) == (1.0, "disabled", None)  # greedy
    request = ResponsesRequest(input="x")
    params = request.to_chat_request().to_sampling_params(16, {"temperature": 0.6})
    builder = _ResponseBuilder(request, MODEL, [], ResponseStore(), params)
    done = builder.finish([builder.message("Hi.")], None, "stop")
    assert (done.temperature, done.top_p, done.max_output_tokens) == (0.6, 1.0, 16)


def test_a_response_echoes_its_service_tier_and_max_tool_calls():
    """As vLLM's from_request: the request's service_tier ("auto" when it gives none) and max_tool_calls are echoed;
    a tier OpenAI has not is refused naming the field."""
    import pydantic

    from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
    from pagedllm.entrypoints.openai.serving_responses import _ResponseBuilder

    for fields, echoed in (({}, ("auto", None)), ({"service_tier": "flex", "max_tool_calls": 3}, ("flex", 3))):
        request = ResponsesRequest(input="x", **fields)
        builder = _ResponseBuilder(request, MODEL, [], ResponseStore(), request.to_chat_request().to_sampling_params(
            16, {}))
        done = builder.finish([builder.message("Hi.")], None, "stop")
        assert (done.service_tier, done.max_tool_calls) == echoed
        assert json.loads(done.model_dump_json())["service_tier"] == echoed[0]
    with pytest.raises(pydantic.ValidationError, match="service_tier"):
        ResponsesRequest(input="x", service_tier="fastest")


def test_text_format_constrains_the_output(client):
    """text.format (OpenAI's structured output for Responses) is chat's response_format: the text is JSON of the
    schema, and the response echoes the format."""
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}}, "required": ["capital"],
              "additionalProperties": False}
    response = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=40, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    assert set(json.loads(response.output_text)) == {"capital"}
    assert response.text.format.type == "json_schema" and response.text.format.schema_ == schema  # echoed as given


def test_structured_outputs_constrain_the_output(client):
    """vLLM's structured_outputs extra constrains the text as chat's does; given beside text.format it is vLLM's 400
    naming it, rather than either one silently applied."""
    choices = ["Lyon", "Nice"]
    response = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=10, temperature=0,
                                       extra_body={"structured_outputs": {"choice": choices}})
    assert response.output_text in choices
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input=QUESTION, text={"format": {"type": "text"}},
                                extra_body={"structured_outputs": {"choice": choices}})
    assert info.value.body["param"] == "structured_outputs"


def test_truncation_auto_keeps_the_prompts_last_tokens(client):
    """vLLM's truncation "auto" (truncate_prompt_tokens -1): an input past the context is cut to its last
    max_model_len - 1 tokens, leaving room for one of output; "disabled" (the default) refuses it."""
    long_input = "word " * (MAX_MODEL_LEN + 100)
    response = client.responses.create(model=MODEL, input=long_input, truncation="auto", max_output_tokens=1)
    assert response.usage.input_tokens == MAX_MODEL_LEN - 1 and response.truncation == "auto"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input=long_input, max_output_tokens=1)
    assert info.value.body["param"] == "input"


@pytest.mark.parametrize("extra, param", [
    ({"temperature": "hot"}, "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": None}, "tool_choice"),  # not Optional, as vLLM's (OpenAI's ToolChoice)
    ({"tools": None}, "tools"),  # a list, not Optional, as vLLM's
    # A bad input part or item is named by its path, as OpenAI names it.
    ({"input": [{"role": "user", "content": QUESTION},
                {"role": "user", "content": [{"type": "input_image", "text": "x"}]}]}, "input[1].content[0].type"),
    ({"input": [{"type": "function_call", "call_id": 7, "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "web_search_call"}]}, "input[0]"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objekt"}}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format"),  # no name
    # OpenAI's stored prompt templates, which vLLM refuses rather than answer without them.
    ({"prompt": {"id": "pmpt_123", "variables": {"city": "Paris"}}}, "prompt"),
])
def test_bad_field_is_a_400_naming_it(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**{"model": MODEL, "input": QUESTION, **extra})
    assert info.value.body["param"] == param


def test_an_unknown_previous_response_is_a_404():
    """As vLLM answers it (not found), naming the field."""
    import asyncio

    from pagedllm.entrypoints.openai.errors import NotFoundError
    from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
    from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses

    with pytest.raises(NotFoundError) as info:
        asyncio.run(OpenAIServingResponses(None).create_responses(
            ResponsesRequest(input=QUESTION, previous_response_id="resp_123")))
    assert (info.value.status_code, info.value.param) == (404, "previous_response_id")


def test_vllm_sampling_extras_are_the_chat_requests(client):
    """vLLM's sampling extras (stop, seed, top_k, ...) are applied as chat applies them, and refused as chat refuses
    them, naming the field."""
    messages = [{"role": "user", "content": QUESTION}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=20, stop=["Paris"])
    response = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=20,
                                       extra_body={"stop": ["Paris"]})
    assert response.output_text == chat.choices[0].message.content and "Paris" not in response.output_text
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input=QUESTION, extra_body={"top_k": -2})
    assert info.value.body["param"] == "top_k"


def _chat_chunks(deltas: list) -> list[str]:
    """A chat stream's lines with these deltas (content strings, or tool calls as (index, id, name, arguments)),
    then its end."""
    from pagedllm.entrypoints.openai.protocol import (ChatCompletionResponseStreamChoice, ChatCompletionStreamResponse,
                                                      DeltaMessage)
    from pagedllm.entrypoints.openai.tool_protocol import DeltaFunctionCall, DeltaToolCall

    def chunk(delta: DeltaMessage, finish_reason=None) -> str:
        choice = ChatCompletionResponseStreamChoice(index=0, delta=delta, finish_reason=finish_reason)
        chunk = ChatCompletionStreamResponse(id="c", created=0, model=MODEL, choices=[choice])
        return "data: " + chunk.model_dump_json()

    return [chunk(DeltaMessage(content=d)) if isinstance(d, str) else chunk(DeltaMessage(tool_calls=[DeltaToolCall(
        index=d[0], id=d[1], type="function", function=DeltaFunctionCall(name=d[2], arguments=d[3]))]))
        for d in deltas] + [chunk(DeltaMessage(), "stop"), "data: [DONE]"]


async def _lines(lines: list[str]):
    for line in lines:
        yield line


def _stream_events(deltas: list, tools: tuple = (TOOL,)) -> list[dict]:
    """The events _stream sends for chat stream chunks with these deltas (as _chat_chunks'), the request's tools
    ``tools``."""
    import asyncio

    from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
    from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses, _ResponseBuilder

    async def events():
        chunks = _lines(_chat_chunks(deltas))
        request = ResponsesRequest(input="x", stream=True, store=False, tools=list(tools))
        builder = _ResponseBuilder(request, MODEL, [], ResponseStore(), SamplingParams())
        return [event async for event in OpenAIServingResponses._stream(None, builder, chunks)]

    return [json.loads(event.split("data: ", 1)[1]) for event in "".join(asyncio.run(events())).split("\n\n")
            if event]


def _streamed_output(deltas: list) -> list:
    """The final output items _stream makes of chat stream chunks with these deltas (as _stream_events')."""
    final = _stream_events(deltas)[-1]["response"]
    return [(item["type"], item["content"][0]["text"] if item["type"] == "message" else item["name"])
            for item in final["output"]]


def test_streamed_text_is_the_stripped_content_as_unstreamed():
    """With tools, the message's text is the chat content stripped, as chat strips the content it reads tool calls
    out of: whitespace around tool calls opens no message item."""
    call = (0, "call_1", "get_weather", '{"city": "Paris"}')
    assert _streamed_output(["\n\n", call, "\n"]) == [("function_call", "get_weather")]
    assert _streamed_output(["  Checking", ". ", call, " "]) == [("message", "Checking."),
                                                                ("function_call", "get_weather")]


def test_streamed_items_are_done_one_after_another():
    """As OpenAI and vLLM stream them: each output item is done before the next is added (text after a function
    call is a message of its own), and the done items are the final response's."""
    calls = [(0, "call_1", "get_weather", '{"city": "Paris"}'), (1, "call_2", "get_time", "{}")]
    events = _stream_events(["Checking.", *calls, " Done."])
    opened = [e for e in events if e["type"] in ("response.output_item.added", "response.output_item.done")]
    assert [(e["type"].rsplit(".", 1)[1], e["output_index"], e["item"]["type"]) for e in opened] == [
        (step, index, kind) for index, kind in enumerate(["message", "function_call", "function_call", "message"])
        for step in ("added", "done")]
    for index, kind in enumerate(["message", "function_call", "function_call", "message"]):
        item_events = [i for i, e in enumerate(events) if e.get("output_index") == index]
        assert item_events == list(range(item_events[0], item_events[-1] + 1))  # none of another item's between
    final = events[-1]["response"]["output"]
    assert [e["item"] for e in opened if e["type"] == "response.output_item.done"] == final
    assert [item.get("status") for item in final] == ["completed"] * 4
    assert (final[0]["content"][0]["text"], final[3]["content"][0]["text"]) == ("Checking.", "Done.")
    assert final[0]["id"] != final[3]["id"]


def test_unstreamed_output_items_are_the_streamed_ones():
    """An unstreamed response's output items are those its stream ends with (text after a function call a message
    of its own, not joined to the text before it); an error the chat stream ends with is raised with its status."""
    import asyncio
    from types import SimpleNamespace

    from pagedllm.entrypoints.openai.errors import OpenAIError, create_error_response
    from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
    from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses

    class Chat:
        models = SimpleNamespace(check_model=lambda name: MODEL)

        def __init__(self, lines: list[str]) -> None:
            self.lines = lines

        async def start_chat_completion(self, request, cached_tokens_always=False):
            return SamplingParams(), _lines(self.lines)

    def respond(lines: list[str], **fields):
        request = ResponsesRequest(input="x", **fields)
        return asyncio.run(OpenAIServingResponses(Chat(lines)).create_responses(request))

    deltas = ["Checking.", (0, "call_1", "get_weather", '{"city": "Paris"}'), " Done."]
    response = respond(_chat_chunks(deltas), tools=[TOOL])
    assert [(item.type, item.content[0].text if item.type == "message" else item.name)
            for item in response.output] == _streamed_output(deltas) == [
        ("message", "Checking."), ("function_call", "get_weather"), ("message", "Done.")]
    # Without tools the text is the chat content as generated, whitespace and all.
    [message] = respond(_chat_chunks([" The answer", " is "])).output
    assert message.content[0].text == " The answer is "
    failed = [_chat_chunks(["Hi"])[0], "data: " + create_error_response("refused", 400, "x").model_dump_json()]
    with pytest.raises(OpenAIError) as info:
        respond(failed)
    assert (info.value.status_code, info.value.message, info.value.param) == (400, "refused", "x")


def test_hosted_tools_are_taken_and_dropped_as_vllms():
    """vLLM's tools are OpenAI's Tool union: a hosted tool (web search, ...) is taken, echoed as given, and dropped
    from what the model is shown, as is a tool_choice naming one (which forces nothing: "auto" for the function
    tools, plain text without any), and as is allowed_tools, which vLLM constrains no more. A named function must
    still be a function tool (chat's 400 otherwise)."""
    from pagedllm.entrypoints.openai.serving_responses import _ResponseBuilder

    search = {"type": "web_search_preview", "search_context_size": "low"}
    for tools, tool_choice, chat_tools, chat_choice in (
            ([search], "auto", None, "none"), ([search, TOOL], "auto", ["get_weather"], "auto"),
            ([search], {"type": "web_search_preview"}, None, "none"),
            ([TOOL, search], {"type": "web_search_preview"}, ["get_weather"], "auto"),
            ([search], "required", None, "required"), ([search], "none", None, "none"),
            ([TOOL, search], {"type": "allowed_tools", "mode": "required",
                              "tools": [{"type": "function", "name": "x"}]},
             ["get_weather"], "auto"),
            ([search], {"type": "allowed_tools", "mode": "auto", "tools": []}, None, "none"),
            ([TOOL, search], {"type": "apply_patch"}, ["get_weather"], "auto"),
            ([search], {"type": "shell"}, None, "none"),
            ([search], {"type": "function", "name": "web_search_preview"}, None, "web_search_preview")):
        request = ResponsesRequest.model_validate({"input": "x", "tools": tools, "tool_choice": tool_choice})
        chat = request.to_chat_request()
        assert (None if chat.tools is None else [t.function.name for t in chat.tools]) == chat_tools
        assert (chat.tool_choice if isinstance(chat.tool_choice, str) else chat.tool_choice.function.name) == \
            chat_choice
        echoed = _ResponseBuilder(request, MODEL, [], ResponseStore(), SamplingParams()).response(
            "completed", []).model_dump(mode="json")
        assert [t for t in echoed["tools"] if t["type"] != "function"] == [search]
        assert echoed["tool_choice"] == tool_choice
    with pytest.raises(ValueError, match="tools.0"):  # not a tool type OpenAI has
        ResponsesRequest.model_validate({"input": "x", "tools": [{"type": "browser"}]})
    # ToolChoiceAllowed's modes only.
    with pytest.raises(ValueError, match=r"allowed_tools.mode\n  Input should be .auto. or .required."):
        ResponsesRequest.model_validate({"input": "x", "tools": [TOOL], "tool_choice": {
            "type": "allowed_tools", "mode": "none", "tools": []}})


def test_custom_and_namespace_tools_are_functions_as_vllms():
    """As vLLM's get_function_tools: a custom tool is shown as a function of one string (its shim), a namespace's
    functions under "<namespace>__<name>"; a call of the shim is a custom_tool_call whose input streams as it is read
    out of the shim's arguments, one of a namespace's function a function_call with its own name and the namespace;
    given back, they are the calls the model wrote. A named tool_choice of a namespace's function by its own name is
    its flat name; a custom tool with a grammar format is a 400."""
    custom = {"type": "custom", "name": "run", "description": "Runs code."}
    namespace = {"type": "namespace", "name": "weather", "description": "Weather tools.", "tools": [TOOL]}
    request = ResponsesRequest.model_validate({"input": "x", "tools": [custom, namespace],
                                               "tool_choice": {"type": "function", "name": "get_weather"}})
    chat = request.to_chat_request()
    assert [t.function.name for t in chat.tools] == ["run", "weather__get_weather"]
    assert chat.tools[0].function.parameters["properties"]["input"]["type"] == "string"
    assert chat.tool_choice.function.name == request.tool_choice.name == "weather__get_weather"
    grammar = {**custom, "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}
    with pytest.raises(ValueError, match="grammar format are not supported"):
        ResponsesRequest.model_validate({"input": "x", "tools": [grammar]})
    # A namespace's custom tool is never shown, so not looked at (vLLM's checks the top-level tools only).
    hidden = ResponsesRequest.model_validate({"input": "x", "tools": [{**namespace, "tools": [grammar]}]})
    assert hidden.function_tools == []

    deltas = [(0, "call_1", "run", '{"input": "print(\\"h'), (0, None, None, 'i\\")\\n"}'),
              (1, "call_2", "weather__get_weather", '{"city": "Paris"}')]
    events = _stream_events(deltas, tools=(custom, namespace))
    code = 'print("hi")\n'
    assert "".join(e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta") == code
    assert [e["input"] for e in events if e["type"] == "response.custom_tool_call_input.done"] == [code]
    run, get_weather = events[-1]["response"]["output"]
    assert (run["type"], run["name"], run["input"], run["call_id"]) == ("custom_tool_call", "run", code, "call_1")
    assert (get_weather["type"], get_weather["name"], get_weather["namespace"]) == (
        "function_call", "get_weather", "weather")
    given_back = ResponsesRequest.model_validate({"input": [run, get_weather, {
        "type": "custom_tool_call_output", "call_id": "call_1", "output": "hi"}], "tools": [custom, namespace]})
    call, result = given_back.input_messages()
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in call["tool_calls"]] == [
        ("run", {"input": code}), ("weather__get_weather", {"city": "Paris"})]
    assert result == {"role": "tool", "tool_call_id": "call_1", "content": "hi"}


def _wait_until_done(client, response_id: str, timeout: float = 60.0):
    """The stored response once it is no longer queued (a bound on how long the server may take, not on how fast the
    machine is)."""
    deadline = time.monotonic() + timeout
    while True:
        response = client.responses.retrieve(response_id)
        if response.status != "queued":
            return response
        assert time.monotonic() < deadline, f"{response_id} still queued after {timeout} s"
        time.sleep(0.05)


def test_background_response_is_read_back_when_done(client, chat_text):
    started = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=20,
                                      background=True)
    # queued, as vLLM answers it (and keeps it until it ends)
    assert (started.status, started.background, started.output) == ("queued", True, [])
    assert client.responses.retrieve(started.id).status in ("queued", "completed", "incomplete")
    done = _wait_until_done(client, started.id)
    assert done.status in ("completed", "incomplete") and done.background
    assert done.output_text == chat_text
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        client.responses.cancel(started.id)  # finished


def test_background_stream_is_rejoined_where_it_was_left(server, client, chat_text):
    """A client reads a background stream's first events and goes away; the generation runs on, and a GET with
    stream and starting_after gives every later event once, to the end."""
    body = {"model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": 20, "stream": True,
            "background": True}
    with server.http() as http, http.stream("POST", "/v1/responses", json=body) as response:
        first = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                first.append(json.loads(line.removeprefix("data: ")))
                if len(first) == 3:
                    break
    assert [e["sequence_number"] for e in first] == [0, 1, 2]
    response_id = first[0]["response"]["id"]
    assert first[0]["response"]["background"] is True
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=2))
    assert [e.sequence_number for e in rest] == list(range(3, 3 + len(rest)))
    assert rest[-1].type in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in rest if e.type == "response.output_text.delta")
    assert text == chat_text == rest[-1].response.output_text
    assert _wait_until_done(client, response_id).output_text == chat_text
    everything = list(client.responses.retrieve(response_id, stream=True))
    assert [e.sequence_number for e in everything] == list(range(3 + len(rest)))


def test_background_response_is_cancelled_and_its_request_aborted(server, client):
    # ignore_eos: a sampled answer may end within the moment before the cancel arrives (which one the server's
    # seeded sampling gives depends on the requests before it)
    started = client.responses.create(model=MODEL, input="Count from one to one thousand, in words.",
                                      max_output_tokens=900, background=True, extra_body={"ignore_eos": True})
    cancelled = client.responses.cancel(started.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(started.id).status == "cancelled"
    wait_until_idle(server, 0.0)  # the engine request aborted, its blocks freed
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        client.responses.cancel(started.id)
    synchronous = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        client.responses.cancel(synchronous.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")


def test_background_needs_store(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input=QUESTION, background=True, store=False)
    assert info.value.body["param"] == "background"
    with pytest.raises(openai.BadRequestError) as info:  # not a background stream: nothing to stream
        list(client.responses.retrieve(client.responses.create(model=MODEL, input=QUESTION,
                                                               max_output_tokens=2).id, stream=True))
    assert info.value.body["param"] == "stream"


def test_reasoning_effort_reaches_the_chat_template():
    """As vLLM's: the Responses API's reasoning.effort is the chat request's reasoning_effort, which the template gets
    (and "none" turns off thinking in templates that read enable_thinking); an effort OpenAI has not is a 400."""
    from pydantic import ValidationError

    from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest

    chat = ResponsesRequest.model_validate({"input": QUESTION, "reasoning": {"effort": "none"}}).to_chat_request()
    assert chat.reasoning_effort == "none" and chat.template_kwargs()["enable_thinking"] is False
    assert ResponsesRequest.model_validate({"input": QUESTION}).to_chat_request().reasoning_effort is None
    with pytest.raises(ValidationError, match="reasoning.effort"):
        ResponsesRequest.model_validate({"input": QUESTION, "reasoning": {"effort": "huge"}})


def test_chat_template_kwargs_reach_the_chat_template():
    """vLLM's chat_template_kwargs field: its variables reach the template (Qwen3's enable_thinking), over the
    enable_thinking that reasoning.effort implies, and are checked as chat checks them."""
    from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest

    chat = ResponsesRequest.model_validate({"input": QUESTION, "reasoning": {"effort": "high"},
                                            "chat_template_kwargs": {"enable_thinking": False}}).to_chat_request()
    assert chat.template_kwargs()["enable_thinking"] is False


def test_chat_template_kwargs_are_checked_as_chats(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input=QUESTION,
                                extra_body={"chat_template_kwargs": {"chat_template": "x"}})
    assert info.value.body["param"] == "chat_template_kwargs"
