"""OpenAIServingChat: /v1/chat/completions. The chat template is applied here, in the API server process, and
the engine gets token ids."""
from __future__ import annotations

import time
from typing import Any, AsyncIterator, Optional, Union

from pagedllm.engine.output_processor import RequestOutputKind
from pagedllm.entrypoints.openai.chat_utils import apply_chat_template
from pagedllm.entrypoints.openai.errors import BadRequestError
from pagedllm.entrypoints.openai.protocol import (ChatCompletionLogProb, ChatCompletionLogProbs,
                                                  ChatCompletionLogProbsContent, ChatCompletionRequest,
                                                  ChatCompletionResponse, ChatCompletionResponseChoice,
                                                  ChatCompletionResponseStreamChoice, ChatCompletionStreamResponse,
                                                  ChatMessage, DeltaMessage, UsageInfo, random_uuid)
from pagedllm.entrypoints.openai.serving_engine import (MIN_LOGPROB, OpenAIServing, check_output, sse,
                                                        sse_error)
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine_client: Any, models: OpenAIServingModels, chat_template: Optional[str]) -> None:
        super().__init__(engine_client, models)
        self.chat_template = chat_template

    async def create_chat_completion(self, request: ChatCompletionRequest
                                     ) -> Union[ChatCompletionResponse, AsyncIterator[str]]:
        """A response, or for stream=True the SSE events; raises OpenAIError before anything is generated."""
        model_name = self.models.check_model(request.model)
        try:
            prompt_token_ids = apply_chat_template(self.tokenizer, request.messages, self.chat_template,
                                                   request.add_generation_prompt, request.continue_final_message)
        except ValueError as e:
            raise BadRequestError(str(e), "messages") from e
        max_tokens = self._max_tokens(len(prompt_token_ids), request.requested_max_tokens, "messages",
                                      request.max_tokens_param)
        params = self._sampling_params(request, max_tokens)
        request_id = f"chatcmpl-{random_uuid()}"
        output_kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        results = await self._start(self.engine_client.generate(
            {"prompt_token_ids": prompt_token_ids}, params, request_id, priority=request.priority,
            output_kind=output_kind), "messages")
        if request.stream:
            return self.chat_completion_stream_generator(request, results, request_id, model_name,
                                                         len(prompt_token_ids))
        return await self.chat_completion_full_generator(request, results, request_id, model_name)

    async def chat_completion_stream_generator(self, request: ChatCompletionRequest,
                                               results: AsyncIterator[RequestOutput], request_id: str,
                                               model_name: str, num_prompt_tokens: int) -> AsyncIterator[str]:
        created = int(time.time())
        # With include_usage, every chunk carries "usage": null but the last, as from OpenAI.
        usage_field = {"usage": None} if request.include_usage else {}

        def chunk(choice: ChatCompletionResponseStreamChoice) -> str:
            return sse(ChatCompletionStreamResponse(
                id=request_id, object="chat.completion.chunk", created=created, model=model_name,
                choices=[choice], **usage_field).model_dump_json(exclude_unset=True))

        num_completion_tokens = 0
        try:
            for index in range(request.n or 1):
                yield chunk(ChatCompletionResponseStreamChoice(
                    index=index, delta=DeltaMessage(role="assistant", content=""), logprobs=None,
                    finish_reason=None))
            async for res in results:
                check_output(res)
                for output in res.outputs:
                    num_completion_tokens += len(output.token_ids)
                    if not output.text and not output.token_ids and output.finish_reason is None:
                        continue
                    yield chunk(ChatCompletionResponseStreamChoice(
                        index=output.index, delta=DeltaMessage(content=output.text),
                        logprobs=self._logprobs(request, output), finish_reason=output.finish_reason,
                        stop_reason=output.stop_reason))
            if request.include_usage:
                yield sse(ChatCompletionStreamResponse(
                    id=request_id, object="chat.completion.chunk", created=created, model=model_name, choices=[],
                    usage=UsageInfo.of(num_prompt_tokens, num_completion_tokens),
                ).model_dump_json(exclude_unset=True))
        except Exception as e:
            yield sse_error(e)
        yield sse("[DONE]")

    async def chat_completion_full_generator(self, request: ChatCompletionRequest,
                                             results: AsyncIterator[RequestOutput], request_id: str,
                                             model_name: str) -> ChatCompletionResponse:
        final = None
        async for res in results:  # FINAL_ONLY: one output, with all n choices
            check_output(res)
            final = res
        outputs = sorted(final.outputs, key=lambda o: o.index)
        choices = [ChatCompletionResponseChoice(
            index=o.index, message=ChatMessage(role="assistant", content=o.text), logprobs=self._logprobs(request, o),
            finish_reason=o.finish_reason, stop_reason=o.stop_reason) for o in outputs]
        num_prompt_tokens = len(final.prompt_token_ids)
        num_completion_tokens = sum(len(o.token_ids) for o in outputs)
        return ChatCompletionResponse(
            id=request_id, model=model_name, choices=choices,
            usage=UsageInfo.of(num_prompt_tokens, num_completion_tokens),
            prompt_logprobs=self._prompt_logprobs(final.prompt_logprobs))

    def _logprobs(self, request: ChatCompletionRequest, output: CompletionOutput
                  ) -> Optional[ChatCompletionLogProbs]:
        if not request.logprobs or output.logprobs is None:
            return None
        num_top = request.top_logprobs or 0
        return ChatCompletionLogProbs(content=[
            self._logprob_content(token_id, step, num_top) for token_id, step in zip(output.token_ids, output.logprobs)])

    def _logprob_content(self, token_id: int, step: dict[int, Logprob], num_top: int
                         ) -> ChatCompletionLogProbsContent:
        """The chosen token, and the num_top most likely ones in rank order (which may include it)."""
        chosen = step.get(token_id)
        top = sorted(((t, lp) for t, lp in step.items() if lp.rank is not None and 1 <= lp.rank <= num_top),
                     key=lambda item: item[1].rank)
        return ChatCompletionLogProbsContent(
            **self._logprob(token_id, chosen),
            top_logprobs=[ChatCompletionLogProb(**self._logprob(t, lp)) for t, lp in top[:num_top]])

    def _logprob(self, token_id: int, logprob: Optional[Logprob]) -> dict:
        token = self._token_str(token_id, logprob)
        return {"token": token, "logprob": max(logprob.logprob, MIN_LOGPROB) if logprob else MIN_LOGPROB,
                "bytes": list(token.encode("utf-8", errors="replace"))}
