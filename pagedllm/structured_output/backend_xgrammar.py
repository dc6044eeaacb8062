"""The xgrammar backend: validates specs, compiles them against the tokenizer's vocabulary, and wraps the
per-request matcher.

xgrammar was chosen over llguidance because it ships CPU wheels with a torch bitmask kernel, compiles JSON
schemas into a token-mask cache ahead of time (masks then cost microseconds per step), and is what vLLM uses
by default, so behaviour matches what vLLM users expect.
"""
from __future__ import annotations

import json
import re
from typing import Any, Optional

import msgspec
import torch
import xgrammar as xgr

from pagedllm.structured_output.params import StructuredOutputsParams

# xgrammar's errors start with "[time] /path/file.cc:line: "; users need only the message.
_CPP_PREFIX = re.compile(r"^\[[\d:.]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


_COMMENT = re.compile(r"(#|//).*$")


def _is_ebnf(grammar: str) -> bool:
    """EBNF rules use `::=` outside comments (``#`` or ``//`` to the end of the line); anything else is treated as a
    Lark grammar, as vLLM's grammar_is_likely_lark tells them apart: a Lark grammar whose comment mentions `::=`
    is still Lark."""
    return any("::=" in _COMMENT.sub("", line) for line in grammar.split("\n"))


def choice_to_ebnf(choices: list[str]) -> str:
    """JSON string literals are valid xgrammar EBNF literals, escapes included. Characters beyond ASCII are written as
    themselves: xgrammar reads each \\u escape as one code point, so the surrogate pair JSON escapes a character beyond
    U+FFFF into would be two code points no text can hold."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def _json_schema(params: StructuredOutputsParams) -> Any:
    schema = params.json
    if isinstance(schema, str):
        try:
            return json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
    return schema


def _structural_tag_args(tag: str) -> tuple:
    """xgrammar's arguments for a structural tag: its JSON text, or for the legacy form vLLM also takes
    ({"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}) its tags and triggers."""
    try:
        legacy = json.loads(tag)
    except json.JSONDecodeError:
        return (tag,)  # xgrammar names what is wrong
    if not isinstance(legacy, dict) or "structures" not in legacy:
        return (tag,)
    tags = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
            for s in legacy["structures"]]
    return tags, legacy["triggers"]


def _build(params: StructuredOutputsParams, compiler: Optional[xgr.GrammarCompiler]):
    """Builds the grammar (compiler None: only parse it, to validate) or compiles it."""
    kind = params.kind
    if kind in ("json", "json_object"):
        # json_object is the schema of any object, so it honours disable_any_whitespace like any schema.
        schema = json.dumps(_json_schema(params) if kind == "json" else {"type": "object"})
        any_whitespace = not params.disable_any_whitespace  # None (the engine's default) only where validating
        if compiler is None:
            return xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace)
        return compiler.compile_json_schema(schema, any_whitespace=any_whitespace)
    if kind == "regex":
        return xgr.Grammar.from_regex(params.regex) if compiler is None else compiler.compile_regex(params.regex)
    if kind == "structural_tag":
        args = _structural_tag_args(params.structural_tag)
        return xgr.Grammar.from_structural_tag(*args) if compiler is None else compiler.compile_structural_tag(*args)
    grammar = choice_to_ebnf(params.choice) if kind == "choice" else params.grammar
    if _is_ebnf(grammar):
        return xgr.Grammar.from_ebnf(grammar) if compiler is None else compiler.compile_grammar(grammar)
    return xgr.Grammar.from_lark(grammar) if compiler is None else compiler.compile_lark(grammar)


def _clear_error(e: Exception, params: StructuredOutputsParams) -> ValueError:
    message = _CPP_PREFIX.sub("", str(e).strip()).strip()
    return ValueError(f"structured_outputs.{params.kind} is invalid: {message}")


# JSON-schema keywords xgrammar ignores (warning at most): an output it allows could break the schema, so a schema
# using them is refused, as vLLM's xgrammar backend refuses them (has_xgrammar_unsupported_json_features).
_UNSUPPORTED_ALWAYS = ("multipleOf", "contains", "minContains", "maxContains", "propertyNames", "patternProperties",
                       "dependentRequired", "dependentSchemas")
_LENGTH_BOUNDS = ("minLength", "maxLength")


def _unsupported_json_feature(schema) -> Optional[str]:
    """The first keyword of ``schema`` (at any depth) that xgrammar would not enforce, if any."""
    if isinstance(schema, list):
        return next((found for item in schema if (found := _unsupported_json_feature(item))), None)
    if not isinstance(schema, dict):
        return None
    for keyword in _UNSUPPORTED_ALWAYS:
        if keyword in schema:
            return keyword
    if schema.get("uniqueItems") is True:
        return "uniqueItems"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return "allOf of several schemas"
    for keyword in ("pattern", "format"):
        if keyword in schema and any(bound in schema for bound in _LENGTH_BOUNDS):
            return f"{keyword} with minLength/maxLength"
    subschemas = []
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            subschemas.extend(value.values())  # names to schemas: a property may be called "multipleOf"
        elif key not in ("enum", "const", "default", "examples", "required"):
            subschemas.append(value)
    return next((found for sub in subschemas if (found := _unsupported_json_feature(sub))), None)


# How deep a JSON schema's objects and arrays may nest (vLLM's MAX_STRUCTURED_OUTPUT_JSON_NESTING), and the extra
# levels a structural tag may wrap its schemas in (vLLM's STRUCTURAL_TAG_WRAPPER_NESTING): converting a schema to a
# grammar costs steeply more with depth (a minute at ~950 levels, in the frontend and again in the engine's one
# compile thread, where every other grammar waits behind it), and deeper still the checks here recurse past Python's
# limit.
MAX_STRUCTURED_OUTPUT_JSON_NESTING = 64
STRUCTURAL_TAG_WRAPPER_NESTING = 16


def _exceeds_json_nesting(spec: Any, limit: int) -> bool:
    """Whether a JSON document (or its text) nests objects and arrays deeper than ``limit``; walked level by level,
    without recursion, as vLLM's _exceeds_json_nesting. Text too deep for json.loads is too deep; malformed text is
    not judged here (the backend names what is wrong with it)."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except RecursionError:
            return True
        except ValueError:
            return False
    level = [spec]
    for _ in range(limit):
        level = [child for node in level if isinstance(node, (dict, list))
                 for child in (node.values() if isinstance(node, dict) else node) if isinstance(child, (dict, list))]
        if not level:
            return False
    return True


def _check_json_nesting(params: StructuredOutputsParams) -> None:
    """A JSON schema or structural tag nested deeper than vLLM allows is a ValueError (HTTP 400), as in vLLM's
    check_json_nesting."""
    if params.kind == "json":
        spec, limit = params.json, MAX_STRUCTURED_OUTPUT_JSON_NESTING
    elif params.kind == "structural_tag":
        spec, limit = params.structural_tag, MAX_STRUCTURED_OUTPUT_JSON_NESTING + STRUCTURAL_TAG_WRAPPER_NESTING
    else:
        return
    if _exceeds_json_nesting(spec, limit):
        raise ValueError(f"structured_outputs.{params.kind} is invalid: the JSON schema is nested too deeply: objects "
                         f"and arrays may nest at most {MAX_STRUCTURED_OUTPUT_JSON_NESTING} levels")


def validate_structured_outputs(params: StructuredOutputsParams) -> None:
    """Frontend check, without the tokenizer: a bad schema/regex/grammar becomes a ValueError (HTTP 400)."""
    _check_json_nesting(params)
    if params.kind == "json":
        if isinstance(params.json, dict):
            try:
                msgspec.msgpack.encode(params.json)  # as it crosses to the engine: MessagePack holds 64-bit integers
            except (OverflowError, TypeError) as e:
                raise ValueError(f"structured_outputs.json is invalid: {e}.") from None
        feature = _unsupported_json_feature(_json_schema(params))
        if feature is not None:
            raise ValueError(f"structured_outputs.json is invalid: {feature} is not supported (the grammar would "
                             "not enforce it, so outputs could break the schema)")
    try:
        _build(params, None)
    except ValueError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError (and friends) with the parser's message
        raise _clear_error(e, params) from None


class XgrammarGrammar:
    """One request's matcher: which tokens may come next, and the state after each accepted token."""

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: set[int]) -> None:
        # Without stop tokens (no EOS known), the tokenizer's own, which xgrammar finds.
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_token_ids) or None)

    def accept_token(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class XgrammarBackend:
    def __init__(self, tokenizer: Any, vocab_size: int, max_threads: int = 1) -> None:
        self.vocab_size = vocab_size
        tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # xgrammar's own cache is keyed by the spec too; ours (the manager's) also shares in-flight compiles.
        self.compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=max_threads, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        try:
            return _build(params, self.compiler)
        except Exception as e:
            raise _clear_error(e, params) from None

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)

