"""Structured output and tool calling through the OpenAI API (the official client): response_format,
vLLM's structured_outputs extra, and tools with tool_choice "required" or a named function, streamed and not."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

MODEL = "smollm2-135m-instruct"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"timezone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["timezone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone.",
                                           "parameters": TIME}}]
SCHEMA_OF = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


def test_response_format_json_schema(server):
    chat = server.get_client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}], n=3, seed=1,
        max_tokens=100, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    for choice in chat.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_structured_outputs_extra_on_both_endpoints(server):
    client = server.get_client()
    completion = client.completions.create(model=MODEL, prompt="The best fruit is", max_tokens=10, seed=0,
                                           extra_body={"structured_outputs": {"choice": ["apple", "pear"]}})
    assert completion.choices[0].text in ("apple", "pear")
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, seed=0,
                                          extra_body={"structured_outputs": {"regex": r"[0-9]{2} degrees"}})
    assert re.fullmatch(r"[0-9]{2} degrees", chat.choices[0].message.content)


def test_vllms_structured_outputs_options_and_unknown_keys_are_taken():
    """As vLLM, whose pydantic reads structured_outputs into its dataclass: its whitespace_pattern and
    disable_additional_properties are taken (its xgrammar backend reads neither from a request), unknown keys
    ignored; the constraint is the one given."""
    from pagedllm.entrypoints.openai.protocol import CompletionRequest
    from pagedllm.structured_output.params import StructuredOutputsParams

    so = {"choice": ["apple", "pear"], "whitespace_pattern": " ?", "disable_additional_properties": True, "x": 1}
    params = CompletionRequest(prompt="p", structured_outputs=so).structured_outputs_params()
    assert (params.kind, params.choice) == ("choice", ["apple", "pear"])
    so = {"json_object": "true", "disable_any_whitespace": "no"}  # pydantic's booleans
    params = CompletionRequest(prompt="p", structured_outputs=so).structured_outputs_params()
    assert (params.kind, params.disable_any_whitespace) == ("json_object", False)
    assert StructuredOutputsParams(json={"type": "object"}, whitespace_pattern=" ").kind == "json"
    # the private fields the server sets (the reasoning's end, which holds the grammar back) are no request's to set
    so = {"json_object": True, "_reasoning_end_token_ids": [7]}
    assert CompletionRequest(prompt="p", structured_outputs=so).structured_outputs_params()._reasoning_end_token_ids \
        is None


@pytest.mark.parametrize("so", [{"json_object": False}, {"json_object": "no", "json": {"type": "object"}}])
def test_json_object_false_is_refused(so):
    """As vLLM: json_object must be True if set (False is no way to turn the constraint off), never read as unset."""
    from pagedllm.structured_output.params import StructuredOutputsParams

    with pytest.raises(ValueError, match="^structured_outputs.json_object must be True if set"):
        StructuredOutputsParams(**so)


def test_response_format_structural_tag(server):
    """vLLM's response_format {"type": "structural_tag"}: xgrammar's format (here one tag, so the whole answer), and
    the legacy structures and triggers (as structured_outputs.structural_tag takes them too)."""
    client = server.get_client()
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<person>", "end": "</person>",
                                                "content": {"type": "json_schema", "json_schema": PERSON}}}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe a person."}],
                                          max_tokens=60, seed=1, response_format=tag)
    content = chat.choices[0].message.content
    assert content.startswith("<person>") and content.endswith("</person>")
    jsonschema.validate(json.loads(content[len("<person>"):-len("</person>")]), PERSON)
    legacy = {"type": "structural_tag", "structures": [{"begin": "<person>", "schema": PERSON, "end": "</person>"}],
              "triggers": ["<person>"]}
    for body in ({"response_format": legacy}, {"structured_outputs": {"structural_tag": json.dumps(legacy)}}):
        chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, extra_body=body)
        assert chat.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}},
     "response_format.json_schema.name"),  # required, as OpenAI's and vLLM's
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    # of a type the engine cannot take: refused, never sent (one it could not decode would end it)
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs"),
    ({"structured_outputs": {"json": True}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": "maybe"}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"enum": [10**30]}}}, "structured_outputs"),  # beyond MessagePack's 64 bits
    ({"structured_outputs": {"json": {"type": "object"}, "json_object": False}}, "structured_outputs"),  # vLLM's
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "nope"}}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),  # SmolLM2's template defines no tool-call format
    ({"tools": TOOLS}, "tool_choice"),  # tools without a tool_choice are "auto", as vLLM's
    ({"use_beam_search": True, "response_format": {"type": "json_object"}}, "response_format"),
    ({"use_beam_search": True, "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
])
def test_invalid_constraints_are_400s(server, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        server.get_client().chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, extra_body=body)
    assert e.value.status_code == 400 and e.value.body["param"] == param


def test_a_null_tool_choice_is_a_plain_answer_without_a_tool_call_format(server):
    """As vLLM's: tools beside a tool_choice given as null (not left out, which is "auto") ask for no tool-call
    format: where the server reads none (SmolLM2's template teaches none), the answer is plain text."""
    with server.http() as http:
        response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 5,
                                                            "tools": TOOLS, "tool_choice": None})
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    assert message["content"] and "tool_calls" not in message


def _check_calls(calls: list[tuple[str, str]], names: set[str]) -> None:
    assert calls
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), SCHEMA_OF[name])


def _streamed_calls(stream) -> dict[int, dict[int, list]]:
    """choice index -> tool call index -> [name, arguments], put together from the deltas."""
    calls: dict[int, dict[int, list]] = {}
    finish = {}
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(choice.index, {}).setdefault(delta.index, [None, ""])
                if delta.function.name:
                    call[0] = delta.function.name
                call[1] += delta.function.arguments or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return calls, finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_calls_are_valid_10_of_10(server, tool_choice):
    client = server.get_client()
    names = {"get_weather", "get_time"} if tool_choice == "required" else {"get_weather"}
    expected_finish = "tool_calls" if tool_choice == "required" else "stop"
    # One call per answer: the grammar then closes the array, so every answer ends within the budget.
    chat = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, n=10,
                                          seed=3, max_tokens=120, parallel_tool_calls=False)
    assert len(chat.choices) == 10
    for choice in chat.choices:
        assert choice.finish_reason == expected_finish
        assert choice.message.content == ""  # vLLM's for a required or named tool_choice, not null
        assert len(choice.message.tool_calls) == 1
        assert all(call.id and call.type == "function" for call in choice.message.tool_calls)
        _check_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls], names)

    # Parallel calls: a sampled array may run past max_tokens ("length"), cutting its last call's arguments (they
    # stream as generated); every other call streamed is complete.
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                                 n=10, seed=4, max_tokens=120, stream=True))
    # no empty deltas while the parser holds text it cannot place yet
    assert all(c.delta.role or c.delta.content or c.delta.tool_calls or c.finish_reason
               for chunk in chunks for c in chunk.choices)
    calls, finish = _streamed_calls(chunks)
    assert sorted(calls) == list(range(10)) and set(finish.values()) <= {expected_finish, "length"}
    assert list(finish.values()).count(expected_finish) >= 8
    for index, per_choice in calls.items():
        streamed = [tuple(call) for call in per_choice.values()]
        if finish[index] == "length":
            assert streamed[-1][0] in names
            streamed.pop()
        if streamed:
            _check_calls(streamed, names)
