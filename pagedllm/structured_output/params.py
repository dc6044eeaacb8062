"""StructuredOutputsParams: what a request's output must match — exactly one of json, regex, choice, grammar,
json_object or structural_tag, as in vLLM."""
from __future__ import annotations

import json
from typing import Any, Optional, Union

import msgspec
from pydantic import TypeAdapter, ValidationError

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_TEXT_FIELDS = ("regex", "grammar", "structural_tag", "whitespace_pattern")
_BOOL_FIELDS = ("json_object", "disable_any_whitespace", "disable_additional_properties")
# vLLM's StructuredOutputsParams is a pydantic dataclass: its booleans take what pydantic reads as one ("true", "no",
# 1, 0.0, ...), and nothing else (2, "maybe").
_BOOL = TypeAdapter(bool)


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    # A JSON schema, as a dict or its JSON text.
    json: Optional[Union[str, dict[str, Any]]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    # EBNF (GBNF-style `root ::= ...`) grammar text.
    grammar: Optional[str] = None
    # Any JSON object (OpenAI's response_format {"type": "json_object"}).
    json_object: Optional[bool] = None
    # An xgrammar structural tag (JSON text): free text with constrained segments, used for tool calls.
    structural_tag: Optional[str] = None
    # JSON in one line with ", " and ": " separators. None: the engine's structured_outputs_config's, True unless
    # told (vLLM defaults to False): a small model sampling at temperature 1 falls into runs of newlines when any
    # whitespace is allowed, and never finishes the JSON. Set False to allow pretty-printed JSON.
    disable_any_whitespace: Optional[bool] = None
    # vLLM's options that its backends do not read from a request (its guidance backend takes
    # disable_additional_properties from the server's config): taken, so that a request or code written for vLLM is
    # served as vLLM serves it, and unused.
    whitespace_pattern: Optional[str] = None
    disable_additional_properties: bool = False
    # Set for a thinking model's answer (--reasoning-parser) by the Processor, or by the chat server, which knows the
    # chat's enable_thinking: the grammar is held back until the request samples one of these tokens, which end its
    # reasoning (vLLM's reasoning_ended); [] holds it back for nothing. Not part of the key.
    _reasoning_end_token_ids: Optional[list[int]] = None

    def __post_init__(self) -> None:
        self._check_types()
        if self.json_object is False:  # as vLLM, rather than read as not set
            raise ValueError("structured_outputs.json_object must be True if set; omit structured_outputs to disable "
                             "structured outputs.")
        set_kinds = [kind for kind in _KINDS if getattr(self, kind) is not None]
        if len(set_kinds) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(_KINDS)}; "
                             f"got {set_kinds or 'none'}.")
        # An empty string is a choice, as in vLLM: the output may be empty.
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings.")

    def _check_types(self) -> None:
        """Each field holds what the engine process decodes it as (msgspec, strictly typed: a value it cannot decode
        there ends the engine, not the request), else a ValueError names the field here, as vLLM's pydantic refuses
        such a request: a bool field takes what pydantic reads as one, and a tuple of choices is a list."""
        for name in _TEXT_FIELDS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured_outputs.{name} must be a string, got {value!r}.")
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if value is None and name != "disable_additional_properties":
                continue
            try:
                setattr(self, name, _BOOL.validate_python(value))
            except ValidationError:
                raise ValueError(f"structured_outputs.{name} must be a boolean, got {value!r}.") from None
        schema = self.json
        if schema is not None and not (isinstance(schema, str) or (
                isinstance(schema, dict) and all(isinstance(key, str) for key in schema))):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object, or its JSON text), got "
                             f"{schema!r}.")
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return next(kind for kind in _KINDS if getattr(self, kind) is not None)

    @property
    def spec(self) -> str:
        """The spec as canonical text: the key of the compiled-grammar cache."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, dict):
            return json.dumps(value)  # key order kept: the grammar emits properties in the schema's order
        if self.kind == "choice":
            return json.dumps(value)
        if self.kind == "json_object":
            return ""
        return value

    @property
    def key(self) -> tuple[str, str, bool]:
        return self.kind, self.spec, self.disable_any_whitespace
