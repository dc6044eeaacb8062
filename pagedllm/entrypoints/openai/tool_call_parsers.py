"""Tool-call formats of the model families beyond Hermes, read out of free text for tool_choice "auto" (vLLM's
--tool-call-parser names): llama3_json (Llama 3.x and 4's JSON calls), pythonic (Llama 3.2 / 4's Python-style
list of calls) and mistral (Mistral's [TOOL_CALLS]). Each follows tool_calls.ToolCallParser's contract: feed()
returns the content to show and the call deltas, finish() flushes, and a whole text read at once (parse) gives
what its stream gives, but where vLLM's extract_tool_calls reads a whole text otherwise than its stream: there parse
follows it, as a non-streamed answer of vLLM's.
"""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any, Optional

from pagedllm.entrypoints.openai.tool_calls import ToolCallParser, ToolParserManager, _CallScan
from pagedllm.entrypoints.openai.tool_protocol import DeltaFunctionCall, DeltaToolCall, ToolCall

_PYTHON_TAG = "<|python_tag|>"
_PYTHON_START, _PYTHON_END = "<|python_start|>", "<|python_end|>"
_MISTRAL_TOOL_CALLS, _MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"


def _answer_start(text: str, tag: str) -> Optional[int]:
    """Where the answer ``text`` begins past leading whitespace and an optional ``tag`` (and the whitespace after
    it); None while that is not known yet (nothing but whitespace, a part of the tag, or the tag alone so far)."""
    head = text.lstrip()
    if head.startswith(tag):
        body = head[len(tag):].lstrip()
    elif tag.startswith(head):
        return None
    else:
        body = head
    return len(text) - len(body) if body else None


