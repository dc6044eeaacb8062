"""Tool calling: the constraint a tool_choice puts on the output, and reading tool calls back out of the text.

- "none": the tools go to the chat template; the answer is plain content.
- "required": the output must be a JSON array of {"name": <a tool's name>, "parameters": <its arguments>}
  (vLLM's format), enforced by a JSON-schema grammar built from the tools' parameter schemas.
- a named function: the output must be that function's arguments object.
- "auto": the model decides; calls are parsed out of free text in the model family's format when the chat
  template teaches one pagedllm knows or --tool-call-parser names it: Hermes, <tool_call>{"name": ...,
  "arguments": {...}}</tool_call> (Qwen2/3 and others), here; Llama 3's JSON, Python-style lists and Mistral's
  [TOOL_CALLS] in tool_call_parsers; or in a format of one's own, a ToolCallParser subclass that a
  --tool-parser-plugin file registers with ToolParserManager (vLLM's plugin interface).
"""
from __future__ import annotations

import importlib.util
import json
import random
import string
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional, Union

from pagedllm.entrypoints.openai.tool_protocol import (ChatCompletionToolsParam, DeltaFunctionCall, DeltaToolCall,
                                                       FunctionCall, NamedToolChoice, ToolCall)
from pagedllm.structured_output.params import StructuredOutputsParams

_HERMES_START, _HERMES_END = "<tool_call>", "</tool_call>"
# The keys a Hermes block's arguments go under: "arguments", or "parameters" as models trained on Llama 3's format
# write them (the first the object has). Read under "arguments" only, such a call lost its arguments ({}).
_HERMES_ARGUMENTS = ("arguments", "parameters")
# what a chat template holds -> the format it teaches (Llama 3.1-3.3's templates tell the model to answer with
# {"name": function name, "parameters": dictionary of argument name and its value})
_TEMPLATE_MARKS = ((_HERMES_START, "hermes"), ("[TOOL_CALLS]", "mistral"),
                   ('"parameters": dictionary of argument name', "llama3_json"), ("<|python_tag|>", "llama3_json"))


def detect_tool_call_parser(chat_template: Optional[str]) -> Optional[str]:
    """The parser for the format a chat template teaches its model, if it teaches one we know."""
    return next((parser for mark, parser in _TEMPLATE_MARKS if chat_template and mark in chat_template), None)


