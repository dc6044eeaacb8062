"""Tool calls read out of generated text without a server: tool_choice "required"'s JSON array streams each call's
arguments as they are generated, and the deltas join to what the whole text gives."""
from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.tool_calls import JsonArrayParser

CALLS = [{"name": "get_weather", "parameters": {"city": "Paris \"}, [\\\\ ", "days": [1, {"x": 2}]}},
         {"parameters": {"timezone": "CET"}, "name": "get_time"},
         {"name": "ping", "parameters": {}}]
TEXT = json.dumps(CALLS)


def _streamed(pieces: list[str]) -> tuple[list[dict], int]:
    """name and arguments of each call, put together from the deltas of feeding ``pieces``; and how many deltas
    carried arguments."""
    parser, calls, argument_deltas = JsonArrayParser(), {}, 0
    for piece in pieces:
        _, deltas = parser.feed(piece)
        for delta in deltas:
            call = calls.setdefault(delta.index, {"name": delta.function.name, "arguments": ""})
            call["arguments"] += delta.function.arguments or ""
            argument_deltas += bool(delta.function.arguments)
    return [calls[i] for i in sorted(calls)], argument_deltas


def test_whole_text_gives_each_calls_parameters_text():
    _, calls = JsonArrayParser().parse(TEXT)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (c["name"], c["parameters"]) for c in CALLS]
    assert calls[0].function.arguments == json.dumps(CALLS[0]["parameters"])  # the model's own text


@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_streamed_deltas_join_to_the_whole_texts_arguments(size):
    _, whole = JsonArrayParser().parse(TEXT)
    streamed, argument_deltas = _streamed([TEXT[i:i + size] for i in range(0, len(TEXT), size)])
    assert streamed == [{"name": c.function.name, "arguments": c.function.arguments} for c in whole]
    assert argument_deltas > len(CALLS)  # several deltas per call, as the arguments arrive


def test_a_cut_call_keeps_the_arguments_it_had():
    cut = TEXT[:TEXT.index('{"x"') + 3]  # inside the first call's parameters, inside a string
    _, calls = JsonArrayParser().parse(cut)
    assert [c.function.name for c in calls] == ["get_weather"]
    assert calls[0].function.arguments == cut[cut.index('{"city"'):]
    assert _streamed(list(cut))[0] == [{"name": "get_weather", "arguments": calls[0].function.arguments}]
    # A call whose name has not arrived (its parameters come first) is not open yet.
    assert [c.function.name for c in JsonArrayParser().parse(TEXT[:TEXT.index('"CET"')])[1]] == ["get_weather"]
