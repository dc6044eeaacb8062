"""OpenAIServingCompletion: /v1/completions, for one prompt or a batch (text or token ids), n choices each.

Choice i * n + j is prompt i's choice j, as with OpenAI and vLLM.
"""
from __future__ import annotations

import itertools
import os
import time
from typing import AsyncIterator, Optional, Union

from pagedllm.entrypoints.openai.errors import BadRequestError
from pagedllm.entrypoints.openai.protocol import (CompletionLogProbs, CompletionRequest, CompletionResponse,
                                                  CompletionResponseChoice, CompletionResponseStreamChoice,
                                                  CompletionStreamResponse, UsageInfo)
from pagedllm.entrypoints.openai.serving_engine import (MIN_LOGPROB, OpenAIServing, check_output, sse,
                                                        sse_error)
from pagedllm.entrypoints.openai.utils import merge_async_iterators
from pagedllm.outputs import CompletionOutput, RequestOutput, SampleLogprobs

# A prompt as text (None when given as token ids) and its token ids.
Prompt = tuple[Optional[str], list[int]]

# The most prompts one request may batch, each an engine request of its own (vLLM's VLLM_MAX_COMPLETION_PROMPTS).
MAX_COMPLETION_PROMPTS = int(os.environ.get("PAGEDLLM_MAX_COMPLETION_PROMPTS", "1024"))


