"""The tool-call formats beyond Hermes (vLLM's llama3_json, pythonic and mistral parsers) read out of generated text
without a server: each answer gives its calls and content, and every random cut of it into stream deltas gives the
same calls and content as the whole text."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.entrypoints.openai.tool_call_parsers import (Llama3JsonToolParser, MistralToolParser,
                                                           PythonicToolParser)
from pagedllm.entrypoints.openai.tool_calls import detect_tool_call_parser, make_auto_parser
from tests.server.test_tool_calls import _streamed

WEATHER = {"city": "Paris \"}; [\\\\ ", "days": [1, {"x": 2}]}
# (parser, answer, expected content, expected [(name, arguments as the model wrote them, llama3_json's in json.dumps
# form)])
ANSWERS = [
    (Llama3JsonToolParser, '<|python_tag|>{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) +
     '}; {"name": "ping", "arguments": {}}', "", [("get_weather", json.dumps(WEATHER)), ("ping", "{}")]),
    (Llama3JsonToolParser, ' {"name": "ping"}\n', "", [("ping", "{}")]),
    (Llama3JsonToolParser, 'It is {"name": "ping"} in braces', 'It is {"name": "ping"} in braces', []),
    (Llama3JsonToolParser, '{"city": "Paris"} is no call', '{"city": "Paris"} is no call', []),
    (Llama3JsonToolParser, '{"name": "ping", "parameters": {}} Done.', "", [("ping", "{}")]),
    (Llama3JsonToolParser, '{"name": "ping", "parameters": {}}; {"oops": 1} {"na', "", [("ping", "{}")]),
    (Llama3JsonToolParser, "<|python", "<|python", []),
    # vLLM's, streamed too: arguments in json.dumps form (ensure_ascii=False), not the model's text of them
    (Llama3JsonToolParser, '{"name":"f","parameters":{"a":"Z\\u00fcrich \\ud83d\\ude00\\/\\n" ,"n":1.50,"l":[true]}}',
     "", [("f", '{"a": "Z\u00fcrich \U0001f600/\\n", "n": 1.5, "l": [true]}')]),
    (PythonicToolParser, '[get_weather(city="Paris ]", days=[1, 2], metric=True, unit=None), ping()]', "",
     [("get_weather", '{"city": "Paris ]", "days": [1, 2], "metric": true, "unit": null}'), ("ping", "{}")]),
    (PythonicToolParser, '<|python_start|>[ping(flag=false, n=-1)]<|python_end|>', "",
     [("ping", '{"flag": false, "n": -1}')]),
    # vLLM's: a set's elements as a list, an f-string without placeholders as its text
    (PythonicToolParser, "[tag(labels={'a', 1}, note=f'hi', size=(2, 3))]", "",
     [("tag", '{"labels": ["a", 1], "note": "hi", "size": [2, 3]}')]),
    (PythonicToolParser, "[tag(note=f'{x}')]", "[tag(note=f'{x}')]", []),
    (PythonicToolParser, "[ping()] and then some<|python_end|>", "", [("ping", "{}")]),
    (PythonicToolParser, "[1, 2] is a list", "[1, 2] is a list", []),
    (PythonicToolParser, "[]", "[]", []),
    (PythonicToolParser, '[get_weather("Paris")]', '[get_weather("Paris")]', []),  # positional: no call
    (PythonicToolParser, "Sure: [ping()]", "Sure: [ping()]", []),
    (PythonicToolParser, "[ping(", "[ping(", []),
    # No JSON value (vLLM's get_parameter_value refuses them; they raised a TypeError, a 500)
    (PythonicToolParser, "[ping(a=...)]", "[ping(a=...)]", []),
    (PythonicToolParser, "[ping(a={(1, 2): 3})]", "[ping(a={(1, 2): 3})]", []),
    (MistralToolParser, 'Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) +
     '}, {"oops": 1}, {"name": "ping", "arguments": {}}]', "Sure.",
     [("get_weather", json.dumps(WEATHER)), ("ping", "{}")]),
    (MistralToolParser, '[TOOL_CALLS]get_weather[ARGS]' + json.dumps(WEATHER) + '[TOOL_CALLS]ping{}', "",
     [("get_weather", json.dumps(WEATHER)), ("ping", "{}")]),
    (MistralToolParser, '[TOOL_CALLS]{"name": "ping", "arguments": {"n": 1}} ok', " ok", [("ping", '{"n": 1}')]),
    (MistralToolParser, "No [TOOL_CALL] here [", "No [TOOL_CALL] here [", []),
]

# What vLLM's extract_tool_calls gives for a whole text (a non-streamed answer) where that is not what its stream
# gives: (parser, answer, expected content, expected [(name, arguments)]). llama3_json finds its JSON calls anywhere
# and drops the text around them, any "{" without a call making all of it content; pythonic parses all of the text
# as Python; Mistral's JSON calls (before v11) are the first JSON value after [TOOL_CALLS], the text after it
# dropped, as the text after its v11 calls. Their arguments are json.dumps's form, not the model's text (but for
# v11's). Content None: all of the answer.
WHOLE_ANSWERS = [
    (Llama3JsonToolParser, ' {"name": "ping"}\n', None, []),
    (Llama3JsonToolParser, '{"name": "ping", "parameters": {}} Done.', "", [("ping", "{}")]),
    (Llama3JsonToolParser, 'Sure! {"name":"f","parameters":{"a":"Z\\u00fcrich"}}; {"name": "g", "arguments": {}} Bye',
     "", [("f", '{"a": "Z\u00fcrich"}'), ("g", "{}")]),
    (Llama3JsonToolParser, '{"name": "f", "parameters": {"x": 1}, "arguments": {"y": 2}}', "", [("f", '{"y": 2}')]),
    (Llama3JsonToolParser, '{"name": "f", "parameters": {}}; {"oops": 1}', None, []),
    (Llama3JsonToolParser, '{"name": "ping", "parameters": {}}; {"oops": 1} {"na', None, []),
    (Llama3JsonToolParser, 'Use {x}: {"name": "f", "parameters": {}}', None, []),
    (Llama3JsonToolParser, '{"name": "f", "parameters": {"city": "Par', None, []),
    (PythonicToolParser, "[ping()] and then some<|python_end|>", None, []),
    (PythonicToolParser, "<|python_start|>[ping()]<|python_end|> Done.", None, []),
    (PythonicToolParser, "\n[ping()]", None, []),
    (PythonicToolParser, "[ping()]  # done\n", "", [("ping", "{}")]),
    (MistralToolParser, '[TOOL_CALLS]{"name": "ping", "arguments": {"n": 1}} ok', "", [("ping", '{"n": 1}')]),
    (MistralToolParser, 'Hi[TOOL_CALLS][{"name":"f","arguments":{"a":"\\u00e9"}}, {"arguments": {}}, '
     '{"name": "g", "arguments": "{\\"b\\":1}"}] ok[TOOL_CALLS]h{}', "Hi",
     [("f", '{"a": "\u00e9"}'), ("", "{}"), ("g", '{"b":1}')]),
    (MistralToolParser, '[TOOL_CALLS][TOOL_CALLS] {"name": "f"}', "", [("f", "{}")]),
    (MistralToolParser, "Hi [TOOL_CALLS] [1, 2] ", "[1, 2]", []),
    (MistralToolParser, 'Hi[TOOL_CALLS] [{"name": "f", "arguments": {"a ', '[{"name": "f", "arguments": {"a', []),
    (MistralToolParser, 'Hi\n[TOOL_CALLS]f [ARGS]{"a": [1, {"b": "}"}]} x[TOOL_CALLS]g[ARGS]', "Hi",
     [("f", '{"a": [1, {"b": "}"}]}'), ("g", "{}")]),
    (MistralToolParser, '[TOOL_CALLS]f{"a":1}{"b": 2}\n\n[TOOL_CALLS]', "", [("f", '{"a":1}')]),
    (MistralToolParser, "Hi [TOOL_CALLS]", "Hi ", []),
]


@pytest.mark.parametrize("parser, answer, content, calls", WHOLE_ANSWERS)
def test_a_whole_answer_gives_vllms_calls_and_content(parser, answer, content, calls):
    whole_content, whole = parser().parse(answer)
    assert (whole_content, [(c.function.name, c.function.arguments) for c in whole]) == (
        answer if content is None else content, calls)


def _cuts(text: str, rng: random.Random) -> list[str]:
    points = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


@pytest.mark.parametrize("parser, answer, content, calls", ANSWERS)
def test_an_answer_gives_its_calls_and_content_whole_or_streamed_in_any_cut(parser, answer, content, calls):
    """Streamed in any cut, an answer gives its calls and content; read whole too, but where vLLM's reads a whole text
    otherwise (WHOLE_ANSWERS)."""
    if answer not in [row[1] for row in WHOLE_ANSWERS]:
        whole_content, whole = parser().parse(answer)
        assert (whole_content, [(c.function.name, c.function.arguments) for c in whole]) == (content, calls)
    rng = random.Random(answer)
    for pieces in [list(answer), *(_cuts(answer, rng) for _ in range(20))]:
        streamed, _, streamed_content = _streamed(pieces, parser())
        assert (streamed_content, streamed) == (content, [{"name": n, "arguments": a} for n, a in calls]), pieces


def test_a_call_cut_off_keeps_the_arguments_it_had():
    """Streamed; read whole, Mistral's v11 call too, as vLLM's (a cut JSON object or array is no JSON to vLLM's
    extract_tool_calls: WHOLE_ANSWERS)."""
    for parser, answer in [(Llama3JsonToolParser, '{"name": "f", "parameters": {"city": "Par'),
                           (MistralToolParser, '[TOOL_CALLS]f[ARGS]{"city": "Par'),
                           (MistralToolParser, '[TOOL_CALLS][{"name": "f", "arguments": {"city": "Par')]:
        assert _streamed(list(answer), parser())[::2] == ([{"name": "f", "arguments": '{"city": "Par'}], "")
    content, calls = MistralToolParser().parse('[TOOL_CALLS]f[ARGS]{"city": "Par')
    assert (content, [(c.function.name, c.function.arguments) for c in calls]) == ("", [("f", '{"city": "Par')])


@pytest.mark.parametrize("answer", ["[TOOL_CALLS]", ""])
def test_a_mistral_answer_without_calls_or_content_has_null_content(answer):
    """As vLLM's (its engine-based Mistral parser gives ``content or None`` where there are no calls)."""
    from pagedllm.entrypoints.openai.tool_calls import ToolChoice

    choice = ToolChoice("auto", [], parser="mistral")
    assert choice.message_content(*choice.make_parser().parse(answer)) is None