class ToolParserManager:
    """vLLM's registry of the tool-call formats by their --tool-call-parser names: hermes here, llama3_json /
    llama4_json, pythonic / llama4_pythonic and mistral in tool_call_parsers, and any a --tool-parser-plugin file
    registers: ``@ToolParserManager.register_module("name")`` on a ToolCallParser subclass (whose feed and finish
    keep ToolCallParser's contract) makes it the parser of tool_choice "auto" under --tool-call-parser name."""

    tool_parsers: dict[str, type["ToolCallParser"]] = {}

    @classmethod
    def register_module(cls, name: Union[str, list[str]]) -> Callable[[type], type]:
        """A class decorator registering the class under ``name`` (or each of a list of names); a name registered
        before is taken over, as vLLM's (force=True)."""
        def register(parser_cls: type) -> type:
            if not (isinstance(parser_cls, type) and issubclass(parser_cls, ToolCallParser)):
                raise TypeError(f"a tool parser must be a subclass of ToolCallParser, got {parser_cls!r}")
            for each in [name] if isinstance(name, str) else name:
                cls.tool_parsers[each] = parser_cls
            return parser_cls
        return register

    @classmethod
    def _register_builtins(cls) -> None:
        """Registers the formats tool_call_parsers defines (imported here, as it builds on this module). A plugin's
        registrations must come after these, or importing them later takes back a built-in name the plugin took."""
        from pagedllm.entrypoints.openai import tool_call_parsers  # noqa: F401

    @classmethod
    def list_registered(cls) -> list[str]:
        cls._register_builtins()
        return sorted(cls.tool_parsers)

    @classmethod
    def get_tool_parser(cls, name: str) -> type["ToolCallParser"]:
        if name not in cls.list_registered():
            raise KeyError(f"tool call parser {name!r} is not registered (choose from "
                           f"{', '.join(cls.list_registered())})")
        return cls.tool_parsers[name]

    @classmethod
    def import_tool_parser(cls, plugin_path: str) -> None:
        """Runs the Python file ``plugin_path`` as a module named after it (vLLM's import_tool_parser), whose
        register_module calls add its parsers, taking over any name registered before, a built-in one too (vLLM's:
        its registry loads a built-in format only when no plugin took the name). ValueError when it cannot be read
        or fails."""
        cls._register_builtins()
        module_name = Path(plugin_path).stem
        spec = importlib.util.spec_from_file_location(module_name, plugin_path)
        if spec is None or spec.loader is None or not Path(plugin_path).is_file():
            raise ValueError(f"--tool-parser-plugin {plugin_path}: no such Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[module_name]
            raise ValueError(f"--tool-parser-plugin {plugin_path}: importing it failed: {e!r}") from e


def make_auto_parser(name: str) -> "ToolCallParser":
    """A new parser of the --tool-call-parser format ``name`` (one ToolParserManager has)."""
    return ToolParserManager.get_tool_parser(name)()


@dataclass
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[ChatCompletionToolsParam]
    name: Optional[str] = None
    parallel: bool = True
    parser: str = "hermes"  # the format "auto" reads calls in (ToolParserManager), whose call ids every mode makes

    def structured_outputs(self) -> Optional[StructuredOutputsParams]:
        if self.mode == "named":
            schema = next(t.function.parameters for t in self.tools if t.function.name == self.name)
            return StructuredOutputsParams(json=schema or {"type": "object"})
        if self.mode == "required":
            return StructuredOutputsParams(json=_required_calls_schema(self.tools, self.parallel))
        return None

    def make_parser(self) -> Optional["ToolCallParser"]:
        if self.mode == "named":
            return NamedFunctionParser(name=self.name, short_ids=self.parser == "mistral")
        if self.mode == "required":
            return JsonArrayParser(short_ids=self.parser == "mistral")
        if self.mode == "auto":
            return make_auto_parser(self.parser)
        return None

    def message_content(self, content: Optional[str], calls: list[ToolCall]) -> Optional[str]:
        """An unstreamed message's content beside the ``calls`` read out of it, as vLLM's: as the parser read it,
        unstripped, but None where there are calls and it is whitespace only; "" with a required or named
        tool_choice, whose output is all calls (vLLM's ``content or ""``). None (an answer all reasoning, or a parser's
        no content) stays."""
        if self.mode in ("required", "named"):
            return (content or "").strip()
        return None if calls and not (content or "").strip() else content

    def kept_calls(self, calls: list[ToolCall]) -> list[ToolCall]:
        """The calls the answer carries: with parallel_tool_calls false the first only, as vLLM keeps them (a
        grammar already holds "required" to one)."""
        return calls if self.parallel else calls[:1]

    def kept_deltas(self, deltas: list[DeltaToolCall]) -> list[DeltaToolCall]:
        """A stream's call deltas of the calls kept_calls keeps."""
        return deltas if self.parallel else [delta for delta in deltas if delta.index == 0]

    def finish_reason(self, called: bool, finish_reason: Optional[str]) -> Optional[str]:
        """OpenAI says "tool_calls" when the model chose to call (auto/required) and stopped; a forced named call
        "stops". called: the answer has calls, or (streamed) a call delta was sent."""
        if called and finish_reason == "stop" and self.mode in ("auto", "required"):
            return "tool_calls"
        return finish_reason


def resolve_tool_choice(tools: Optional[list[ChatCompletionToolsParam]],
                        tool_choice: Union[str, NamedToolChoice, None], parallel_tool_calls: Optional[bool],
                        parser: Optional[str]) -> Optional[ToolChoice]:
    """Checks tools/tool_choice against each other (ValueError naming the field) and returns the choice. An empty
    tools array is refused, as OpenAI and vLLM refuse it."""
    if tools is not None and not tools:
        raise ValueError("tools must not be an empty array: give at least one tool, or leave the field out.")
    if not tools:
        if tool_choice not in (None, "none"):
            raise ValueError("tool_choice needs tools: the request has none.")
        return None
    names = [t.function.name for t in tools]
    parallel = parallel_tool_calls is not False
    if isinstance(tool_choice, NamedToolChoice):
        if tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names function {tool_choice.function.name!r}, which is not among the "
                             f"tools ({', '.join(names)}).")
        return ToolChoice("named", tools, tool_choice.function.name, parallel, parser or "hermes")
    # None is a tool_choice given as null (ChatCompletionRequest makes a missing one "auto"): as vLLM's, calls are
    # read where a tool-call format is known, and otherwise the answer is plain text, the tools still rendered.
    mode = tool_choice if tool_choice is not None else "none" if parser is None else "auto"
    if mode not in ("none", "auto", "required"):
        raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {mode!r}.")
    if mode == "auto" and parser is None:
        # vLLM's words first, which clients look for to fall back to tools of their own making.
        raise ValueError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set. '
                         "(pagedllm needs only --tool-call-parser, where the model's chat template teaches no "
                         "tool-call format it knows; 'required' or a named function needs neither.)")
    return ToolChoice(mode, tools, None, parallel, parser or "hermes")


