"""IncrementalDetokenizer: a request's output text, built token by token, with stop-string checks.

Decoding uses tokenizers' DecodeStream (as vLLM's FastIncrementalDetokenizer): it holds back the bytes
of a character split across tokens, so text never carries U+FFFD for a char that is still incomplete.
"""
from __future__ import annotations

import bisect
import os
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from pagedllm.sampling_params import SamplingParams

# DecodeStream raises this when a tokenizer's decoded text is not monotonic in its tokens.
INVALID_PREFIX_ERR_MSG = "Invalid prefix encountered"


class IncrementalDetokenizer:
    """Output text and stop strings of one request.

    `tokenizer` is a transformers tokenizer backed by the `tokenizers` library (the fast kind).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer: Tokenizer = _backend(tokenizer)
        self.skip_special_tokens = params.skip_special_tokens
        self.stop: list[str] = params.stop
        self.min_tokens = params.min_tokens
        self.include_stop_str_in_output = params.include_stop_str_in_output
        # While streaming, hold back enough characters that a partial stop string is never sent.
        if self.stop and not self.include_stop_str_in_output:
            self.stop_buffer_length = max(len(s) for s in self.stop) - 1
        else:
            self.stop_buffer_length = 0
        self._last_output_text_offset = 0

        self.output_token_ids: list[int] = []
        self.output_text = ""
        self.stream, self._prompt_unsent_text = _primed_stream(self.tokenizer, prompt_token_ids,
                                                                self.skip_special_tokens)

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> tuple[str, int] | None:
        """Append the new tokens' text; returns the stop string they completed and how many of the new tokens
        are kept (those up to the one completing it: a step may bring several, with speculative decoding), or
        None.

        On a match output_text is cut before the stop string (after it with include_stop_str_in_output), and
        the tokens after the one completing it are dropped (vLLM's detokenizer). stop_terminated: the last token
        is the EOS/stop token that ended the request; its text is left out unless include_stop_str_in_output.
        Text produced while the request is still under min_tokens cannot stop it.
        """
        if not new_token_ids:
            return None
        skipped_stop_token_id = None
        if stop_terminated and not self.include_stop_str_in_output:
            *new_token_ids, skipped_stop_token_id = new_token_ids
        num_prev_tokens = len(self.output_token_ids)
        # output_text's length after each new token (index 0: before them)
        token_offsets = [len(self.output_text)]
        for token_id in new_token_ids:
            self.output_token_ids.append(token_id)
            self.output_text += self._decode_next(token_id)
            token_offsets.append(len(self.output_text))
        if skipped_stop_token_id is not None:
            self.output_token_ids.append(skipped_stop_token_id)
            token_offsets.append(len(self.output_text))
        if not self.stop or len(self.output_token_ids) <= self.min_tokens:
            return None
        stop_check_offset = token_offsets[max(self.min_tokens - num_prev_tokens, 0)]
        match = check_stop_strings(self.output_text, len(self.output_text) - stop_check_offset, self.stop,
                                   self.include_stop_str_in_output)
        if match is None:
            return None
        stop_str, truncate_to = match
        stop_end = truncate_to if self.include_stop_str_in_output else truncate_to + len(stop_str)
        num_kept = bisect.bisect_left(token_offsets, stop_end, lo=1)
        del self.output_token_ids[num_prev_tokens + num_kept:]
        self.output_text = self.output_text[:truncate_to]
        return stop_str, num_kept

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to send now: all of it, or (delta) only what was not sent before.

        Until the request finishes, the last stop_buffer_length characters are held back.
        """
        buffer_length = 0 if finished else self.stop_buffer_length
        length = max(len(self.output_text) - buffer_length, 0)
        if not delta:
            return self.output_text[:length]
        last_offset = self._last_output_text_offset
        if last_offset >= length:
            return ""
        self._last_output_text_offset = length
        return self.output_text[last_offset:length]

    def _decode_next(self, token_id: int) -> str:
        try:
            text = self.stream.step(self.tokenizer, token_id)
        except Exception as e:
            if not str(e).startswith(INVALID_PREFIX_ERR_MSG):
                raise
            # The stream's state is broken; restart it without context (nor the prompt's text it held) rather than
            # fail the request.
            self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            self._prompt_unsent_text = ""
            text = self.stream.step(self.tokenizer, token_id)
        if text and self._prompt_unsent_text:
            # The stream's first text starts with what it held of the prompt: the whole characters among that (a
            # literal U+FFFD ending the prompt) are the prompt's own, a character the output completed is not.
            text = text[len(os.path.commonprefix([self._prompt_unsent_text, text])):]
            self._prompt_unsent_text = ""
        return text or ""


def check_stop_strings(
    output_text: str, new_char_count: int, stop: list[str], include_in_output: bool
) -> tuple[str, int] | None:
    """Find a stop string that ends within the last new_char_count characters.

    Returns (stop string, length to truncate output_text to), or None. Of several matches, the one that ends
    first (ties: the first in ``stop``), as appending one token at a time would find it (vLLM's rule). Only the
    new text plus len(stop string) - 1 characters before it are searched.
    """
    if not new_char_count:
        return None
    best: tuple[str, int] | None = None
    for stop_str in stop:
        start = max(0, len(output_text) - new_char_count - len(stop_str) + 1)
        index = output_text.find(stop_str, start)
        if index != -1 and (best is None or index + len(stop_str) < best[1] + len(best[0])):
            best = (stop_str, index)
    if best is None:
        return None
    stop_str, index = best
    return stop_str, index + len(stop_str) if include_in_output else index


def _backend(tokenizer: Any) -> Tokenizer:
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise TypeError(f"IncrementalDetokenizer needs a tokenizers-backed (fast) tokenizer, got {type(tokenizer)}")
    return backend


# Tokens a character's bytes can be split over (UTF-8 takes at most 4 bytes, a byte-fallback token at least one).
_MAX_SPLIT_TOKENS = 4


def _primed_stream(tokenizer: Tokenizer, prompt_token_ids: list[int],
                   skip_special_tokens: bool) -> tuple[DecodeStream, str]:
    """A DecodeStream that has seen the prompt's tail, so that the first output token decodes in context (e.g. its
    leading space), and the text of the prompt's tokens it holds, unsent. A prompt that ends inside a character
    (token ids cut mid-character) primes with the text before that character, then steps the tokens of its first
    bytes: the stream holds them, and the output's first text is that character once an output token completes
    it, not the whole prompt (a DecodeStream primed with ids that decode to an unfinished character starts from
    nothing and would give back all of them). The stream cannot tell such a tail from a literal U+FFFD ending the
    prompt, which it holds the same way: the unsent text says what the output's first text is to lose then."""
    for held in range(min(_MAX_SPLIT_TOKENS, len(prompt_token_ids)) + 1):
        context = _clean_suffix(tokenizer, prompt_token_ids[:len(prompt_token_ids) - held])
        if context is None:
            continue
        stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        token_ids = context + prompt_token_ids[len(prompt_token_ids) - held:]
        num_sent = len(context)  # token_ids[:num_sent]: the tokens whose text the stream has given out
        for i in range(len(context), len(token_ids)):
            if stream.step(tokenizer, token_ids[i]) is not None:
                num_sent = i + 1
        if num_sent == len(token_ids):
            return stream, ""
        sent = tokenizer.decode(token_ids[:num_sent], skip_special_tokens=skip_special_tokens)
        text = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return stream, text[len(os.path.commonprefix([sent, text])):]
    return DecodeStream(skip_special_tokens=skip_special_tokens), ""


def _clean_suffix(tokenizer: Tokenizer, token_ids: list[int]) -> list[int] | None:
    """The shortest tail of at least 4 tokens (up to 23) that decodes to whole characters (all of ``token_ids`` when
    fewer), enough context for the next token without decoding the whole prompt; None when no such tail decodes
    to whole characters."""
    for n in range(min(4, len(token_ids)), min(len(token_ids), 23) + 1):
        suffix = token_ids[len(token_ids) - n:]
        if "\ufffd" not in tokenizer.decode(suffix):
            return suffix
    return None
