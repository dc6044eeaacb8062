"""SamplingParams: how one request is decoded, validated up front so bad input fails fast with the field named."""
from __future__ import annotations

import copy
import functools
import logging
import math
import os
from dataclasses import dataclass
from enum import IntEnum
from typing import Optional, Union

import msgspec

from pagedllm.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_SAMPLING_EPS = 1e-5
# A temperature above 0 but below this is raised to it (vLLM's _MAX_TEMP): dividing logits by less overflows.
_MIN_TEMPERATURE = 1e-2
# vLLM's default max_logprobs: the most logprobs a request may ask for, unless the engine says otherwise.
MAX_LOGPROBS = 20
# The most token ids logprob_token_ids may name (vLLM's MAX_LOGPROB_TOKEN_IDS); max_logprobs does not bound them.
MAX_LOGPROB_TOKEN_IDS = 128
# The most sequences (n) one request may ask for (vLLM's VLLM_MAX_N_SEQUENCES): each is a request of its own.
MAX_N_SEQUENCES = int(os.environ.get("PAGEDLLM_MAX_N_SEQUENCES", "16384"))
# Integers cross to the engine process as MessagePack, which holds 64 bits.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


_INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "stream_interval")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
                "detokenize")


class RequestOutputKind(IntEnum):
    """What a request's outputs carry while it runs (vLLM's): SamplingParams.output_kind chooses it per request."""
    CUMULATIVE = 0  # everything so far, every step
    DELTA = 1  # only what is new, every step
    FINAL_ONLY = 2  # one output when the request finishes


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Sampling parameters, as in vLLM. A msgspec Struct so it crosses process boundaries cheaply.

    temperature 0 means greedy (one below 0.01 is raised to 0.01, as vLLM does). seed -1 means none. top_k 0 or -1
    means no top-k. logprobs/prompt_logprobs ask for that many
    top alternatives (the sampled/prompt token's own logprob is always included). presence/frequency penalties
    count output tokens; repetition_penalty also counts prompt tokens. logit_bias values are clamped to
    [-100, 100] as OpenAI does; its keys, allowed_token_ids and bad_words are checked against the vocabulary
    by the Processor, which also tokenizes bad_words.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    # vLLM's: the logprobs of exactly these token ids at each generated position (besides the sampled token's), in
    # place of the top-k alternatives; logprobs, if set, must be their number.
    logprob_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    # Set by the Processor: each bad word as token ids, with and without a leading space.
    _bad_words_token_ids: Optional[list[list[int]]] = None
    # Set by the Processor: the generation config's end-of-generation ids beyond the tokenizer's EOS, which
    # min_tokens holds back whether or not they stop the request (ignore_eos), as vLLM's all_stop_token_ids.
    _extra_eos_token_ids: Optional[list[int]] = None
    # The output must match this JSON schema / regex / choice / grammar (see StructuredOutputsParams).
    structured_outputs: Optional[StructuredOutputsParams] = None
    # vLLM's default: every output holds everything so far (LLM.generate asks for FINAL_ONLY, a stream for DELTA).
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM's: the most tokens a reasoning model may think for (-1: no limit, read as None), after which the sampler
    # forces the end of its reasoning (sample/thinking_budget.py); refused by an engine without a reasoning_parser.
    thinking_token_budget: Optional[int] = None
    # vLLM's: a running DELTA request's outputs come every this many tokens (its first token and its end at once); the
    # engine's stream_interval is the least. Fewer outputs, less frontend work per token.
    stream_interval: Optional[int] = None

    def __post_init__(self) -> None:
        self._normalize_numbers()
        if 0 < self.temperature < _MIN_TEMPERATURE:
            self.temperature = _MIN_TEMPERATURE
        if self.seed == -1:  # vLLM's spelling of no seed
            self.seed = None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k == -1:
            self.top_k = 0
        if type(self.thinking_token_budget) is int and self.thinking_token_budget == -1:
            self.thinking_token_budget = None
        if self.logit_bias is not None:
            self.logit_bias = _int_keys_clamped(self.logit_bias)
        self._verify()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the other knobs cannot change the argmax, so normalise them away.
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _normalize_numbers(self) -> None:
        """The numeric and bool fields hold what the engine process decodes them as (msgspec, strictly typed: a float
        where an int belongs, or a bool, fails there, where no error reaches the caller): a bool is its int (vLLM's
        logprobs=True is 1), an int field holds an int and a float field a real number, an int in a bool field is
        its truth (ignore_eos=1, as Python reads it in vLLM), output_kind a RequestOutputKind (its int too), else a
        ValueError names the field here."""
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool):
                setattr(self, name, int(value))
            elif value is not None and not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}.")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}.")
            setattr(self, name, float(value))
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int):
                raise ValueError(f"{name} must be a boolean, got {value!r}.")
            setattr(self, name, bool(value))
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}.") from None
        for name in ("stop_token_ids", "allowed_token_ids", "logprob_token_ids"):
            token_ids = getattr(self, name)
            if isinstance(token_ids, (list, tuple)):
                setattr(self, name, [int(t) if isinstance(t, bool) else t for t in token_ids])

    def _verify(self) -> None:
        def bad(field: str, why: str):
            raise ValueError(f"{field} {why}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be at least 1, got {self.n}.")
        if self.stream_interval is not None and self.stream_interval < 1:
            bad("stream_interval", f"must be at least 1, got {self.stream_interval}.")
        if self.n > MAX_N_SEQUENCES:
            bad("n", f"must be at most {MAX_N_SEQUENCES}, got {self.n}. To increase this limit, set the "
                     "PAGEDLLM_MAX_N_SEQUENCES environment variable.")
        # Checked first: the checks below and the detokenizer read their items (vLLM's TypeError names no field).
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            bad("stop", f"must be a string or a list of strings, got {self.stop!r}.")
        if not isinstance(self.stop_token_ids, list):
            bad("stop_token_ids", f"must be a list of token ids, got {self.stop_token_ids!r}.")
        for name in ("top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if isinstance(value, int) and not _INT64_MIN <= value <= _INT64_MAX:
                bad(name, f"must be a 64-bit integer, got {value}.")
        for name in ("stop_token_ids", "allowed_token_ids"):
            if any(isinstance(t, int) and not _INT64_MIN <= t <= _INT64_MAX for t in getattr(self, name) or ()):
                bad(name, "must hold 64-bit integers.")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value):
                bad(name, f"must be a finite number, got {value}.")
        if self.temperature < 0.0:
            bad("temperature", f"must be non-negative, got {self.temperature}.")
        if self.temperature > 2.0:
            bad("temperature", f"must be in [0, 2], got {self.temperature}.")
        if self.temperature < _SAMPLING_EPS and self.n > 1:
            bad("n", f"must be 1 when using greedy sampling, got {self.n}.")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            bad("top_k", f"must be 0 or -1 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.")
        for name in ("logprobs", "prompt_logprobs"):  # the engine's max_logprobs bounds them (Processor)
            value = getattr(self, name)
            if value is not None and value < -1:
                bad(name, f"must be non-negative, or -1 for the whole vocabulary, got {value}.")
        self._verify_logprob_token_ids()
        budget = self.thinking_token_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            bad("thinking_token_budget", f"must be a non-negative integer or -1 for unlimited, got {budget!r}.")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", f"must be an integer, got {self.seed!r}.")
        if any(not s for s in self.stop):
            bad("stop", "cannot contain an empty string.")
        if self.stop and not self.detokenize:
            bad("stop", "strings are only supported when detokenize is True; set detokenize=True to use them.")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", f"must be non-negative integers, got {self.stop_token_ids}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                bad(name, f"must be in [-2, 2], got {value}.")
        if not self.repetition_penalty > 0.0:
            bad("repetition_penalty", f"must be greater than zero, got {self.repetition_penalty}.")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or any(not isinstance(t, int) for t in self.allowed_token_ids)):
            bad("allowed_token_ids", f"must be a non-empty list of token ids, got {self.allowed_token_ids}.")
        if self.bad_words is not None and any(not isinstance(w, str) for w in self.bad_words):
            bad("bad_words", f"must be a list of strings, got {self.bad_words!r}.")
        # vLLM's check and words: only an empty word is refused here. A whitespace-only one is the Processor's, as
        # vLLM's update_from_tokenizer: stripped of its leading spaces it tokenizes to nothing.
        if self.bad_words and any(not w for w in self.bad_words):
            bad("bad_words", f"cannot contain an empty string. Got bad_words={self.bad_words}")

    def _verify_logprob_token_ids(self) -> None:
        """As vLLM's _validate_logprobs (the Processor checks the ids against the vocabulary)."""
        token_ids = self.logprob_token_ids
        if token_ids is None:
            return
        if not isinstance(token_ids, list) or not all(isinstance(t, int) for t in token_ids):
            raise ValueError(f"logprob_token_ids must be a list of token ids, got {token_ids!r}.")
        if len(token_ids) > MAX_LOGPROB_TOKEN_IDS:
            raise ValueError(f"logprob_token_ids must hold at most {MAX_LOGPROB_TOKEN_IDS} token ids, got "
                             f"{len(token_ids)}.")
        if self.logprobs is not None and self.logprobs != len(token_ids):
            raise ValueError(f"logprob_token_ids must be as many as logprobs when both are set, got "
                             f"logprobs={self.logprobs} and {len(token_ids)} logprob_token_ids.")

    @property
    def num_logprobs(self) -> Optional[int]:
        """How many logprobs per generated token besides the sampled token's (None: no logprobs), as vLLM's: the
        count of logprob_token_ids when they stand in for logprobs."""
        if self.logprobs is not None:
            return self.logprobs
        return len(self.logprob_token_ids) if self.logprob_token_ids else None

    def clone(self) -> "SamplingParams":
        """A deep copy, as vLLM's: changing it (or the lists and dicts it holds) leaves this one as it is."""
        return copy.deepcopy(self)

    @property
    def bad_words_token_ids(self) -> Optional[list[list[int]]]:
        return self._bad_words_token_ids

    @property
    def extra_eos_token_ids(self) -> list[int]:
        return self._extra_eos_token_ids or []

    def all_stop_token_ids(self, eos_token_id: Optional[int]) -> set[int]:
        """Every token that may end a generation, ignore_eos or not (vLLM's all_stop_token_ids): the request's EOS,
        the generation config's others and stop_token_ids. min_tokens holds them back; a finished grammar ends on
        one."""
        return set(self.stop_token_ids) | set(self.extra_eos_token_ids) | ({eos_token_id} - {None})

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature == 0.0:
            return SamplingType.GREEDY
        return SamplingType.RANDOM_SEED if self.seed is not None else SamplingType.RANDOM