def _required_calls_schema(tools: list[ChatCompletionToolsParam], parallel: bool) -> dict:
    """[{"name": ..., "parameters": ...}, ...] with each item one of the tools; $defs are hoisted to the top so
    each tool's $refs still resolve."""
    defs: dict = {}
    items = []
    for tool in tools:
        parameters = dict(tool.function.parameters or {"type": "object"})
        tool_defs = parameters.pop("$defs", {})
        if not isinstance(tool_defs, dict):  # as vLLM's _get_tool_schema_defs refuses it
            raise ValueError(f"tools: $defs in the parameters of tool {tool.function.name!r} must be an object, got "
                             f"{type(tool_defs).__name__}.")
        for def_name, definition in tool_defs.items():
            if defs.setdefault(def_name, definition) != definition:
                raise ValueError(f"tools: two tools define $defs/{def_name} differently.")
        items.append({"type": "object", "required": ["name", "parameters"], "additionalProperties": False,
                      "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                     "parameters": parameters}})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


# ---------------------------------------------------------------------------------------------- parsers
@dataclass
class ToolCallParser:
    """Reads tool calls out of generated text as it streams. feed() takes the new text and returns the content
    to show and the tool-call deltas completed by it; finish() flushes what is left. `calls` holds every call."""

    calls: list[ToolCall] = field(default_factory=list)
    # Mistral's 9 letters and digits for the calls' ids (its chat templates refuse a conversation whose calls have
    # other ids), whatever reads the calls: its own format, or the JSON of a required or named tool_choice.
    short_ids: bool = False
    _buffer: str = ""
    _emitted: int = 0  # how much of the call being read's arguments has been handed out
    _open: bool = False  # whether the call being read is open (the last of `calls`, its id handed out)
    _opened: int = 0  # calls opened so far: a stream's delta index of the next (a call found broken keeps its own)
    _position: int = 0  # parsers reading calls one after another: where the next one (or what is before it) starts
    _scanner: Optional["_CallScanner"] = None  # the reading of the object being read (_scan)

    def feed(self, delta_text: str) -> tuple[str, list[DeltaToolCall]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        return "", []

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The whole text at once: (content, calls)."""
        content, _ = self.feed(text)
        rest, _ = self.finish()
        return content + rest, self.calls

    def _scan(self, start: int, arguments_keys: tuple[str, ...]) -> "_CallScan":
        """What has arrived of the buffer's object at ``start``, read on from where the last read of it stopped
        (_CallScanner), or from its start where the buffer no longer holds what that read."""
        scanner = self._scanner
        if scanner is None or (scanner.start, scanner.arguments_keys) != (start, arguments_keys) or \
                not self._buffer.startswith(scanner.seen, start):
            scanner = self._scanner = _CallScanner(start, arguments_keys)
        return scanner.read_on(self._buffer)

    def _stream_call(self, text: str, found: "_CallScan") -> Optional[DeltaToolCall]:
        """What the call being read (found in ``text``) has grown by: all of it, with its id and name, when it
        opens (once its name is read); None when nothing. Its arguments are the text of its arguments value (in the
        form _streamed_arguments gives), so the deltas join to what the whole text gives; a call without one, once
        complete, takes none ("{}")."""
        if found.name is None:
            return None
        if found.arguments is not None:
            arguments = self._streamed_arguments(text[found.arguments[0]:found.arguments[1]], found.end is not None)
        else:
            arguments = "{}" if found.end is not None else ""
        new = arguments[self._emitted:]
        self._emitted = len(arguments)
        if not self._open:
            self._open, self._opened = True, self._opened + 1
            self.calls.append(self._make_call(found.name, arguments))
            call = self.calls[-1]
            return DeltaToolCall(index=self._opened - 1, id=call.id, type="function",
                                 function=DeltaFunctionCall(name=found.name, arguments=arguments))
        self.calls[-1].function.arguments = arguments
        return DeltaToolCall(index=self._opened - 1, function=DeltaFunctionCall(arguments=new)) if new else None

    def _streamed_arguments(self, raw: str, complete: bool) -> str:
        """The text a stream gives of the call being read's arguments, whose JSON text so far is ``raw`` (all of it
        when ``complete``): the model's own text, which a format whose vLLM stream sends another form of it
        replaces. What it gives must only grow as ``raw`` grows."""
        return raw

    def _read_call(self, found: "_CallScan", deltas: list[DeltaToolCall]) -> bool:
        """Adds to ``deltas`` what the call being read (``found`` in the buffer) has grown by; True once it is
        complete, reading then going on after it with the next call unread."""
        delta = self._stream_call(self._buffer, found)
        if delta is not None:
            deltas.append(delta)
        if found.end is None:
            return False
        self._position = found.end
        self._next_call()
        return True

    def _content_up_to(self, tag: str, content: list[str]) -> bool:
        """Moves the buffer's text before ``tag`` to ``content``; True when the tag has arrived (the buffer then
        starts with it), False when not (the buffer then keeps only a tail that may be the tag's start)."""
        start = self._buffer.find(tag)
        if start < 0:
            start = len(self._buffer) - _partial_tag_length(self._buffer, tag)
        content.append(self._buffer[:start])
        self._buffer = self._buffer[start:]
        return self._buffer.startswith(tag)

    def _make_call(self, name: str, arguments: str) -> ToolCall:
        """A call read out of the text, with an id of the kind the chat template takes back (short_ids)."""
        short_id = {"id": "".join(random.choices(string.ascii_letters + string.digits, k=9))} if self.short_ids else {}
        return ToolCall(function=FunctionCall(name=name, arguments=arguments), **short_id)

    def _next_call(self) -> None:
        """The call being read is complete: the next one starts unread."""
        self._emitted, self._open = 0, False


@dataclass
class NamedFunctionParser(ToolCallParser):
    """The whole output is the named function's arguments: streamed as argument text as it comes."""

    name: str = ""

    def feed(self, delta_text: str) -> tuple[str, list[DeltaToolCall]]:
        if not delta_text:
            return "", []
        if not self.calls:
            call = self._make_call(self.name, delta_text)
            self.calls.append(call)
            return "", [DeltaToolCall(index=0, id=call.id, type="function",
                                      function=DeltaFunctionCall(name=self.name, arguments=delta_text))]
        self.calls[0].function.arguments += delta_text
        return "", [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta_text))]

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The whole text at once, as vLLM's: the call, its arguments the text as it is, but none where the text is
        whitespace only (cut off by max_tokens before the arguments began). Streamed, as vLLM's, any text opens it."""
        return ("", []) if not text.strip() else super().parse(text)


