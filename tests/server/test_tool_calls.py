"""Tool calls read out of generated text without a server: tool_choice "required"'s JSON array and "auto"'s Hermes
blocks stream each call's arguments as they are generated, and the deltas join to what the whole text gives."""
from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.tool_calls import HermesParser, JsonArrayParser, ToolCallParser

CALLS = [{"name": "get_weather", "parameters": {"city": "Paris \"}, [\\\\ ", "days": [1, {"x": 2}]}},
         {"parameters": {"timezone": "CET"}, "name": "get_time"},
         {"name": "ping", "parameters": {}}]
TEXT = json.dumps(CALLS)


def _streamed(pieces: list[str], parser: ToolCallParser = None) -> tuple[list[dict], int, str]:
    """name and arguments of each call, put together from the deltas of feeding ``pieces``; how many deltas
    carried arguments; and the content."""
    parser, calls, argument_deltas, content = parser or JsonArrayParser(), {}, 0, ""
    for piece in pieces:
        text, deltas = parser.feed(piece)
        content += text
        for delta in deltas:
            call = calls.setdefault(delta.index, {"name": delta.function.name, "arguments": ""})
            call["arguments"] += delta.function.arguments or ""
            argument_deltas += bool(delta.function.arguments)
    content += parser.finish()[0]
    return [calls[i] for i in sorted(calls)], argument_deltas, content


def test_whole_text_gives_each_calls_parameters_text():
    _, calls = JsonArrayParser().parse(TEXT)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (c["name"], c["parameters"]) for c in CALLS]
    assert calls[0].function.arguments == json.dumps(CALLS[0]["parameters"])  # the model's own text


@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_streamed_deltas_join_to_the_whole_texts_arguments(size):
    _, whole = JsonArrayParser().parse(TEXT)
    streamed, argument_deltas, _ = _streamed([TEXT[i:i + size] for i in range(0, len(TEXT), size)])
    assert streamed == [{"name": c.function.name, "arguments": c.function.arguments} for c in whole]
    assert argument_deltas > len(CALLS)  # several deltas per call, as the arguments arrive


def test_a_cut_call_keeps_the_arguments_it_had_when_streamed_and_is_no_call_read_at_once():
    """Streamed, a call cut off (max_tokens) keeps what was streamed of it; read at once, text that is no whole
    array of calls gives none, as vLLM's (its validate_json of the whole text fails)."""
    cut = TEXT[:TEXT.index('{"x"') + 3]  # inside the first call's parameters, inside a string
    assert _streamed(list(cut))[0] == [{"name": "get_weather", "arguments": cut[cut.index('{"city"'):]}]
    assert JsonArrayParser().parse(cut) == ("", [])
    # A call whose name has not arrived (its parameters come first) is not open yet.
    assert [c["name"] for c in _streamed(list(TEXT[:TEXT.index('"CET"')]))[0]] == ["get_weather"]


def test_required_calls_read_at_once_are_in_json_dumps_form():
    """As vLLM's: each call's arguments are json.dumps(parameters, ensure_ascii=False), not the model's text of them;
    an array that is no list of calls (a name that is no string) gives none."""
    content, calls = JsonArrayParser().parse('[{"name": "f", "parameters": {"city":"Caf\\u00e9" ,"n":1}}]')
    assert (content, [(c.function.name, c.function.arguments) for c in calls]) == (
        "", [("f", '{"city": "Café", "n": 1}')])
    assert JsonArrayParser().parse('[{"name": 1, "parameters": {}}]') == ("", [])


def test_a_named_call_read_at_once_is_its_text_and_none_where_that_is_whitespace():
    """As vLLM's: a named tool_choice's answer read at once is the call, its arguments the text as generated; an
    answer of whitespace only (cut off before its arguments began) is no call."""
    from pagedllm.entrypoints.openai.tool_calls import NamedFunctionParser

    content, calls = NamedFunctionParser(name="f").parse('{"a":1}')
    assert (content, [(c.function.name, c.function.arguments) for c in calls]) == ("", [("f", '{"a":1}')])
    assert NamedFunctionParser(name="f").parse(" \n") == ("", [])