def _int_keys_clamped(logit_bias: dict) -> dict[int, float]:
    """Token ids as ints (JSON sends them as strings) and biases clamped to [-100, 100] as vLLM's from_optional
    clamps them: an infinite bias is the bound it is past, and NaN, for which no comparison holds, -100."""
    try:
        return {int(token_id): min(100.0, max(-100.0, float(bias))) for token_id, bias in logit_bias.items()}
    except (TypeError, ValueError):
        raise ValueError(f"logit_bias keys must be token ids (integers), got {list(logit_bias)!r}.") from None


@functools.cache
def _warn_no_watermarking() -> None:
    """vLLM's warning, given once, for watermarking asked of an engine without a watermark config (pagedllm's)."""
    logger.warning("Watermarking is enabled for this request, but the engine has no watermark configuration. This "
                   "and subsequent requests will run without watermarking.")


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams.

    temperature is passed to the per-step requests as vLLM does; the candidates are ranked by raw logprobs,
    so it does not change the beams.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    # vLLM's (its offline search constrains each beam with it): refused unless None, as pagedllm's engine constrains
    # a request's output from its start, and a beam's step request continues output already generated.
    structured_outputs: Optional[StructuredOutputsParams] = None
    skip_special_tokens: bool = True
    # vLLM's: None or True watermark the output on an engine with a watermark config, False opts out. pagedllm's
    # engine has none, so, as vLLM's without one, True is only warned of and the beams are not watermarked.
    watermarking: Optional[bool] = None

    def __post_init__(self) -> None:
        """As vLLM's: beam_width is a number of sequences (the engine's max_logprobs bounds it too: verify_width)."""
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_N_SEQUENCES:
            raise ValueError(f"beam_width must be between 1 and {MAX_N_SEQUENCES}, got {self.beam_width}.")
        if self.structured_outputs is not None:
            raise ValueError("structured_outputs is not supported with beam search: each beam's step request would "
                             "have to resume the constraint partway through its output.")
        if self.watermarking is True:
            _warn_no_watermarking()
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")

    def verify_width(self, max_logprobs: int) -> None:
        """Each step asks the engine for 2 * beam_width logprobs, which its max_logprobs (a count: -1 resolved to
        the vocabulary's size) bounds. vLLM's engine refuses the first step's request; this refuses the search
        before it starts, naming beam_width."""
        if 2 * self.beam_width > max_logprobs:
            raise ValueError(f"beam_width must be at most {max_logprobs // 2} (each step asks for twice as many "
                             f"logprobs, and the engine's max_logprobs is {max_logprobs}), got {self.beam_width}.")

    def step_sampling_params(self) -> SamplingParams:
        """What each beam is submitted with: one token, and enough candidates to fill the beams, in one final output."""
        return SamplingParams(max_tokens=1, logprobs=2 * self.beam_width, temperature=self.temperature,
                              output_kind=RequestOutputKind.FINAL_ONLY)
