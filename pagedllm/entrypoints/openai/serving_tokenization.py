"""OpenAIServingTokenization: /tokenize (a prompt, or messages through the chat template) and /detokenize,
in vLLM's shapes, so clients can count tokens exactly as the server will."""
from __future__ import annotations

from typing import Any, Optional

from pagedllm.entrypoints.openai.chat_utils import chat_request_prompt
from pagedllm.entrypoints.openai.errors import BadRequestError
from pagedllm.entrypoints.openai.protocol import (DetokenizeRequest, DetokenizeResponse, TokenizeChatRequest,
                                                  TokenizeRequest, TokenizeResponse)
from pagedllm.entrypoints.openai.serving_engine import named_field
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels


class OpenAIServingTokenization:
    def __init__(self, tokenizer: Any, models: OpenAIServingModels, chat_template: Optional[str],
                 default_chat_template_kwargs: Optional[dict[str, Any]] = None,
                 chat_template_content_format: str = "auto") -> None:
        self.tokenizer = tokenizer
        self.models = models
        self.chat_template = chat_template
        self.default_chat_template_kwargs = default_chat_template_kwargs
        self.chat_template_content_format = chat_template_content_format

    def create_tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.models.check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            try:
                tokens = chat_request_prompt(self.tokenizer, request, self.chat_template,
                                             self.default_chat_template_kwargs, self.chat_template_content_format)
            except ValueError as e:
                raise BadRequestError(str(e), named_field(e)) from e
        else:
            tokens = self.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        return TokenizeResponse(
            count=len(tokens), max_model_len=self.models.max_model_len, tokens=tokens,
            token_strs=self.tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None)

    def create_detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.models.check_model(request.model)
        vocab_size = len(self.tokenizer)
        bad = [t for t in request.tokens if not 0 <= t < vocab_size]
        if bad:
            raise BadRequestError(f"tokens: token id {bad[0]} is out of vocabulary (size {vocab_size}).", "tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))