@dataclass
class JsonArrayParser(ToolCallParser):
    """A JSON array of {"name", "parameters"} objects (tool_choice "required"). A call opens once its name is read,
    and its arguments, the raw text of its "parameters" value, stream as they are generated (with the grammar's ", "
    and ": " separators that text is json.dumps's form of them). Streamed, a call cut off (max_tokens) keeps what it
    had; read at once (parse), the text is all calls or none, as vLLM's."""

    def feed(self, delta_text: str) -> tuple[str, list[DeltaToolCall]]:
        self._buffer += delta_text
        deltas = []
        while True:
            start = self._next_value_start()
            if start is None or self._buffer[start] != "{":  # the grammar allows objects only
                return "", deltas
            if not self._read_call(self._scan(start, ("parameters",)), deltas):
                return "", deltas  # the element is not complete yet

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The whole text at once, as vLLM's: the calls of a JSON array of {"name": <a string>, "parameters": <an
        object or null>} objects (its FunctionDefinition), each call's arguments json.dumps's form of them
        (_dumped_arguments); no calls at all where the text is no such array (cut off by max_tokens, say), as vLLM's
        reading fails as a whole."""
        try:
            calls = json.loads(text)
        except (ValueError, RecursionError):
            return "", []
        if not isinstance(calls, list) or not all(
                isinstance(call, dict) and isinstance(call.get("name"), str)
                and isinstance(call.get("parameters"), (dict, type(None))) for call in calls):
            return "", []
        self.calls = [self._make_call(call["name"], json.dumps(call.get("parameters"), ensure_ascii=False))
                      for call in calls]
        return "", self.calls

    def _next_value_start(self) -> Optional[int]:
        """Skips the opening bracket, separators and whitespace before the next element."""
        i = self._position
        while i < len(self._buffer) and self._buffer[i] in " \t\r\n[,":
            i += 1
        self._position = i
        if i >= len(self._buffer) or self._buffer[i] == "]":
            return None
        return i


@dataclass
class _CallScan:
    """What has arrived of one {"name": ..., <arguments key>: ...} object: its name once that string is complete, the
    [start, end) span of the arguments value's text (the end, while the value is still arriving, is that of its text
    so far less trailing whitespace, which may turn out to lie outside it), and the object's end once it is closed."""

    name: Optional[str] = None
    arguments: Optional[tuple[int, int]] = None
    end: Optional[int] = None
    broken: Optional[int] = None  # where a "<" outside any string shows the object is no JSON (a tag follows)


