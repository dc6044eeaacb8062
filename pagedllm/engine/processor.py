"""Processor (frontend side): validates and tokenizes a prompt into an EngineCoreRequest."""
from __future__ import annotations

import functools
import os
import time
import uuid
from typing import Any, Optional

import msgspec

from pagedllm.config import LoRAConfig, ModelConfig, ReasoningConfig, check_optional_dict
from pagedllm.engine.protocol import EngineCoreRequest
from pagedllm.inputs import PromptType
from pagedllm.lora.request import LoRARequest
from pagedllm.models.generation_config import generation_eos_token_ids
from pagedllm.reasoning import DeepSeekR1ReasoningParser, get_reasoning_parser
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.backend_xgrammar import validate_structured_outputs


# The most token sequences a request's bad_words may become (vLLM's VLLM_MAX_NUM_BAD_WORDS): the sampler matches every
# one against the output each step, in Python, so an unbounded list would slow the whole batch.
MAX_NUM_BAD_WORDS = int(os.environ.get("PAGEDLLM_MAX_NUM_BAD_WORDS", "128"))

# vLLM's limits on a prefix-cache salt (its validate_cache_salt): the salt keys the hash of every KV block of the
# request, so requests share cached blocks only with requests of the same salt (tenants cannot probe each other's
# prompts by timing); it stays a short opaque string.
CACHE_SALT_MAX_LENGTH = 128
_CACHE_SALT_FORBIDDEN_CHARS = frozenset("@/\\\x00")


def validate_cache_salt(cache_salt: object) -> Optional[str]:
    """The salt itself, or a ValueError naming cache_salt where vLLM refuses it."""
    if cache_salt is None:
        return None
    if not isinstance(cache_salt, str) or not cache_salt:
        raise ValueError("cache_salt must be a non-empty string if provided.")
    if len(cache_salt) > CACHE_SALT_MAX_LENGTH or not _CACHE_SALT_FORBIDDEN_CHARS.isdisjoint(cache_salt):
        raise ValueError(f"cache_salt must be at most {CACHE_SALT_MAX_LENGTH} characters and must not contain "
                         "'@', '/', '\\\\', or NUL.")
    return cache_salt


def cache_salt_of(prompt: PromptType) -> Optional[str]:
    """A prompt's cache_salt (a dict's "cache_salt", checked), None where it has none."""
    return validate_cache_salt(prompt.get("cache_salt") if isinstance(prompt, dict) else None)


def assign_request_id(request: EngineCoreRequest) -> EngineCoreRequest:
    """vLLM's InputProcessor.assign_request_id: the request under a unique id, the caller's id with 8 random
    characters, its own kept as external_req_id. So a caller may add requests under an id already running (vLLM's
    server passes the client's X-Request-Id on): each runs as its own, its outputs carry the caller's id, and
    aborting that id aborts them all."""
    return msgspec.structs.replace(request, request_id=f"{request.request_id}-{uuid.uuid4().hex[:8]}",
                                   external_req_id=request.request_id)