HERMES = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "</tool_call> Paris"}}\n'
          '</tool_call><tool_call>{"name": "ping"}</tool_call><tool_call>not json</tool_call> Done.')


@pytest.mark.parametrize("size", [1, 4])
def test_hermes_blocks_stream_their_arguments(size):
    """As vLLM's parser: the content is the text before the first block, unstripped; the text between and after the
    blocks is no content. Read at once, a block that is no call makes all of the text content, without calls;
    streamed, nothing of it shows."""
    content, whole = HermesParser().parse(HERMES.replace("<tool_call>not json</tool_call>", ""))
    assert [(c.function.name, c.function.arguments) for c in whole] == [
        ("get_weather", '{"city": "</tool_call> Paris"}'), ("ping", "{}")]
    assert content == "Let me check. "
    assert HermesParser().parse(HERMES) == (HERMES, [])
    streamed, argument_deltas, streamed_content = _streamed([HERMES[i:i + size] for i in range(0, len(HERMES), size)],
                                                            HermesParser())
    assert streamed == [{"name": c.function.name, "arguments": c.function.arguments} for c in whole]
    assert streamed_content == content and argument_deltas > len(whole)


def test_hermes_block_cut_inside_its_call_keeps_its_arguments_when_streamed():
    """Read at once, a block cut off where its JSON is not whole is no call (vLLM's extract_tool_calls reads it to
    the end of the text): all of the text is content; one whose JSON is whole is a call without its end tag."""
    cut = HERMES[:HERMES.index("Paris") + 2]
    assert HermesParser().parse(cut) == (cut, [])
    streamed, _, content = _streamed(list(cut), HermesParser())
    assert content == "Let me check. "
    assert streamed == [{"name": "get_weather", "arguments": '{"city": "</tool_call> Pa'}]
    whole = HERMES[:HERMES.index("</tool_call><tool_call>")]
    content, calls = HermesParser().parse(whole)
    assert (content, [c.function.name for c in calls]) == ("Let me check. ", ["get_weather"])


def test_hermes_arguments_read_at_once_are_in_json_dumps_form():
    """As vLLM's extract_tool_calls: read at once, a call's arguments are json.dumps(value, ensure_ascii=False), not
    the model's compact or escaped text of them; streamed, the model's text, as vLLM's streamed Hermes calls."""
    arguments = '{"city":"Z\\u00fcrich","n":[1,2]}'
    text = 'Hi <tool_call>{"name": "f", "arguments": ' + arguments + '}</tool_call>'
    content, calls = HermesParser().parse(text)
    assert (content, [c.function.arguments for c in calls]) == ("Hi ", ['{"city": "Z\u00fcrich", "n": [1, 2]}'])
    assert _streamed(list(text), HermesParser())[0] == [{"name": "f", "arguments": arguments}]


BROKEN = ('<tool_call>{"name": "f", "arguments": {"a": }}</tool_call> Then '
          '<tool_call>{"name": "g", "arguments": {"a": 1}</tool_call> and <tool_call>{"name": "h", "arguments": {}}'
          '</tool_call> end')


def test_a_hermes_block_that_is_no_json_call_is_content_and_ends_at_its_tag():
    """As vLLM's parser: a block whose JSON does not parse is no call (its arguments would not be JSON), and read at
    once all of the text is then content; a block whose object never closes ends at its end tag rather than taking
    the text after it."""
    assert HermesParser().parse(BROKEN) == (BROKEN, [])
    # Streamed, what went out of the broken calls cannot be taken back; the good one keeps an index of its own.
    parser = HermesParser()
    streamed, _, content = _streamed(list(BROKEN), parser)
    assert [call["name"] for call in streamed] == ["f", "g", "h"] and streamed[-1]["arguments"] == "{}"
    assert ([c.function.name for c in parser.calls], content) == (["h"], "")


