"""Pydantic shapes of OpenAI tool calling: tools and tool_choice in, tool_calls (and their stream deltas) out."""
from __future__ import annotations

import uuid
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_serializer


class _ToolModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionDefinition(_ToolModel):
    name: str
    description: Optional[str] = None
    # A JSON schema of the arguments object; absent means any object.
    parameters: Optional[dict[str, Any]] = None
    # OpenAI's (the Agents SDK sends true): no say in pagedllm's grammar, but the chat template gets it, as vLLM's.
    strict: Optional[bool] = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> dict:
        """As vLLM's: strict is left out of the dump (which the chat template gets) where the client left it out."""
        data = handler(self)
        if data.get("strict") is None:
            data.pop("strict", None)
        return data


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
