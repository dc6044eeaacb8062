"""OpenAIServingChat: /v1/chat/completions. The chat template is applied here, in the API server process, and
the engine gets token ids."""
from __future__ import annotations

import time
from typing import Any, AsyncIterator, Optional, Union

import msgspec

from pagedllm.entrypoints.logger import RequestLogger
from pagedllm.entrypoints.openai.chat_utils import conversation, effective_chat_template_kwargs, render_chat_request
from pagedllm.entrypoints.openai.errors import BadRequestError
from pagedllm.entrypoints.openai.protocol import (ChatCompletionLogProb, ChatCompletionLogProbs,
                                                  ChatCompletionLogProbsContent, ChatCompletionRequest,
                                                  ChatCompletionResponse, ChatCompletionResponseChoice,
                                                  ChatCompletionResponseStreamChoice, ChatCompletionStreamResponse,
                                                  ChatMessage, DeltaMessage, UsageInfo)
from pagedllm.entrypoints.openai.serving_engine import (MIN_LOGPROB, OpenAIServing, check_output, named_field,
                                                        sse, sse_error)
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.tool_calls import (ToolCallParser, ToolChoice, detect_tool_call_parser,
                                                    resolve_tool_choice)
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.reasoning import DeepSeekR1ReasoningParser, ReasoningStream, get_reasoning_parser
from pagedllm.sampling_params import BeamSearchParams, SamplingParams