def test_mistral_call_ids_are_nine_letters_and_digits():
    """Mistral's chat templates refuse a conversation whose earlier calls' ids are not 9 alphanumerics."""
    _, calls = MistralToolParser().parse('[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g"}]')
    assert [len(c.id) for c in calls] == [9, 9] and all(c.id.isalnum() for c in calls)
    assert calls[0].id != calls[1].id


@pytest.mark.parametrize("tool_choice, answer", [("required", '[{"name": "f", "parameters": {}}]'),
                                                 ({"type": "function", "function": {"name": "f"}}, "{}")])
def test_a_forced_calls_ids_are_mistrals_where_the_format_is(tool_choice, answer):
    """As vLLM's (its Mistral parser reads required and named calls too): with the mistral format, a required or
    named tool_choice's calls have 9-character ids, which Mistral's chat templates take back in the next turn (they
    raised on the chatcmpl-tool-... ids); with another format, vLLM's."""
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
    from pagedllm.entrypoints.openai.tool_calls import resolve_tool_choice

    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tool_choice=tool_choice,
                                    tools=[{"type": "function", "function": {"name": "f"}}])
    for parser, id_ok in [("mistral", lambda id: len(id) == 9 and id.isalnum()),
                          ("hermes", lambda id: id.startswith("chatcmpl-tool-"))]:
        choice = resolve_tool_choice(request.tools, request.tool_choice, True, parser)
        [call] = choice.make_parser().parse(answer)[1]
        assert call.function.name == "f" and id_ok(call.id), (parser, call.id)