class Processor:
    def __init__(self, model_config: ModelConfig, tokenizer: Any, lora_config: Optional[LoRAConfig] = None,
                 reasoning_config: Optional[ReasoningConfig] = None) -> None:
        self.model_config = model_config
        self.reasoning_config = reasoning_config
        self.tokenizer = tokenizer
        self.eos_token_id = self._eos_token_id()
        # The model's other end-of-generation ids, stop tokens of every request that does not ignore EOS (vLLM's).
        self.extra_eos_token_ids = [t for t in generation_eos_token_ids(
            model_config.path, model_config.generation_config, model_config.hf_config) if t != self.eos_token_id]
        self.lora_config = lora_config
        # The name and the paths (the latest last) of the adapters already found to fit, by id: values, as a
        # LoRARequest may change after. An id reloaded in place has several: its weights are the latest's, and a
        # request naming an earlier one (made before the reload) runs with them, as vLLM's engine keys weights by id.
        self._checked_loras: dict[int, tuple[str, list[str]]] = {}

    def get_tokenizer(self) -> Any:
        """vLLM's (InputProcessor.get_tokenizer): the tokenizer; with skip_tokenizer_init, which loads none, vLLM's
        ValueError rather than None, which would fail later where it is used, naming nothing."""
        if self.tokenizer is None:
            raise ValueError("Tokenizer not available when `skip_tokenizer_init=True`")
        return self.tokenizer

    def validate_lora_request(self, lora_request: Optional[LoRARequest]) -> None:
        """An adapter is checked against the base model (its files, settings and shapes) the first time its id
        comes, here in the frontend, so that the engine only ever loads adapters that fit: a bad one is this
        request's ValueError while the engine keeps serving. An id must keep naming the same adapter (a path it was
        loaded from), unless the request reloads it (load_inplace): its files are checked again, as the engine will
        read them again."""
        if lora_request is None:
            return
        lora_request.validate()  # its fields may have been set since it was made
        if self.lora_config is None:
            raise ValueError(f"lora_request: LoRA is not enabled in this engine (adapter "
                             f"{lora_request.lora_name!r}); start it with enable_lora=True")
        name, path = lora_request.lora_name, lora_request.lora_path
        known_name, known_paths = self._checked_loras.get(lora_request.lora_int_id, (None, []))
        if known_name is not None and not lora_request.load_inplace:
            if name != known_name or path not in known_paths:
                raise ValueError(f"lora_request: lora_int_id {lora_request.lora_int_id} already names adapter "
                                 f"{known_name!r} at {known_paths[-1]!r}")
            return
        from pagedllm.lora.lora_model import check_local_checkpoint
        check_local_checkpoint(path, self.model_config.hf_config, self.lora_config.max_lora_rank)
        earlier = [p for p in known_paths if p != path] if known_name == name else []
        self._checked_loras[lora_request.lora_int_id] = (name, [*earlier, path])

    def validate_lora_to_add(self, lora_request: LoRARequest) -> None:
        """add_lora's adapter: a LoRARequest (not None, as a request's may be), then checked as a request's; anything
        else is refused here, where the engine would fail the call with a RuntimeError naming no argument."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {lora_request!r}")
        self.validate_lora_request(lora_request)

    def forget_lora(self, lora_int_id: int) -> None:
        self._checked_loras.pop(lora_int_id, None)

    def check_lora_enabled(self) -> None:
        """The LoRA management calls (add_lora, remove_lora, list_loras, pin_lora) need an engine serving adapters, as
        vLLM's."""
        if self.lora_config is None:
            raise ValueError("LoRA is not enabled in this engine; start it with enable_lora=True")

    def validate_lora_id(self, lora_id: int) -> None:
        """remove_lora's and pin_lora's id: an adapter id, in an engine serving adapters."""
        self.check_lora_enabled()
        if not isinstance(lora_id, int) or isinstance(lora_id, bool) or not 1 <= lora_id < 2**63:
            raise ValueError(f"lora_id must be an integer from 1 to 2**63 - 1, got {lora_id!r}")

    def _eos_token_id(self) -> Optional[int]:
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            return self.tokenizer.eos_token_id
        eos = getattr(self.model_config.hf_config, "eos_token_id", None)
        return eos[0] if isinstance(eos, (list, tuple)) else eos

    def tokenize(self, prompt: PromptType, tokenization_kwargs: Optional[dict[str, Any]] = None
                 ) -> tuple[Optional[str], list[int]]:
        """``tokenization_kwargs`` (vLLM's): the tokenizer's keyword arguments for a text prompt, such as
        add_special_tokens, or truncation with max_length."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer; pass prompt_token_ids instead.")
            return prompt, self.tokenizer.encode(prompt, **{"add_special_tokens": True, **(tokenization_kwargs or {})})
        if isinstance(prompt, list):  # vLLM's token prompt: the ids alone
            prompt = {"prompt_token_ids": prompt}
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            token_ids = prompt["prompt_token_ids"]
            if not isinstance(token_ids, (list, tuple)) or not all(isinstance(t, int) for t in token_ids):
                raise ValueError("prompt_token_ids must be a list of integers.")
            return prompt.get("prompt"), [int(t) for t in token_ids]  # a bool is its int (the engine decodes ints)
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self.tokenize(prompt["prompt"], tokenization_kwargs)
        raise ValueError(f"prompt must be a string, a list of token ids, or a dict with 'prompt_token_ids' or "
                         f"'prompt', got {prompt!r}")

    def validate_prompt(self, token_ids: list[int]) -> None:
        max_model_len = self.model_config.max_model_len
        if not token_ids:
            raise ValueError("prompt: the prompt is empty.")
        if len(token_ids) >= max_model_len:
            raise ValueError(f"This model's maximum context length is {max_model_len} tokens. However, your "
                             f"prompt has {len(token_ids)} tokens, which leaves no room for output. Please "
                             "reduce the length of the prompt.")
        bad = self._out_of_vocab(token_ids)
        if bad:
            raise ValueError(f"prompt_token_ids: token id {bad[0]} is out of vocabulary "
                             f"(size {self.model_config.vocab_size}).")

    @property
    def max_logprobs(self) -> int:
        """vLLM's max_logprobs as a count: -1 is the vocabulary's size."""
        max_logprobs = self.model_config.max_logprobs
        return self.model_config.vocab_size if max_logprobs == -1 else max_logprobs

    def validate_logprobs(self, params: SamplingParams) -> SamplingParams:
        """vLLM's max_logprobs: no request asks for more alternatives per token (-1: up to the vocabulary). A
        request's -1 is the whole vocabulary (vLLM's), which the params then say as a count."""
        vocab_size = self.model_config.vocab_size
        max_logprobs = self.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value == -1:
                value = vocab_size
                params = msgspec.structs.replace(params, **{name: value})
            if value is not None and value > max_logprobs:
                raise ValueError(f"{name} must be at most {max_logprobs} (the engine's max_logprobs), got {value}.")
        return params

    def process_sampling_controls(self, params: SamplingParams) -> SamplingParams:
        """Checks logit_bias, allowed_token_ids, stop_token_ids and logprob_token_ids against the vocabulary
        (SamplingParams does not know it; each indexes the logits) and tokenizes bad_words for the engine."""
        for name, token_ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids),
                                ("stop_token_ids", params.stop_token_ids),
                                ("logprob_token_ids", params.logprob_token_ids)):
            self._check_in_vocab(name, token_ids or ())
        if not params.bad_words:
            return params
        if self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer to be turned into token ids.")
        bad_words_token_ids = []
        for word in (w.lstrip() for w in params.bad_words):
            # As vLLM: ban the word at the start of the text and after a space, which tokenize differently (both,
            # whatever their lengths: vLLM keeps the spaced form only when it has as many tokens).
            for text in (word, " " + word):
                token_ids = self.tokenizer.encode(text, add_special_tokens=False)
                if not token_ids and text == word:
                    # As vLLM's update_from_tokenizer: a word of no tokens would ban nothing, silently (its spaced
                    # form of none is only skipped: the word itself is still banned).
                    raise ValueError("bad_words entries must tokenize to at least one token.")
                if token_ids and token_ids not in bad_words_token_ids:
                    bad_words_token_ids.append(token_ids)
                    if len(bad_words_token_ids) > MAX_NUM_BAD_WORDS:  # checked as they come, as vLLM does
                        raise ValueError(f"bad_words makes more than {MAX_NUM_BAD_WORDS} token sequences (each word "
                                         "with and without a leading space); set PAGEDLLM_MAX_NUM_BAD_WORDS to raise "
                                         "the limit.")
        self._check_in_vocab("bad_words", [t for token_ids in bad_words_token_ids for t in token_ids])
        return msgspec.structs.replace(params, _bad_words_token_ids=bad_words_token_ids)

    def _out_of_vocab(self, token_ids) -> list[int]:
        vocab_size = self.model_config.vocab_size
        return [t for t in token_ids if not 0 <= t < vocab_size]

    def _check_in_vocab(self, name: str, token_ids) -> None:
        bad = self._out_of_vocab(token_ids)
        if bad:
            vocab_size = self.model_config.vocab_size
            raise ValueError(f"{name} contains out-of-vocabulary token ids {bad} (vocabulary size {vocab_size}).")

    def validate_thinking_token_budget(self, params: SamplingParams) -> SamplingParams:
        """vLLM's VLLMValidationError for a budget without a reasoning parser. A budget past max_model_len (more than
        any request can think) becomes max_model_len, the same budget: vLLM takes any integer, such as 10**30, and
        the engine process decodes a 64-bit one."""
        budget = params.thinking_token_budget
        if budget is None:
            return params
        if self.reasoning_config is None:
            raise ValueError("thinking_token_budget is set but reasoning_config is not configured. Please set "
                             "--reasoning-parser and/or --reasoning-config to use thinking_token_budget.")
        return msgspec.structs.replace(params, thinking_token_budget=min(budget, self.model_config.max_model_len))

    @functools.cached_property
    def reasoning_parser(self) -> DeepSeekR1ReasoningParser:
        """The engine's reasoning parser, built once (as vLLM's StructuredOutputManager builds its reasoner), on the
        first structured-output request: building one reads the tokenizer's whole vocabulary."""
        return get_reasoning_parser(self.reasoning_config.reasoning_parser)(self.tokenizer)

    def hold_grammar_while_reasoning(self, params: SamplingParams, token_ids: list[int]) -> SamplingParams:
        """As vLLM's engine with a reasoning parser, whatever the entry point (LLM.generate, /v1/completions): a
        grammar waits for the token that ends the reasoning, unless the prompt ended it (the parser's
        is_reasoning_end) or that end is not one token. Where the chat server has decided, its decision stands."""
        constraint = params.structured_outputs
        reasoning = self.reasoning_config
        if reasoning is None or not reasoning.reasoning_parser or constraint._reasoning_end_token_ids is not None:
            return params
        parser = self.reasoning_parser
        end_token_ids = parser.reasoning_end_token_ids()
        if end_token_ids is None or parser.is_reasoning_end(token_ids):
            return params
        return msgspec.structs.replace(params, structured_outputs=msgspec.structs.replace(
            constraint, _reasoning_end_token_ids=end_token_ids))

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams,
                arrival_time: Optional[float] = None, priority: int = 0,
                lora_request: Optional[LoRARequest] = None, tokenization_kwargs: Optional[dict[str, Any]] = None
                ) -> tuple[Optional[str], EngineCoreRequest]:
        """The engine process decodes the request strictly typed, and one it cannot decode ends it: what it would
        refuse is refused here, with the field named (a request_id that is no str is vLLM's TypeError)."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id)}")
        if arrival_time is not None and (isinstance(arrival_time, bool) or not isinstance(arrival_time, (int, float))):
            raise ValueError(f"arrival_time must be a number (seconds since the epoch), got {arrival_time!r}.")
        if not isinstance(priority, int) or not -(2**63) <= priority < 2**63:
            raise ValueError(f"priority must be a 64-bit integer, got {priority!r}.")
        priority = int(priority)  # a bool is its int: the engine process decodes an int, and no bool, there
        check_optional_dict("tokenization_kwargs", tokenization_kwargs)
        text, token_ids = self.tokenize(prompt, tokenization_kwargs)
        self.validate_prompt(token_ids)
        cache_salt = cache_salt_of(prompt)
        self.validate_lora_request(lora_request)
        params = self.validate_logprobs(params)
        params = self.validate_thinking_token_budget(params)
        if params.structured_outputs is not None:
            if self.tokenizer is None:  # its grammar is compiled against the vocabulary's text (vLLM's message)
                raise ValueError("Structured outputs requires a tokenizer so it can't be used with "
                                 "'skip_tokenizer_init'")
            validate_structured_outputs(params.structured_outputs)
            params = self.hold_grammar_while_reasoning(params, token_ids)
        params = self.process_sampling_controls(params)
        extra_eos = [t for t in self.extra_eos_token_ids if t not in params.stop_token_ids]
        if extra_eos:  # they stop the request unless ignore_eos; min_tokens holds them back either way
            params = msgspec.structs.replace(params, _extra_eos_token_ids=extra_eos, stop_token_ids=(
                params.stop_token_ids if params.ignore_eos else params.stop_token_ids + extra_eos))
        if params.max_tokens is None:
            # Fill the context: the scheduler stops the request at max_model_len.
            params = msgspec.structs.replace(params, max_tokens=self.model_config.max_model_len - len(token_ids))
        return text, EngineCoreRequest(request_id, token_ids, params, self.eos_token_id,
                                       arrival_time if arrival_time is not None else time.time(), priority,
                                       cache_salt=cache_salt, lora_request=lora_request)