def test_a_hermes_block_with_an_escape_json_has_not_is_content():
    """A block with an escape JSON has not ("C:\\dir") in a name or key is no call but content, as any block whose
    JSON does not parse (vLLM's parser), where reading it raised (a 500, or a stream cut by an error)."""
    for text in ['Hi <tool_call>{"name": "C:\\dir", "arguments": {}}</tool_call> bye',
                 'Hi <tool_call>{"na\\me": "f", "arguments": {}}</tool_call> bye']:
        assert HermesParser().parse(text) == (text, [])
        streamed, _, content = _streamed(list(text), HermesParser())
        assert (streamed, content) == ([], "Hi ")


def test_parallel_tool_calls_false_keeps_the_first_call():
    """As vLLM: with parallel_tool_calls false an "auto" answer carries its first call only, streamed or not."""
    from pagedllm.entrypoints.openai.tool_calls import ToolChoice

    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    single, parallel = ToolChoice("auto", [], parallel=False), ToolChoice("auto", [])
    _, calls = HermesParser().parse(text)
    assert [c.function.name for c in single.kept_calls(calls)] == ["a"] and len(parallel.kept_calls(calls)) == 2
    _, deltas = HermesParser().feed(text)
    assert {d.index for d in single.kept_deltas(deltas)} == {0} and {d.index for d in deltas} == {0, 1}


def test_an_empty_tools_array_is_refused():
    """As vLLM's check_tool_usage (and OpenAI): "tools": [] is a 400, not a request without tools."""
    from pagedllm.entrypoints.openai.tool_calls import resolve_tool_choice

    with pytest.raises(ValueError, match="tools must not be an empty array"):
        resolve_tool_choice([], None, True, "hermes")
    assert resolve_tool_choice(None, None, True, None) is None and resolve_tool_choice(None, "none", True, None) is None


def test_auto_without_a_tool_call_format_is_refused_in_vllms_words():
    """As vLLM's render_chat without a tool parser: tool_choice "auto" is refused with its message, which clients look
    for to fall back to tools of their own making (the server names tool_choice)."""
    from pagedllm.entrypoints.openai.tool_calls import resolve_tool_choice
    from pagedllm.entrypoints.openai.tool_protocol import ChatCompletionToolsParam

    tool = ChatCompletionToolsParam(function={"name": "f"})
    with pytest.raises(ValueError, match='^"auto" tool choice requires --enable-auto-tool-choice and '
                                         '--tool-call-parser to be set'):
        resolve_tool_choice([tool], "auto", True, None)
    assert resolve_tool_choice([tool], "auto", True, "hermes").mode == "auto"


def test_a_message_without_tool_calls_has_no_tool_calls_field():
    """As vLLM's ChatMessage (and OpenAI's answers): no "tool_calls": [] in a plain message; calls are kept."""
    from pagedllm.entrypoints.openai.protocol import ChatMessage
    from pagedllm.entrypoints.openai.tool_protocol import FunctionCall, ToolCall

    assert json.loads(ChatMessage(role="assistant", content="Hi").model_dump_json()) == {"role": "assistant",
                                                                                         "content": "Hi"}
    call = ToolCall(function=FunctionCall(name="f", arguments="{}"))
    assert json.loads(ChatMessage(role="assistant", tool_calls=[call]).model_dump_json())["tool_calls"][0]["id"] == \
        call.id