@pytest.mark.parametrize("template, parser", [
    ('{{- "<tool_call>" }}', "hermes"),
    ("{%- if message.tool_calls %}[TOOL_CALLS][{% endif %}", "mistral"),
    ('Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.',
     "llama3_json"),
    ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),
    ("{{ message.content }}", None),
])
def test_the_format_is_detected_from_the_chat_template(template, parser):
    assert detect_tool_call_parser(template) == parser


@pytest.mark.parametrize("name, parser", [("llama4_json", Llama3JsonToolParser), ("pythonic", PythonicToolParser),
                                          ("llama4_pythonic", PythonicToolParser), ("mistral", MistralToolParser)])
def test_vllms_parser_names(name, parser):
    assert type(make_auto_parser(name)) is parser


def test_a_pythonic_list_is_parsed_where_its_brackets_close_not_at_every_bracket(monkeypatch):
    """The list may end only at a "]" closing its own "[" (brackets in strings and comments not counted): parsed at
    every "]", those of its nested lists too, a 25 kB call took seconds. (Read whole, it is parsed once, as all of
    the text is.)"""
    from pagedllm.entrypoints.openai import tool_call_parsers

    text = "[f(rows=[" + ", ".join(f"[{i}, ']', '''#[''']" for i in range(2000)) + "], note='[x]') # ]\n, g()]"
    parsed, parse = [], tool_call_parsers._python_calls
    monkeypatch.setattr(tool_call_parsers, "_python_calls", lambda list_text: parsed.append(1) or parse(list_text))
    parser = PythonicToolParser()
    content, _ = parser.feed(text)
    content, calls = content + parser.finish()[0], parser.calls
    assert (content, [c.function.name for c in calls]) == ("", ["f", "g"]) and len(parsed) == 1
    assert [c.function.arguments for c in PythonicToolParser().parse(text)[1]] == [c.function.arguments for c in calls]
    assert json.loads(calls[0].function.arguments)["rows"][1] == [1, "]", "#["]


