"""vLLM's prompt types (vllm.inputs): what LLM.generate, LLMEngine.add_request and AsyncLLM.generate take.

A prompt is text, a TextPrompt ({"prompt": text}), or pre-tokenized: a list of token ids or a TokensPrompt
({"prompt_token_ids": [...]}, optionally with its "prompt" text); a dict may carry a "cache_salt", which keys its
KV blocks' hashes (requests share cached blocks only with requests of the same salt)."""
from __future__ import annotations

from typing import TypedDict, Union

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text the ids come from, if known: outputs' prompt field
    cache_salt: NotRequired[str]


PromptType = Union[str, list[int], TextPrompt, TokensPrompt]