@dataclass
class _CallScanner:
    """Reads the object at text[start] as far as it has arrived (grammar-made JSON; anything else is read as far as
    it makes sense). Only the object's own keys count: depth 1 is inside it, deeper is inside a value. The arguments
    are the value of the first of ``arguments_keys`` the object has. It keeps where it stopped, and a later read of
    a longer text (a stream's, which grows at its end) goes on from there: read from the object's start on every
    delta, a call took time quadratic in its length (seconds of the server's event loop for 20 kB of arguments)."""

    start: int
    arguments_keys: tuple[str, ...]
    scan: _CallScan = field(default_factory=_CallScan)
    seen: str = ""  # the text from start that the last read saw, which the next one's text must start with
    at: int = field(init=False)  # where reading goes on
    searched: int = 0  # the string open at `at` (if one is) has no closing quote before this
    depth: int = 0
    key: Optional[str] = None
    expecting_key: bool = True
    value_start: Optional[int] = None

    def __post_init__(self) -> None:
        self.at = self.start

    def read_on(self, text: str) -> _CallScan:
        """What has arrived of the object in ``text``, which holds what the last read saw."""
        scan, keys = self.scan, self.arguments_keys
        depth, key, expecting_key, value_start = self.depth, self.key, self.expecting_key, self.value_start
        i = self.at
        while i < len(text) and scan.end is None and scan.broken is None:
            c = text[i]
            if c == "<":  # no JSON outside a string: the object never closed before what follows (an end tag)
                scan.broken = i
                break
            if depth == 1 and not expecting_key and value_start is None and not c.isspace():
                value_start = i  # the current key's value begins
            if c == '"':
                end = _string_end(text, i, max(self.searched, i + 1))
                if end is None:  # the string has not closed yet
                    self.searched = len(text)
                    break
                if depth == 1:
                    try:
                        string = json.loads(text[i:end])
                    except ValueError:  # an escape JSON has not ("C:\dir"): the object is no JSON, this string no name
                        string = None
                    if expecting_key:
                        key = string
                    elif key == "name":
                        scan.name = string
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]" or (c == "," and depth == 1):
                if c != ",":
                    depth -= 1
                ending_arguments = key in keys and value_start is not None and scan.arguments is None
                if ending_arguments and depth == 1 and c != ",":
                    scan.arguments = (value_start, i + 1)  # a container value closed
                elif ending_arguments and depth <= 1:
                    scan.arguments = (value_start, value_start + len(text[value_start:i].rstrip()))  # a scalar ended
                if depth == 0:
                    scan.end = i + 1
                if c == ",":
                    key, expecting_key, value_start = None, True, None
            elif c == ":" and depth == 1:
                expecting_key = False
            i += 1
        self.seen, self.at = text[self.start:], i
        self.depth, self.key, self.expecting_key, self.value_start = depth, key, expecting_key, value_start
        if scan.end is None and scan.broken is None and key in keys and value_start is not None \
                and scan.arguments is None:  # the arguments so far, which more text may change
            return replace(scan, arguments=(value_start, value_start + len(text[value_start:].rstrip())))
        return scan