def test_a_plugin_file_registers_a_format_of_its_own(tmp_path):
    """vLLM's --tool-parser-plugin: a Python file that registers a ToolCallParser subclass with
    ToolParserManager.register_module makes it a --tool-call-parser name; one that fails to import is a ValueError
    naming the flag."""
    from pagedllm.entrypoints.openai.tool_calls import ToolParserManager

    plugin = tmp_path / "shouting_parser.py"
    plugin.write_text(
        "from dataclasses import dataclass\n"
        "from pagedllm.entrypoints.openai.tool_calls import ToolCallParser, ToolParserManager\n"
        "@ToolParserManager.register_module(['shouting', 'shouting_v2'])\n"
        "@dataclass\n"
        "class ShoutingParser(ToolCallParser):\n"
        "    def feed(self, delta_text):\n"
        "        return delta_text.upper(), []\n")
    ToolParserManager.import_tool_parser(str(plugin))
    try:
        assert {"shouting", "shouting_v2", "hermes", "mistral"} <= set(ToolParserManager.list_registered())
        assert make_auto_parser("shouting_v2").parse("hi") == ("HI", [])
    finally:
        for name in ("shouting", "shouting_v2"):
            ToolParserManager.tool_parsers.pop(name)
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('no')\n")
    with pytest.raises(ValueError, match="--tool-parser-plugin .*broken.py: importing it failed"):
        ToolParserManager.import_tool_parser(str(broken))
    with pytest.raises(KeyError, match="'shouting' is not registered"):
        make_auto_parser("shouting")


def test_a_plugin_takes_over_a_built_in_formats_name(tmp_path):
    """vLLM's registry: a --tool-parser-plugin registering a built-in name (force=True) is what that name then
    parses with, whichever module defines the built-in and whether or not it was imported before the plugin (a
    fresh process, as `pagedllm serve` imports the plugin first)."""
    plugin = tmp_path / "takeover_parser.py"
    plugin.write_text(
        "from dataclasses import dataclass\n"
        "from pagedllm.entrypoints.openai.tool_calls import ToolCallParser, ToolParserManager\n"
        "@ToolParserManager.register_module(['mistral', 'hermes'])\n"
        "@dataclass\n"
        "class TakeoverParser(ToolCallParser):\n"
        "    def feed(self, delta_text):\n"
        "        return delta_text, []\n")
    script = ("import sys\n"
              "from pagedllm.entrypoints.openai.tool_calls import ToolParserManager, make_auto_parser\n"
              "ToolParserManager.import_tool_parser(sys.argv[1])\n"
              "print(type(make_auto_parser('mistral')).__name__, type(make_auto_parser('hermes')).__name__)\n")
    done = subprocess.run([sys.executable, "-c", script, str(plugin)], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["TakeoverParser", "TakeoverParser"]