def test_a_forcing_tool_choice_replaces_the_requests_own_constraint():
    """As vLLM's adjust_request: a required or named tool_choice's schema takes the place of response_format (or
    structured_outputs), which is still checked; a named function beside a structured_outputs json, regex or choice
    is refused, as vLLM's check_structured_outputs_count refuses it."""
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
    from pagedllm.entrypoints.openai.tool_calls import resolve_tool_choice

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "integer"}}}}}]
    named = {"type": "function", "function": {"name": "f"}}
    for tool_choice, own in [("required", {"response_format": {"type": "json_object"}}),
                             (named, {"response_format": {"type": "json_schema", "json_schema": {
                                 "name": "a", "schema": {"type": "array"}}}}),
                             ("required", {"structured_outputs": {"regex": "a+"}}),
                             (named, {"structured_outputs": {"grammar": 'root ::= "a"'}})]:
        request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools,
                                        tool_choice=tool_choice, **own)
        constraint = resolve_tool_choice(request.tools, request.tool_choice, True, None).structured_outputs()
        assert request.to_sampling_params(8, {}, constraint).structured_outputs == constraint
    for tool_choice, so in [(named, {"choice": ["a"]}), ("required", {"choice": []})]:
        request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools,
                                        tool_choice=tool_choice, structured_outputs=so)
        constraint = resolve_tool_choice(request.tools, request.tool_choice, True, None).structured_outputs()
        with pytest.raises(ValueError, match="^structured_outputs"):
            request.to_sampling_params(8, {}, constraint)


def test_a_hermes_block_with_text_after_its_json_is_content():
    """As vLLM's parser, which reads the whole block as JSON: text after the object within the block makes it no
    call (json.loads: extra data), streamed or not."""
    text = 'Hi <tool_call>{"name": "f", "arguments": {"a": 1}} and more</tool_call> bye'
    assert HermesParser().parse(text) == (text, [])
    parser = HermesParser()
    _, _, content = _streamed(list(text), parser)
    assert (parser.calls, content) == ([], "Hi ")  # what was streamed of the call cannot be taken back
    # Whitespace after the object is JSON's own.
    assert [c.function.name for c in HermesParser().parse(text.replace(" and more", "\n "))[1]] == ["f"]


def test_required_with_defs_that_are_no_object_is_a_value_error():
    """As vLLM's _get_tool_schema_defs: a tool's $defs that is no object is refused naming tools (it raised an
    AttributeError, a 500)."""
    from pagedllm.entrypoints.openai.tool_calls import resolve_tool_choice
    from pagedllm.entrypoints.openai.tool_protocol import ChatCompletionToolsParam

    tool = ChatCompletionToolsParam(function={"name": "f", "parameters": {"type": "object", "$defs": [1]}})
    with pytest.raises(ValueError, match=r"^tools: \$defs .* 'f' must be an object"):
        resolve_tool_choice([tool], "required", True, None).structured_outputs()


def test_a_hermes_block_nested_too_deep_for_json_is_content():
    """As vLLM's parser, which takes any error reading a block: arguments nested deeper than json.loads reads are
    no call but content, streamed or not (the RecursionError was a 500)."""
    text = 'Hi <tool_call>{"name": "f", "arguments": {"a": ' + "[" * 5000 + "]" * 5000 + "}}</tool_call> bye"
    assert HermesParser().parse(text) == (text, [])
    parser = HermesParser()
    assert "".join(parser.feed(piece)[0] for piece in [text[:50], text[50:]]) + parser.finish()[0] == "Hi "
    assert parser.calls == []