def _string_end(text: str, start: int, search_from: int) -> Optional[int]:
    """The index after the closing quote of the JSON string opening at text[start], which has none before
    search_from; None if it has not arrived. A quote closes it unless an odd number of backslashes come before it."""
    while (quote := text.find('"', search_from)) >= 0:
        escape = quote
        while text[escape - 1] == "\\":  # text[start] is a quote: the backslashes end there at the latest
            escape -= 1
        if (quote - escape) % 2 == 0:
            return quote + 1
        search_from = quote + 1
    return None


@ToolParserManager.register_module("hermes")
@dataclass
class HermesParser(ToolCallParser):
    """Free text with <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks. The text before the first
    block is content; no text after its tag is (vLLM's: what comes between and after the blocks is dropped). A
    block's call opens once its name is read and its arguments (their raw text) stream as they are generated; a
    block that is no call (its text does not parse as JSON, text after the object included, or is no object with a
    name) makes all of the text content, without calls, when the text is read at once (parse, as vLLM's
    extract_tool_calls); streamed, what was streamed of its call cannot be taken back, but the call is not among
    the calls."""

    _tagged: bool = False  # the first <tool_call> has come: nothing after it is content
    _broken: bool = False  # a block was no call

    def feed(self, delta_text: str) -> tuple[str, list[DeltaToolCall]]:
        self._buffer += delta_text
        content, deltas = [], []
        while True:
            if not self._content_up_to(_HERMES_START, [] if self._tagged else content):
                return "".join(content), deltas
            self._tagged = True
            rest = self._buffer[len(_HERMES_START):]
            body = len(self._buffer) - len(rest.lstrip())
            found = self._scan(body, _HERMES_ARGUMENTS) if self._buffer[body:body + 1] == "{" else None
            if found is not None:
                delta = self._stream_call(self._buffer, found)
                if delta is not None:
                    deltas.append(delta)
            # The block ends at the first end tag after its JSON (a string in it may hold one); at one where its
            # JSON broke off; while no call has opened, at the first end tag at all (the block may be no call).
            if found is not None and found.end is not None:
                end = self._buffer.find(_HERMES_END, found.end)
            elif found is not None and found.broken is not None and self._buffer.startswith(_HERMES_END,
                                                                                              found.broken):
                end = found.broken
            else:
                end = -1 if self._open else self._buffer.find(_HERMES_END)
            if end < 0:
                return "".join(content), deltas
            if self._open and not _is_call(self._buffer[body:end]):
                self.calls.pop()
                deltas = [delta for delta in deltas if delta.index != self._opened - 1]
                self._open = False
            self._broken |= not self._open
            self._buffer = self._buffer[end + len(_HERMES_END):]
            self._next_call()

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        """What is left: content before the first tag (a part of the tag held back); a block cut off inside its call
        keeps the arguments it had, though it is no call where its JSON is not whole (vLLM's extract_tool_calls
        reads a block without its end tag to the end of the text)."""
        rest, self._buffer = self._buffer, ""
        if rest.startswith(_HERMES_START):
            self._broken |= not _is_call(rest[len(_HERMES_START):])
        return ("" if self._tagged else rest), []

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The whole text at once, as vLLM's extract_tool_calls: a block that is no call makes all of it content; a
        call's arguments are json.dumps's form of them (_dumped_arguments), not the model's text of them."""
        content, calls = super().parse(text)
        if self._broken:
            return text, []
        for call in calls:
            call.function.arguments = _dumped_arguments(call.function.arguments)
        return content, calls


def _dumped_arguments(arguments: str) -> str:
    """A call's arguments, JSON text, as vLLM's extract_tool_calls gives them: json.dumps(value, ensure_ascii=False),
    so with its ", " and ": " separators and non-ASCII characters as they are (the model's "\\u00e9" is "é").
    Streamed, vLLM's Hermes parser sends the model's text instead."""
    return json.dumps(json.loads(arguments), ensure_ascii=False)


def _is_call(text: str) -> bool:
    """Whether a block's JSON is a call: an object with a name, and arguments (under each _HERMES_ARGUMENTS key it
    has) an object. JSON nested too deep for json.loads is no call either, as vLLM's parser takes any error reading
    a block (a RecursionError here was a 500)."""
    try:
        call = json.loads(text)
    except (ValueError, RecursionError):
        return False
    return isinstance(call, dict) and isinstance(call.get("name"), str) and all(
        isinstance(call.get(key, {}), dict) for key in _HERMES_ARGUMENTS)


def _partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