class OpenAIServingChat(OpenAIServing):
    endpoint = "chat"

    def __init__(self, engine_client: Any, models: OpenAIServingModels, chat_template: Optional[str],
                 tool_call_parser: Optional[str] = None, *, response_role: str = "assistant",
                 request_logger: Optional[RequestLogger] = None, enable_prompt_tokens_details: bool = False,
                 reasoning_parser: Optional[str] = None,
                 default_chat_template_kwargs: Optional[dict[str, Any]] = None,
                 chat_template_content_format: str = "auto", exclude_tools_when_tool_choice_none: bool = False) -> None:
        """response_role: the role of the messages answered (vLLM's --response-role); reasoning_parser: vLLM's
        --reasoning-parser, which splits each answer's reasoning off its content; default_chat_template_kwargs:
        vLLM's --default-chat-template-kwargs, under each request's chat_template_kwargs (for the template and the
        reasoning parser); chat_template_content_format: vLLM's --chat-template-content-format;
        exclude_tools_when_tool_choice_none: vLLM's --exclude-tools-when-tool-choice-none, a request with tool_choice
        "none" rendered without its tools."""
        super().__init__(engine_client, models, request_logger=request_logger,
                         enable_prompt_tokens_details=enable_prompt_tokens_details)
        self.response_role = response_role
        self.chat_template = chat_template
        self.default_chat_template_kwargs = default_chat_template_kwargs
        self.chat_template_content_format = chat_template_content_format
        self.exclude_tools_when_tool_choice_none = exclude_tools_when_tool_choice_none
        template = chat_template or getattr(self.tokenizer, "chat_template", None)
        self.tool_call_parser = tool_call_parser or detect_tool_call_parser(
            template if isinstance(template, str) else None)
        self.reasoning_parser = get_reasoning_parser(reasoning_parser) if reasoning_parser else None

    def _reasoning(self, request: ChatCompletionRequest, prompt_token_ids: list[int], params: Any
                   ) -> tuple[Optional[DeepSeekR1ReasoningParser], Any]:
        """The request's reasoning parser (none without --reasoning-parser), and its sampling params. A grammar
        (structured output, a required or named tool_choice) is held back until the reasoning ends, as vLLM holds it
        back, by the engine's Processor: the model thinks freely, then answers as the grammar says. Where the end of
        the reasoning is not one token, the grammar applies from the first token, leaving no reasoning, and no
        parser is applied. Where the chat has no reasoning (the prompt ended it, or qwen3's enable_thinking false),
        the grammar applies from the first token, as vLLM's."""
        if self.reasoning_parser is None:
            return None, params
        parser = self.reasoning_parser(self.tokenizer, effective_chat_template_kwargs(
            self.default_chat_template_kwargs, request.template_kwargs()), prompt_token_ids)
        constraint = getattr(params, "structured_outputs", None)
        if constraint is None:
            return parser, params
        end_token_ids = parser.reasoning_end_token_ids()
        if end_token_ids is None:
            return None, params
        # The chat's decision, which the Processor keeps (no second parser, no second scan of the prompt): the grammar
        # waits for the end of the reasoning, or (no reasoning in this chat) applies from the first token.
        return parser, msgspec.structs.replace(params, structured_outputs=msgspec.structs.replace(
            constraint, _reasoning_end_token_ids=end_token_ids if parser.thinking else []))

    def get_chat_request_role(self, request: ChatCompletionRequest) -> str:
        """As vLLM: the answer's role is --response-role, unless it continues the last message (no generation
        prompt), whose role it keeps."""
        return self.response_role if request.add_generation_prompt else request.messages[-1].role

    def echoed_text(self, request: ChatCompletionRequest) -> str:
        """vLLM's echo: the text of the last message, which every choice's answer starts with, when the answer
        continues it (their roles are the same); empty otherwise."""
        last = request.messages[-1]
        if not request.echo or last.role != self.get_chat_request_role(request):
            return ""
        return conversation([last])[0]["content"]

    async def create_chat_completion(self, request: ChatCompletionRequest
                                     ) -> Union[ChatCompletionResponse, AsyncIterator[str]]:
        """A response, or for stream=True the SSE events; raises OpenAIError before anything is generated."""
        return (await self.start_chat_completion(request))[1]

    async def start_chat_completion(self, request: ChatCompletionRequest, cached_tokens_always: bool = False
                                    ) -> tuple[Union[SamplingParams, BeamSearchParams],
                                               Union[ChatCompletionResponse, AsyncIterator[str]]]:
        """The sampling parameters the answer is generated with (the request's, else the generation config's, else
        the engine's defaults: what the Responses API echoes, as vLLM's from_request its sampling_params'), and
        what create_chat_completion returns. cached_tokens_always: the usage reports the prompt's cached tokens
        whatever --enable-prompt-tokens-details says (the Responses API's usage, built from this one, always has
        them)."""
        model_name = self.models.check_model(request.model)
        try:
            tool_choice = resolve_tool_choice(request.tools, request.tool_choice, request.parallel_tool_calls,
                                              self.tool_call_parser)
            tool_constraint = tool_choice.structured_outputs() if tool_choice else None
        except ValueError as e:
            raise BadRequestError(str(e), "tools" if str(e).startswith("tools") else "tool_choice") from e
        if tool_choice is not None and tool_choice.mode == "auto":
            # As vLLM's Hermes2ProToolParser.adjust_request: the text keeps special tokens, as some tokenizers mark
            # the tags a parser reads (<tool_call>); skipped, they would hide every call from it.
            request.skip_special_tokens = False
        try:
            prompt_text = render_chat_request(
                self.tokenizer, request, self.chat_template, self.default_chat_template_kwargs,
                self.chat_template_content_format,
                with_tools=not (self.exclude_tools_when_tool_choice_none and request.tool_choice == "none"))
        except ValueError as e:
            raise BadRequestError(str(e), named_field(e)) from e
        prompt_token_ids = self.tokenizer.encode(prompt_text, add_special_tokens=request.add_special_tokens)
        prompt_token_ids = self._truncated(request, prompt_token_ids)
        max_tokens = self._max_tokens(len(prompt_token_ids), request.requested_max_tokens, "messages",
                                      request.max_tokens_param)
        params = self._sampling_params(request, max_tokens, tool_call_constraint=tool_constraint)
        reasoning_parser, params = self._reasoning(request, prompt_token_ids, params)
        request_id = self._request_id("chatcmpl", request)
        prompt = {"prompt_token_ids": prompt_token_ids, "cache_salt": request.cache_salt}
        results = await self._start(self._generate(prompt, params, request_id, request.priority, request.model),
                                    request, "messages")
        if request.stream:
            return params, self.chat_completion_stream_generator(request, results, request_id, model_name,
                                                                 prompt_token_ids, tool_choice, cached_tokens_always,
                                                                 reasoning_parser, prompt_text)
        return params, await self.chat_completion_full_generator(request, results, request_id, model_name,
                                                                 tool_choice, cached_tokens_always,
                                                                 reasoning_parser, prompt_text)

    async def chat_completion_stream_generator(self, request: ChatCompletionRequest,
                                               results: AsyncIterator[RequestOutput], request_id: str,
                                               model_name: str, prompt_token_ids: list[int],
                                               tool_choice: Optional[ToolChoice], cached_tokens_always: bool = False,
                                               reasoning_parser: Optional[DeepSeekR1ReasoningParser] = None,
                                               prompt_text: Optional[str] = None) -> AsyncIterator[str]:
        created = int(time.time())
        num_prompt_tokens = len(prompt_token_ids)
        num_generated = [0] * (request.n or 1)  # each choice's completion tokens so far
        num_cached = 0
        # Per choice: its reasoning split off as it comes, and (to count the reasoning's tokens, for the last
        # chunk's usage) its token ids, kept only where that usage is sent.
        reasoning_streams = [reasoning_parser.stream() if reasoning_parser else None for _ in range(request.n or 1)]
        count_reasoning = reasoning_parser is not None and request.include_usage
        generated_ids: list[list[int]] = [[] for _ in range(request.n or 1)]

        shown = self._shows_token_metadata(request, reasoning_parser)
        send_token_ids = request.return_token_ids and shown
        # return_token_ids, return_prompt_text: the prompt's token ids and text, which each choice's first chunk
        # carries, as vLLM's: null there when not asked for (vLLM's sets them either way), absent from the others
        prompt_fields = {"prompt_token_ids": prompt_token_ids if request.return_token_ids else None,
                         "prompt_text": prompt_text if request.return_prompt_text else None}

        def chunk(choice: ChatCompletionResponseStreamChoice, **prompt: Any) -> str:
            # As vLLM's: a chunk carries "usage" (its choice's so far) only with continuous_usage_stats; otherwise
            # it has no "usage" key, include_usage or not (that usage comes in a last chunk).
            usage = {"usage": UsageInfo.of(num_prompt_tokens, num_generated[choice.index])} \
                if request.include_continuous_usage else {}
            response = ChatCompletionStreamResponse(
                id=request_id, object="chat.completion.chunk", created=created, model=model_name, choices=[choice],
                **usage, **prompt)
            return sse(response.model_dump_json(exclude_unset=True))

        # One tool-call parser per choice, when tool calls are to be read out of the text; and per choice whether a
        # call delta has been streamed (vLLM's tools_streamed), which makes its finish "tool_calls".
        parsers = [tool_choice.make_parser() if tool_choice else None for _ in range(request.n or 1)]
        tools_streamed = [False] * (request.n or 1)
        try:
            role = self.get_chat_request_role(request)
            for index in range(request.n or 1):
                yield chunk(ChatCompletionResponseStreamChoice(
                    index=index, delta=DeltaMessage(role=role, content=""), logprobs=None, finish_reason=None),
                    **prompt_fields)
            if echoed := self.echoed_text(request):
                for index in range(request.n or 1):
                    yield chunk(ChatCompletionResponseStreamChoice(
                        index=index, delta=DeltaMessage(content=echoed), logprobs=None, finish_reason=None))
            async for res in results:
                check_output(res)
                num_cached = res.num_cached_tokens
                for output in res.outputs:
                    num_generated[output.index] += len(output.token_ids)
                    if count_reasoning:
                        generated_ids[output.index] += output.token_ids
                    if not output.text and not output.token_ids and output.finish_reason is None:
                        continue
                    delta, finish_reason = self._stream_delta(output, parsers[output.index], tool_choice,
                                                              tools_streamed, reasoning_streams[output.index],
                                                              request.include_reasoning)
                    logprobs = self._logprobs(request, output) if shown else None
                    if not delta.model_fields_set and finish_reason is None and logprobs is None and \
                            not send_token_ids:
                        continue  # text a parser holds until it knows what it is
                    # As vLLM's: each step's chunk sets token_ids (its new ids with return_token_ids, else null), and
                    # the last one alone its stop_reason.
                    yield chunk(ChatCompletionResponseStreamChoice(
                        index=output.index, delta=delta, logprobs=logprobs, finish_reason=finish_reason,
                        token_ids=output.token_ids if send_token_ids else None,
                        **({"stop_reason": output.stop_reason} if finish_reason is not None else {})))
            if request.include_usage:
                yield sse(ChatCompletionStreamResponse(
                    id=request_id, object="chat.completion.chunk", created=created, model=model_name, choices=[],
                    usage=UsageInfo.of(num_prompt_tokens, sum(num_generated),
                                       self._cached_tokens(num_cached, cached_tokens_always),
                                       self._reasoning_tokens(reasoning_parser, generated_ids)),
                ).model_dump_json(exclude_unset=True))
        except Exception as e:
            yield sse_error(e)
        yield sse("[DONE]")

    @staticmethod
    def _stream_delta(output: CompletionOutput, parser: Optional[ToolCallParser], tool_choice: Optional[ToolChoice],
                      tools_streamed: list[bool], reasoning_stream: Optional[ReasoningStream] = None,
                      include_reasoning: bool = True) -> tuple[DeltaMessage, Optional[str]]:
        """This step's delta of one choice: its text, or the reasoning, content and tool calls the parsers read
        out of it (the tool-call parser reading the content only). A delta sets only the fields it has, as vLLM's
        (no null content or tool_calls beside them); one a parser holds back sets none. tools_streamed: per choice,
        whether a call delta has been streamed, set here; as vLLM's, a choice that streamed one finishes as a call,
        though the parser later found the block it came from no call (what was streamed cannot be taken back)."""
        text, reasoning = output.text, {}
        if reasoning_stream is not None:
            thought, text = reasoning_stream.feed(text)
            if output.finish_reason is not None:
                more_thought, more_text = reasoning_stream.finish()
                thought, text = thought + more_thought, text + more_text
            reasoning = {"reasoning": thought} if thought and include_reasoning else {}
        if parser is None:
            content = {"content": text} if text or reasoning_stream is None else {}
            return DeltaMessage(**reasoning, **content), output.finish_reason
        content, tool_calls = parser.feed(text)
        if output.finish_reason is not None:
            rest, more_calls = parser.finish()
            content, tool_calls = content + rest, tool_calls + more_calls
        tools_streamed[output.index] |= bool(tool_calls)  # as vLLM's, before parallel_tool_calls false drops any
        tool_calls = tool_choice.kept_deltas(tool_calls)
        delta = DeltaMessage(**reasoning, **({"content": content} if content else {}),
                             **({"tool_calls": tool_calls} if tool_calls else {}))
        return delta, tool_choice.finish_reason(tools_streamed[output.index], output.finish_reason)

    @staticmethod
    def _shows_token_metadata(request: ChatCompletionRequest,
                              reasoning_parser: Optional[DeepSeekR1ReasoningParser]) -> bool:
        """Whether the choices' logprobs and generated token ids are sent: not where the request hides the reasoning
        a parser splits off (include_reasoning false), which they would show, as vLLM's suppress_metadata."""
        return reasoning_parser is None or request.include_reasoning

    @staticmethod
    def _reasoning_tokens(reasoning_parser: Optional[DeepSeekR1ReasoningParser], token_ids: list[list[int]]
                          ) -> Optional[int]:
        """The choices' reasoning tokens all told, where a reasoning parser read them and can count them."""
        if reasoning_parser is None:
            return None
        counts = [reasoning_parser.count_reasoning_tokens(ids) for ids in token_ids]
        return None if None in counts else sum(counts)

    async def chat_completion_full_generator(self, request: ChatCompletionRequest,
                                             results: AsyncIterator[RequestOutput], request_id: str,
                                             model_name: str, tool_choice: Optional[ToolChoice],
                                             cached_tokens_always: bool = False,
                                             reasoning_parser: Optional[DeepSeekR1ReasoningParser] = None,
                                             prompt_text: Optional[str] = None) -> ChatCompletionResponse:
        final = None
        async for res in results:  # FINAL_ONLY: one output, with all n choices
            check_output(res)
            final = res
        outputs = sorted(final.outputs, key=lambda o: o.index)
        choices = []
        role = self.get_chat_request_role(request)
        echoed = self.echoed_text(request)
        shown = self._shows_token_metadata(request, reasoning_parser)
        for o in outputs:
            reasoning, text = reasoning_parser.extract_reasoning(o.text) if reasoning_parser else (None, o.text)
            message, finish_reason = ChatMessage(role=role, content=text), o.finish_reason
            parser = tool_choice.make_parser() if tool_choice else None
            if parser is not None:
                content, calls = parser.parse(text) if text is not None else (None, [])
                calls = tool_choice.kept_calls(calls)
                message = ChatMessage(role=role, content=tool_choice.message_content(content, calls),
                                      tool_calls=calls)
                finish_reason = tool_choice.finish_reason(bool(calls), o.finish_reason)
            if request.include_reasoning:
                message.reasoning = reasoning
            if echoed:
                message.content = echoed + (message.content or "")
            choices.append(ChatCompletionResponseChoice(
                index=o.index, message=message, logprobs=self._logprobs(request, o) if shown else None,
                finish_reason=finish_reason, stop_reason=o.stop_reason,
                **({"token_ids": o.token_ids} if request.return_token_ids and shown else {})))
        num_prompt_tokens = len(final.prompt_token_ids)
        num_completion_tokens = sum(len(o.token_ids) for o in outputs)
        return ChatCompletionResponse(
            id=request_id, model=model_name, choices=choices,
            usage=UsageInfo.of(num_prompt_tokens, num_completion_tokens,
                               self._cached_tokens(final.num_cached_tokens, cached_tokens_always),
                               self._reasoning_tokens(reasoning_parser, [o.token_ids for o in outputs])),
            prompt_logprobs=self._prompt_logprobs(final.prompt_logprobs),
            **({"prompt_token_ids": final.prompt_token_ids} if request.return_token_ids else {}),
            **({"prompt_text": prompt_text} if request.return_prompt_text else {}))

    def _logprobs(self, request: ChatCompletionRequest, output: CompletionOutput
                  ) -> Optional[ChatCompletionLogProbs]:
        if not request.logprobs or output.logprobs is None:
            return None
        num_top, as_ids = request.top_logprobs or 0, request.return_tokens_as_token_ids
        every = bool(request.logprob_token_ids)
        return ChatCompletionLogProbs(content=[self._logprob_content(token_id, step, num_top, as_ids, every)
                                               for token_id, step in zip(output.token_ids, output.logprobs)])

    def _logprob_content(self, token_id: int, step: dict[int, Logprob], num_top: int, as_ids: Optional[bool] = False,
                         every: bool = False) -> ChatCompletionLogProbsContent:
        """The chosen token, and the num_top most likely ones in rank order (which may include it); num_top -1 (vLLM's
        top_logprobs -1, which --max-logprobs -1 allows) is all of them, as many as the engine gave. ``every`` (a
        request with logprob_token_ids): all the step holds, in its order, the chosen token then the ids asked for
        (vLLM's)."""
        if num_top < 0:
            num_top = len(step)
        chosen = step.get(token_id)
        top = list(step.items()) if every else sorted(
            ((t, lp) for t, lp in step.items() if lp.rank is not None and 1 <= lp.rank <= num_top),
            key=lambda item: item[1].rank)[:num_top]
        return ChatCompletionLogProbsContent(
            **self._logprob(token_id, chosen, as_ids),
            top_logprobs=[ChatCompletionLogProb(**self._logprob(t, lp, as_ids)) for t, lp in top])

    def _logprob(self, token_id: int, logprob: Optional[Logprob], as_id: Optional[bool] = False) -> dict:
        token = self._token_str(token_id, logprob, as_id)
        return {"token": token, "logprob": max(logprob.logprob, MIN_LOGPROB) if logprob else MIN_LOGPROB,
                "bytes": list(token.encode("utf-8", errors="replace"))}