@ToolParserManager.register_module(["llama3_json", "llama4_json"])
@dataclass
class Llama3JsonToolParser(ToolCallParser):
    """Llama 3.x's (and 4's) JSON calls, vLLM's llama3_json / llama4_json: an answer that starts, after an optional
    <|python_tag|>, with "{" is one or more {"name": ..., "parameters": {...}} objects ("arguments" is taken too)
    separated by ";"; any other answer is content, all of it, as vLLM streams it. A call opens once its name is read
    and its arguments stream as they come, in json.dumps's form (vLLM's); from an object that is no call (no name)
    or other text after the objects, the rest is content, but for text after calls, which is none (vLLM's stream
    drops it, as its reading of a whole text). A whole text is read as vLLM's extract_tool_calls reads it (parse)."""

    # "undecided" until the answer's start shows it, then "calls", "content", or "after" (past the calls, no content)
    _mode: str = "undecided"
    _dumped: Optional["_DumpedJson"] = None  # the call being read's arguments in json.dumps's form, as they come

    def _streamed_arguments(self, raw: str, complete: bool) -> str:
        """As vLLM's stream of them: json.dumps's form of the arguments (that parse gives), not the model's text."""
        if self._dumped is None:
            self._dumped = _DumpedJson()
        return self._dumped.read_on(raw, complete)

    def _next_call(self) -> None:
        super()._next_call()
        self._dumped = None

    def feed(self, delta_text: str) -> tuple[str, list[DeltaToolCall]]:
        self._buffer += delta_text
        if self._mode == "undecided":
            start = _answer_start(self._buffer, _PYTHON_TAG)
            if start is None:
                return "", []
            self._mode = "calls" if self._buffer.startswith("{", start) else "content"
            self._position = start
        if self._mode != "calls":
            content, self._buffer = self._buffer, ""
            return ("" if self._mode == "after" else content), []
        return self._read_calls()

    def _read_calls(self) -> tuple[str, list[DeltaToolCall]]:
        deltas = []
        while True:
            start = self._position
            while start < len(self._buffer) and self._buffer[start] in " \t\r\n;":
                start += 1
            if start == len(self._buffer):
                return "", deltas
            found = self._scan(start, ("parameters", "arguments")) \
                if self._buffer[start] == "{" else None
            if found is None or found.broken is not None or (found.end is not None and found.name is None):
                # No object, or one that is no call: the rest is content, where no call came before it. A call
                # that opened and then broke off is no call (what streamed of it cannot be taken back).
                if self._open:
                    self.calls.pop()
                    deltas = [delta for delta in deltas if delta.index != self._opened - 1]
                    self._next_call()
                self._mode = "after" if self.calls else "content"
                content, self._buffer = ("" if self.calls else self._buffer[start:]), ""
                return content, deltas
            if not self._read_call(found, deltas):
                return "", deltas

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The whole text at once, as vLLM's extract_tool_calls reads it (not as its stream does): each JSON object
        that begins at a "{" outside the objects before it, wherever it is, is a call {"name": ..., "arguments" (else
        "parameters"): ...}, whose arguments are json.dumps's form of that value; the text around the calls is no
        content. Where a "{" begins no JSON, or an object has no name or neither key, all of the text is content,
        without calls. Two objects with nothing between them are two calls (vLLM's loop skips a "{" right after an
        object, an off-by-one that makes such an answer content)."""
        decoder, calls, end = json.JSONDecoder(), [], 0
        for start in (i for i, c in enumerate(text) if c == "{"):
            if start < end:
                continue
            try:
                call, end = decoder.raw_decode(text, start)
                arguments = json.dumps(call["arguments"] if "arguments" in call else call["parameters"],
                                       ensure_ascii=False)
            except (ValueError, KeyError, RecursionError):
                return text, []
            if not isinstance(call.get("name"), str):
                return text, []
            calls.append(self._make_call(call["name"], arguments))
        self.calls = calls
        return ("", calls) if calls else (text, [])

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        """An answer that never showed its start is content, text after calls none; a call cut off keeps the
        arguments it had."""
        rest, self._buffer = self._buffer, ""
        if self._mode == "calls":
            return ("" if self.calls or not rest[self._position:].strip() else rest[self._position:]), []
        return rest, []


_JSON_SCALAR = re.compile(r'[^\s,:\[\]{}"]+')  # a number, true, false or null (what JSON has outside strings)
_STRING_RUN = re.compile(r'[^"\\]*')  # a string's characters up to its next escape or its end
# An escape arrived in full: a surrogate pair, another \uXXXX, a high surrogate shown to be alone, or \n and the like.
_ESCAPE = re.compile(r'\\(?:u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}|u(?![dD][89abAB])[0-9a-fA-F]{4}'
                     r'|u[0-9a-fA-F]{4}(?=[^\\]|\\[^u]|\\u(?![dD][c-fC-F])[0-9a-fA-F]{4})|[^u])')


@dataclass
class _DumpedJson:
    """JSON text as it arrives, turned into json.dumps(json.loads(text), ensure_ascii=False)'s form of it as far as
    the text so far shows it: ", " and ": " separators, no other whitespace, strings with only the escapes json.dumps
    writes, numbers as Python writes them (1.50 is 1.5). A string's characters come as they arrive; a number or
    literal once what follows ends it (or the text is complete). The form only grows: what it gives of a text is the
    start of what it gives of any longer one. Reading goes on where it stopped (linear in the text's length); it stops
    for good at what is no JSON."""

    text: str = ""
    at: int = 0  # where reading goes on in the raw text
    in_string: bool = False
    broken: bool = False

    def read_on(self, raw: str, complete: bool) -> str:
        pieces, i = [self.text], self.at
        while i < len(raw) and not self.broken:
            c = raw[i]
            if self.in_string:
                run = _STRING_RUN.match(raw, i).end()
                pieces.append(raw[i:run])
                i = run
                if run == len(raw):
                    break
                if raw[run] == '"':
                    pieces.append('"')
                    self.in_string, i = False, run + 1
                elif escape := _ESCAPE.match(raw, run):
                    try:
                        pieces.append(json.dumps(json.loads(f'"{escape.group()}"'), ensure_ascii=False)[1:-1])
                    except ValueError:
                        self.broken = True
                    i = escape.end()
                else:  # an escape not arrived in full (a surrogate pair waits for its second half)
                    break
            elif c.isspace():
                i += 1
            elif c in '"{}[]':
                self.in_string = c == '"'
                pieces.append(c)
                i += 1
            elif c in ",:":
                pieces.append(c + " ")
                i += 1
            else:
                end = _JSON_SCALAR.match(raw, i).end()
                if end == len(raw) and not complete:
                    break  # the number or literal may go on
                try:
                    pieces.append(json.dumps(json.loads(raw[i:end])))
                except ValueError:
                    self.broken = True
                i = end
        self.text, self.at = "".join(pieces), i
        return self.text


@ToolParserManager.register_module(["pythonic", "llama4_pythonic"])
@dataclass
class PythonicToolParser(ToolCallParser):
    """Python-style calls, vLLM's pythonic / llama4_pythonic: an answer that is a Python list of calls with keyword
    arguments of literal values, [get_weather(city="Paris", days=[1, 2]), ping()], optionally inside Llama 4's
    <|python_start|> ... <|python_end|>. Each call's arguments are its keywords as a JSON object. The list ends at
    the first "]" where what came from its "[" parses as such a list: its calls stream then, each whole, and what
    follows is no content (vLLM's stream drops it). An answer that does not start with "[", or whose list never
    closes into calls, is content, all of it. A whole text is read as vLLM's extract_tool_calls reads it (parse)."""

    _state: str = "undecided"  # until the answer's start shows it; then "list" (reading it) or "content"
    _start: int = 0  # where the list's "[" is in the buffer
    _tried: int = 0  # the text before this index has been read for the list's end (_list_end)
    _depth: int = 0  # the brackets open there
    _quote: str = ""  # the quotes of the string open there, if one is

    def feed(self, delta_text: str) -> tuple[str, list[DeltaToolCall]]:
        self._buffer += delta_text
        deltas: list[DeltaToolCall] = []
        if self._state == "undecided":
            start = _answer_start(self._buffer, _PYTHON_START)
            if start is None:
                return "", []
            self._state = "list" if self._buffer.startswith("[", start) else "content"
            self._start = self._tried = start
        if self._state == "list":
            deltas = self._read_list()
            if self._state == "list":
                return "", deltas
        content, self._buffer = self._buffer, ""
        return ("" if self.calls else content), deltas  # after the calls none (vLLM's stream drops it)

    def _read_list(self) -> list[DeltaToolCall]:
        while (end := self._list_end()) is not None:
            calls = _python_calls(self._buffer[self._start:end + 1])
            if calls is None:
                continue
            for name, arguments in calls:
                self.calls.append(self._make_call(name, arguments))
            self._state, self._buffer = "content", self._buffer[end + 1:]
            return [DeltaToolCall(index=i, id=call.id, type="function",
                                  function=DeltaFunctionCall(name=call.function.name,
                                                             arguments=call.function.arguments))
                    for i, call in enumerate(self.calls)]
        return []

    def _list_end(self) -> Optional[int]:
        """The next "]" closing the brackets opened from the list's "[" on, outside strings and comments, which is
        where the list may end; None until one arrives. Reading goes on where it stopped. (Parsing the list up to
        every "]" in it, those in its nested lists too, took time quadratic in its length, streamed or not.)"""
        text, i = self._buffer, self._tried
        while i < len(text):
            c = text[i]
            if self._quote:  # in a string, where a backslash escapes the character after it
                if text.startswith(self._quote, i):
                    i, self._quote = i + len(self._quote), ""
                    continue
                if c == "\\" and i + 1 == len(text) or len(self._quote) == 3 and self._quote.startswith(text[i:]):
                    break  # what the escape or the closing quotes are has not arrived
                i += 2 if c == "\\" else 1
                continue
            if c in "'\"":
                if len(text) - i < 3 and (c * 3).startswith(text[i:]):
                    break  # one or two quotes at the end: a triple quote may be arriving
                self._quote = c * 3 if text.startswith(c * 3, i) else c
                i += len(self._quote)
                continue
            if c == "#":  # a comment, to the end of its line
                newline = text.find("\n", i)
                if newline < 0:
                    break
                i = newline + 1
                continue
            if c in "([{":
                self._depth += 1
            elif c in ")]}":
                self._depth -= 1
                if c == "]" and self._depth == 0:
                    self._tried = i + 1
                    return i
            i += 1
        self._tried = i
        return None

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        """A list that never closed into calls is content, as an answer that never showed its start."""
        rest, self._buffer = self._buffer, ""
        return ("" if self.calls else rest), []

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The whole text at once, as vLLM's extract_tool_calls reads it: all of it (past Llama 4's <|python_start|>,
        without its <|python_end|>) parses as Python whose first statement is the list, which starts the text; else
        all of the text is content, without calls (text after the list, or whitespace before it, included)."""
        body = text[len(_PYTHON_START):].replace(_PYTHON_END, "") if text.startswith(_PYTHON_START) else text
        try:
            first = ast.parse(body).body[0] if body.startswith("[") else None
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            return text, []
        calls = _list_calls(first.value) if isinstance(first, ast.Expr) else None
        if calls is None:
            return text, []
        self.calls = [self._make_call(name, arguments) for name, arguments in calls]
        return "", self.calls


def _python_calls(text: str) -> Optional[list[tuple[str, str]]]:
    """(name, arguments as JSON) of each call of the Python list ``text``; None if it is not a list of calls by
    name with keyword arguments of literal values (as vLLM's pythonic parser reads it)."""
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    return _list_calls(tree)


def _list_calls(tree: ast.AST) -> Optional[list[tuple[str, str]]]:
    """_python_calls of the parsed expression ``tree``."""
    if not isinstance(tree, ast.List) or not tree.elts:  # "[]" is no calls (vLLM's pattern needs one): content
        return None
    calls = []
    for call in tree.elts:
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and not call.args):
            return None
        try:
            arguments = {keyword.arg: _literal(keyword.value) for keyword in call.keywords}
        except ValueError:
            return None
        if None in arguments:  # **kwargs
            return None
        calls.append((call.func.id, json.dumps(arguments, ensure_ascii=False)))
    return calls


def _literal(node: ast.AST) -> Any:
    """A literal argument's value, as vLLM's get_parameter_value reads it: Python's True/False/None and JSON's
    true/false/null both taken, a tuple's or a set's elements as a list, an f-string without placeholders as its
    text. ValueError for what JSON has no value of (..., bytes, a complex number) and for a dict key that is no
    constant (a ** or a tuple), as vLLM refuses them, making the answer content."""
    if isinstance(node, ast.Name) and node.id in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[node.id]
    if isinstance(node, ast.Dict):
        if not all(isinstance(key, ast.Constant) for key in node.keys):
            raise ValueError("a dict key that is no constant")
        return {_literal(key): _literal(value) for key, value in zip(node.keys, node.values)}
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [_literal(element) for element in node.elts]
    if isinstance(node, ast.JoinedStr) and all(isinstance(part, ast.Constant) for part in node.values):
        return "".join(part.value for part in node.values)
    value = ast.literal_eval(node)  # a constant, or a signed number; ValueError otherwise
    if not (value is None or isinstance(value, (str, int, float))):
        raise ValueError("no JSON value")
    return value


@ToolParserManager.register_module("mistral")
@dataclass
class MistralToolParser(ToolCallParser):
    """Mistral's calls, vLLM's mistral: text before [TOOL_CALLS] is content; after it comes either a JSON array (or
    one object) of {"name": ..., "arguments": {...}} (tokenizers before v11), or name[ARGS]{...} / name{...} (v11
    on), a further call after another [TOOL_CALLS]. A call opens once its name is read and its arguments (their raw
    text) stream as they come; an array's entries that are no call are skipped (vLLM's), and text after a call or
    array is content (a whole text's calls are read as vLLM's extract_tool_calls reads them: parse). Call ids
    are 9 letters and digits, as Mistral's chat templates require of the calls sent back to them."""

    short_ids: bool = True
    _state: str = "content"  # "content" (before a marker), "marker" (just after one), "json" or "named" (a call)
    _array: bool = False  # whether the JSON calls are an array's entries (else one object)

    def feed(self, delta_text: str) -> tuple[str, list[DeltaToolCall]]:
        self._buffer += delta_text
        content, deltas = [], []
        while True:
            if self._state == "content":
                if not self._content_up_to(_MISTRAL_TOOL_CALLS, content):
                    return "".join(content), deltas
                self._buffer, self._position, self._state = self._buffer[len(_MISTRAL_TOOL_CALLS):], 0, "marker"
            if self._state == "marker":
                rest = self._buffer.lstrip()
                if not rest:
                    return "".join(content), deltas
                self._array = rest[0] == "["
                self._state = "json" if rest[0] in "[{" else "named"
                self._position = len(self._buffer) - len(rest) + self._array  # past the array's "["
            done = self._read_json(deltas) if self._state == "json" else self._read_named(deltas)
            if not done:
                return "".join(content), deltas
            self._buffer, self._state = self._buffer[self._position:], "content"

    def _read_json(self, deltas: list[DeltaToolCall]) -> bool:
        """Reads the array's entries (or the one object) as far as they have arrived; True once it is closed."""
        while True:
            i = self._position
            while i < len(self._buffer) and self._buffer[i] in " \t\r\n,":
                i += 1
            self._position = i
            if i >= len(self._buffer):
                return False
            if self._buffer[i] == "]" and self._array:
                self._position = i + 1
                return True
            if self._buffer[i] != "{":  # no JSON calls after all: the rest is content
                return True
            if not self._read_call(self._scan(i, ("arguments",)), deltas):
                return False
            if not self._array:
                return True

    def _read_named(self, deltas: list[DeltaToolCall]) -> bool:
        """Reads name[ARGS]{...} (or name{...}) as far as it has arrived; True once its arguments are closed."""
        brace = self._buffer.find("{", self._position)
        if brace < 0:
            return False
        name = self._buffer[self._position:brace].strip().removesuffix(_MISTRAL_ARGS).strip()
        found = self._scan(brace, ())
        end = found.end if found.end is not None else len(self._buffer.rstrip())
        return self._read_call(_CallScan(name=name, arguments=(brace, end), end=found.end), deltas)

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        """What is left: content, but for a call cut off, which keeps the arguments it had."""
        rest, self._buffer = self._buffer, ""
        return ("" if self._open else rest[self._position:] if self._state != "content" else rest), []

    def parse(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        """The whole text at once (_read_whole), but with neither calls nor content None, not "", as vLLM's (its
        engine-based Mistral parser's content without calls is ``content or None``): "[TOOL_CALLS]" alone is a
        message with null content."""
        content, calls = self._read_whole(text)
        return (content if content or calls else None), calls

    def _read_whole(self, text: str) -> tuple[str, list[ToolCall]]:
        """The whole text at once. Where JSON follows the first [TOOL_CALLS] (tokenizers before v11), as vLLM's
        extract_tool_calls reads it: the first JSON value there (markers with nothing between count as one) holds
        the calls, an array of them or one object; its entries with a name or arguments are calls (name "" where it
        is no string), with arguments json.dumps's form of theirs ("{}" for none, a string as it is); text after
        the value is no content. Where that value is no JSON or has no call, the content is the text after the
        marker, stripped, without calls. Otherwise the calls are v11's (_named_calls)."""
        content, _, rest = text.partition(_MISTRAL_TOOL_CALLS)
        value_text = next((part.strip() for part in rest.split(_MISTRAL_TOOL_CALLS) if part.strip()), "")
        if not value_text.startswith(("[", "{")):
            return self._named_calls(text)
        try:
            value = json.JSONDecoder().raw_decode(value_text)[0]
        except (ValueError, RecursionError):
            return value_text, []
        entries = [value] if isinstance(value, dict) else value if isinstance(value, list) else []
        self.calls = [self._make_call(entry["name"] if isinstance(entry.get("name"), str) else "",
                                      _mistral_arguments(entry.get("arguments")))
                      for entry in entries if isinstance(entry, dict) and ("name" in entry or "arguments" in entry)]
        return (content, self.calls) if self.calls else (value_text, [])

    def _named_calls(self, text: str) -> tuple[str, list[ToolCall]]:
        """v11's calls in a whole text, as vLLM's extract_tool_calls reads them: the text after each [TOOL_CALLS],
        where there is any, is a call, its name what comes before [ARGS] or the arguments' "{" (all of it where none
        comes: arguments "{}"), its arguments the first JSON value from that "{" on (the rest, stripped, where it is
        no JSON); the text after them is no content, and the text before the first marker is content, stripped
        where there are calls."""
        content, *parts = text.split(_MISTRAL_TOOL_CALLS)
        decoder = json.JSONDecoder()
        for part in filter(None, parts):
            brace = part.find("{")
            name = (part if brace < 0 else part[:brace]).strip().removesuffix(_MISTRAL_ARGS).strip()
            arguments = "{}" if brace < 0 else part[brace:].strip()
            try:
                arguments = arguments[:decoder.raw_decode(arguments)[1]]
            except (ValueError, RecursionError):
                pass  # no JSON: the arguments are the text as it is
            self.calls.append(self._make_call(name, arguments))
        return (content.strip() if self.calls else content), self.calls


def _mistral_arguments(value: Any) -> str:
    """The arguments text of a call vLLM reads out of Mistral's JSON: none "{}", a string as it is, any other value
    in json.dumps's form."""
    if value is None:
        return "{}"
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
