"""Pydantic shapes of OpenAI tool calling: tools and tool_choice in, tool_calls (and their stream deltas) out."""
from __future__ import annotations

import uuid
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field


class _ToolModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionDefinition(_ToolModel):
    name: str
    description: Optional[str] = None
    # A JSON schema of the arguments object; absent means any object.
    parameters: Optional[dict[str, Any]] = None


class ChatCompletionToolsParam(_ToolModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_ToolModel):
    name: str


class NamedToolChoice(_ToolModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(_ToolModel):
    name: str
    # The arguments object as JSON text, as OpenAI sends it.
    arguments: str


class ToolCall(_ToolModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(_ToolModel):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(_ToolModel):
    """A streamed piece of tool call `index`: the first carries id, type and name; later ones argument text."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunctionCall] = None