class OpenAIServingCompletion(OpenAIServing):
    endpoint = "completion"

    async def create_completion(self, request: CompletionRequest
                                ) -> Union[CompletionResponse, AsyncIterator[str]]:
        """A response, or for stream=True the SSE events; raises OpenAIError before anything is generated."""
        model_name = self.models.check_model(request.model)
        if request.suffix is not None:
            raise BadRequestError("suffix is only supported for models with FIM completion rendering", "suffix")
        if request.stream and request.use_beam_search:  # as vLLM's: only chat streams beam search (its final beams)
            raise BadRequestError("Streaming is not currently supported with beam search", "use_beam_search")
        prompts = self._prompts(request)
        max_tokens = 1 if request.echo_only else request.max_tokens  # echo_only: the token generated is not sent
        params = [self._sampling_params(request, self._max_tokens(len(ids), max_tokens, "prompt"))
                  for _, ids in prompts]
        request_id = self._request_id("cmpl", request)
        generators = [
            self._generate({"prompt": text, "prompt_token_ids": ids, "cache_salt": request.cache_salt}, p,
                           f"{request_id}-{i}", request.priority, request.model)
            for i, ((text, ids), p) in enumerate(zip(prompts, params))]
        results = await self._start(merge_async_iterators(*generators), request, "prompt")
        if request.stream:
            return self.completion_stream_generator(request, prompts, results, request_id, model_name)
        return await self.completion_full_generator(request, prompts, results, request_id, model_name)

    def _prompts(self, request: CompletionRequest) -> list[Prompt]:
        prompt = request.prompt
        if prompt == "":  # refused as vLLM's body check does, even where the tokenizer would add a BOS token to it
            raise BadRequestError("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise BadRequestError("prompt must not be empty.", "prompt")
        if len(prompt) > MAX_COMPLETION_PROMPTS:  # before any is tokenized
            raise BadRequestError(f"prompt list length {len(prompt)} exceeds the maximum allowed count of "
                                  f"{MAX_COMPLETION_PROMPTS}. To increase this limit, set the "
                                  "PAGEDLLM_MAX_COMPLETION_PROMPTS environment variable.", "prompt")
        prompts = [(p, self.tokenizer.encode(p, add_special_tokens=request.add_special_tokens)) if isinstance(p, str)
                   else (None, list(p)) for p in prompt]
        if request.truncate_prompt_tokens is None:
            return prompts
        # cut prompts are their tokens (an echo decodes them)
        return [(None, self._truncated(request, ids)) for _, ids in prompts]

    @staticmethod
    def _generated(request: CompletionRequest, output: CompletionOutput
                   ) -> tuple[str, list[int], Optional[SampleLogprobs]]:
        """The output's text, tokens and logprobs as sent: none of them for echo_only."""
        if request.echo_only:
            return "", [], None if output.logprobs is None else []
        return output.text, output.token_ids, output.logprobs

    def _echoed(self, request: CompletionRequest, prompt: Prompt, res: RequestOutput, output: CompletionOutput
                ) -> tuple[str, list[int], Optional[SampleLogprobs]]:
        """The output's text, tokens and logprobs, with the prompt's in front when echoing. With return_token_ids
        the prompt is echoed by its tokens (and prompt_token_ids) alone, not its text, as vLLM's."""
        text, token_ids, logprobs = self._generated(request, output)
        if not request.echo:
            return text, token_ids, logprobs
        prompt_text, ids = prompt
        if request.return_token_ids:
            prompt_text = ""
        elif prompt_text is None:
            prompt_text = self.tokenizer.decode(ids)
        if logprobs is not None:
            logprobs = (res.prompt_logprobs or [None] * len(ids)) + logprobs
        return prompt_text + text, ids + token_ids, logprobs

    async def completion_stream_generator(self, request: CompletionRequest, prompts: list[Prompt],
                                          results: AsyncIterator[tuple[int, RequestOutput]], request_id: str,
                                          model_name: str) -> AsyncIterator[str]:
        created = int(time.time())
        n = request.n
        text_offsets = [0] * (len(prompts) * n)
        num_generated = [0] * (len(prompts) * n)  # each choice's completion tokens so far
        num_cached = [0] * len(prompts)  # each prompt's tokens found in the prefix cache
        started: set[int] = set()
        try:
            async for prompt_index, res in results:
                check_output(res)
                num_cached[prompt_index] = res.num_cached_tokens
                for output in res.outputs:
                    index = prompt_index * n + output.index
                    generated = self._generated(request, output)
                    num_generated[index] += len(generated[1])
                    first = index not in started
                    if not first:
                        text, token_ids, logprobs = generated
                    else:  # the first delta of a choice carries the echoed prompt
                        started.add(index)
                        text, token_ids, logprobs = self._echoed(request, prompts[prompt_index], res, output)
                    if not text and not token_ids and output.finish_reason is None:
                        continue
                    # As vLLM's: a chunk carries "usage" (its choice's so far) only with continuous_usage_stats;
                    # otherwise it has no "usage" key, include_usage or not (that usage comes in a last chunk).
                    usage = {"usage": UsageInfo.of(len(prompts[prompt_index][1]), num_generated[index])} \
                        if request.include_continuous_usage else {}
                    choice_logprobs = self._logprobs(request, token_ids, logprobs, text_offsets[index])
                    # vLLM's sets both in every chunk: null where not asked for (the prompt's: after the first)
                    ids = {"token_ids": generated[1] if request.return_token_ids else None,
                           "prompt_token_ids": prompts[prompt_index][1] if request.return_token_ids and first else None}
                    yield sse(CompletionStreamResponse(
                        id=request_id, object="text_completion", created=created, model=model_name,
                        choices=[CompletionResponseStreamChoice(
                            index=index, text=text, finish_reason=output.finish_reason,
                            stop_reason=output.stop_reason, logprobs=choice_logprobs, **ids)],
                        **usage).model_dump_json(exclude_unset=True))
                    # Offsets follow the tokens, not the text sent (held back while it may start a stop string),
                    # so the stream's are the unstreamed response's (vLLM's).
                    if choice_logprobs is not None and choice_logprobs.tokens:
                        text_offsets[index] = choice_logprobs.text_offset[-1] + len(choice_logprobs.tokens[-1])
            if request.include_usage:
                num_prompt_tokens = sum(len(ids) for _, ids in prompts)
                yield sse(CompletionStreamResponse(
                    id=request_id, object="text_completion", created=created, model=model_name, choices=[],
                    usage=UsageInfo.of(num_prompt_tokens, sum(num_generated), self._cached_tokens(sum(num_cached))),
                ).model_dump_json(exclude_unset=True))
        except Exception as e:
            yield sse_error(e)
        yield sse("[DONE]")

    async def completion_full_generator(self, request: CompletionRequest, prompts: list[Prompt],
                                        results: AsyncIterator[tuple[int, RequestOutput]], request_id: str,
                                        model_name: str) -> CompletionResponse:
        finals: dict[int, RequestOutput] = {}
        async for prompt_index, res in results:  # FINAL_ONLY: one output per prompt, with all n choices
            check_output(res)
            finals[prompt_index] = res
        n = request.n
        choices = []
        num_completion_tokens = 0
        for prompt_index, prompt in enumerate(prompts):
            res = finals[prompt_index]
            for output in sorted(res.outputs, key=lambda o: o.index):
                generated_ids = self._generated(request, output)[1]
                num_completion_tokens += len(generated_ids)
                text, token_ids, logprobs = self._echoed(request, prompt, res, output)
                choices.append(CompletionResponseChoice(
                    index=prompt_index * n + output.index, text=text,
                    logprobs=self._logprobs(request, token_ids, logprobs, 0), finish_reason=output.finish_reason,
                    stop_reason=output.stop_reason, prompt_logprobs=self._prompt_logprobs(res.prompt_logprobs),
                    **({"prompt_token_ids": prompt[1], "token_ids": generated_ids} if request.return_token_ids
                       else {})))
        num_prompt_tokens = sum(len(ids) for _, ids in prompts)
        num_cached = self._cached_tokens(sum(res.num_cached_tokens for res in finals.values()))
        return CompletionResponse(
            id=request_id, model=model_name, choices=choices,
            usage=UsageInfo.of(num_prompt_tokens, num_completion_tokens, num_cached))

    def _logprobs(self, request: CompletionRequest, token_ids: list[int], logprobs: Optional[SampleLogprobs],
                  text_offset: int) -> Optional[CompletionLogProbs]:
        """OpenAI's legacy shape; an echoed prompt's first token has no logprob (None)."""
        if request.logprobs is None or logprobs is None:
            return None
        offsets, token_logprobs, tokens, top_logprobs = [], [], [], []
        # at most logprobs + 1 alternatives (the token and the top ones; -1: all there are), also at an echoed
        # prompt's positions whose prompt_logprobs asked for more (vLLM's); with logprob_token_ids all there are
        # (the token and the ids asked for)
        every = request.logprobs == -1 or request.logprob_token_ids
        num_top = None if every else request.logprobs + 1
        for token_id, step in zip(token_ids, logprobs):
            chosen = step.get(token_id) if step is not None else None
            token = self._token_str(token_id, chosen, request.return_tokens_as_token_ids)
            tokens.append(token)
            token_logprobs.append(max(chosen.logprob, MIN_LOGPROB) if chosen else None)
            top_logprobs.append(None if step is None else {
                self._token_str(t, lp, request.return_tokens_as_token_ids): max(lp.logprob, MIN_LOGPROB)
                for t, lp in itertools.islice(step.items(), num_top)})
            offsets.append(text_offset)
            text_offset += len(token)
        return CompletionLogProbs(text_offset=offsets, token_logprobs=token_logprobs, tokens=tokens,
                                  top_logprobs=top_logprobs)