def test_a_hermes_call_with_its_arguments_under_parameters_keeps_them():
    """Some models write Llama 3's "parameters" in a <tool_call> block: the call has those arguments, streamed or not
    (it was a call with none, {}, its arguments dropped; vLLM's parser makes the answer content)."""
    text = 'Hi <tool_call>{"name": "f", "parameters": {"city": "Paris"}}</tool_call>'
    content, calls = HermesParser().parse(text)
    assert (content, [(c.function.name, c.function.arguments) for c in calls]) == ("Hi ", [("f", '{"city": "Paris"}')])
    assert _streamed(list(text), HermesParser())[0] == [{"name": "f", "arguments": '{"city": "Paris"}'}]
    assert HermesParser().parse(text.replace('{"city": "Paris"}', '"Paris"')) == (
        text.replace('{"city": "Paris"}', '"Paris"'), [])  # arguments that are no object: no call


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral", "required"])
def test_a_streamed_call_is_read_once_not_again_on_every_delta(parser, monkeypatch):
    """Each delta's text is read on from where the last read of the call stopped, a long string argument included:
    read from the call's start on every delta, 20 kB of arguments took seconds of the server's event loop."""
    from pagedllm.entrypoints.openai import tool_calls
    from pagedllm.entrypoints.openai.tool_calls import make_auto_parser

    arguments = json.dumps({"path": "a.py", "content": 'print("\\\\")\n' * 2000})
    text = {"hermes": '<tool_call>{"name": "write", "arguments": ' + arguments + "}</tool_call>",
            "llama3_json": '{"name": "write", "parameters": ' + arguments + "}",
            "mistral": "[TOOL_CALLS]write[ARGS]" + arguments,
            "required": '[{"name": "write", "parameters": ' + arguments + "}]"}[parser]
    read, read_on = [], tool_calls._CallScanner.read_on  # how much of each delta's text is read (past what was)
    monkeypatch.setattr(tool_calls._CallScanner, "read_on", lambda scanner, buffer: read.append(
        len(buffer) - max(scanner.at, scanner.searched)) or read_on(scanner, buffer))
    streamed, _, _ = _streamed([text[i:i + 4] for i in range(0, len(text), 4)],
                               JsonArrayParser() if parser == "required" else make_auto_parser(parser))
    assert streamed == [{"name": "write", "arguments": arguments}]
    assert sum(read) < 2 * len(text)


def test_an_auto_tool_choice_message_keeps_its_content_unstripped():
    """As vLLM's: the content beside auto's calls is what the parser read, whitespace and all, and None only where
    there are calls and it is whitespace only; an answer without calls is its text as generated."""
    from pagedllm.entrypoints.openai.tool_calls import ToolChoice

    choice = ToolChoice("auto", [])
    text = 'I will check.\n\n<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    content, calls = choice.make_parser().parse(text)
    assert choice.message_content(content, calls) == "I will check.\n\n"
    content, calls = choice.make_parser().parse("\n" + text[text.index("<tool_call>"):])
    assert choice.message_content(content, calls) is None
    assert choice.message_content(*choice.make_parser().parse(" Hi there.\n")) == " Hi there.\n"



@pytest.mark.parametrize("mode, texts, finish", [
    ("auto", ['<tool_call>{"name": "f", "arguments": {"a": 1}}', " and more</tool_call>"], "tool_calls"),
    ("named", ['{"a": 1}', ""], "stop"),
])
def test_a_streamed_call_delta_makes_the_finish_tool_calls_though_its_block_is_no_call(mode, texts, finish):
    """As vLLM's chat_completion_stream_generator (its tools_streamed): once a call delta has been streamed, the
    choice's finish_reason is "tool_calls" (a named tool_choice's still "stop"), though the Hermes block it came from
    turns out to be no call (text after its JSON), which takes it out of the parser's calls."""
    from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
    from pagedllm.entrypoints.openai.tool_calls import ToolChoice
    from pagedllm.outputs import CompletionOutput

    tool_choice = ToolChoice(mode, [], "f" if mode == "named" else None, parser="hermes")
    parser, streamed = tool_choice.make_parser(), [False]
    steps = [CompletionOutput(0, texts[0], [1]), CompletionOutput(0, texts[1], [2], finish_reason="stop")]
    (first, first_finish), (_, last_finish) = [OpenAIServingChat._stream_delta(step, parser, tool_choice, streamed)
                                               for step in steps]
    assert first.tool_calls and first_finish is None and streamed == [True]
    assert last_finish == finish and (mode == "named" or parser.calls == [])
