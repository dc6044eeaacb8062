"""IncrementalDetokenizer: a request's output text, built token by token, with stop-string checks.

Decoding uses tokenizers' DecodeStream (as vLLM's FastIncrementalDetokenizer): it holds back the bytes
of a character split across tokens, so text never carries U+FFFD for a char that is still incomplete.
"""
from __future__ import annotations

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
        # Prime with the prompt's tail so the first output token decodes in context (e.g. its leading space).
        self.stream = DecodeStream(
            ids=_prompt_suffix(self.tokenizer, prompt_token_ids), skip_special_tokens=self.skip_special_tokens
        )

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Append the new tokens' text and return the stop string they completed, if any.

        On a match output_text is cut before the stop string (after it with include_stop_str_in_output).
        stop_terminated: the last token is the EOS/stop token that ended the request; its text is left
        out unless include_stop_str_in_output, and stop strings are not checked.
        """
        skipped_stop_token_id = None
        if stop_terminated and not self.include_stop_str_in_output and new_token_ids:
            *new_token_ids, skipped_stop_token_id = new_token_ids

        # Text produced while the request is still under min_tokens cannot stop it.
        stop_check_offset = len(self.output_text)
        for token_id in new_token_ids:
            self.output_token_ids.append(token_id)
            self.output_text += self._decode_next(token_id)
            if len(self.output_token_ids) <= self.min_tokens:
                stop_check_offset = len(self.output_text)

        if stop_terminated:
            if skipped_stop_token_id is not None:
                self.output_token_ids.append(skipped_stop_token_id)
            return None

        match = check_stop_strings(
            self.output_text,
            len(self.output_text) - stop_check_offset,
            self.stop,
            self.include_stop_str_in_output,
        )
        if match is None:
            return None
        stop_str, truncate_to = match
        self.output_text = self.output_text[:truncate_to]
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to send now: all of it, or (delta) only what was not sent before.

        Until the request finishes, the last stop_buffer_length characters are held back.
        """
        buffer_length = 0 if finished else self.stop_buffer_length
        length = len(self.output_text) - buffer_length
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
            # The stream's state is broken; restart it without context rather than fail the request.
            self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            text = self.stream.step(self.tokenizer, token_id)
        return text or ""


def check_stop_strings(
    output_text: str, new_char_count: int, stop: list[str], include_in_output: bool
) -> tuple[str, int] | None:
    """Find a stop string that ends within the last new_char_count characters.

    Returns (stop string, length to truncate output_text to), taking the earliest match, or None.
    Only the new text plus len(stop string) - 1 characters before it are searched.
    """
    if not new_char_count:
        return None
    best: tuple[str, int] | None = None
    for stop_str in stop:
        start = max(0, len(output_text) - new_char_count - len(stop_str) + 1)
        index = output_text.find(stop_str, start)
        if index != -1 and (best is None or index < best[1]):
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


def _prompt_suffix(tokenizer: Tokenizer, prompt_token_ids: list[int]) -> list[int]:
    """The shortest prompt tail of at least 4 tokens (up to 23) that starts on a character boundary.

    Enough context for the first output token, without decoding the whole prompt.
    """
    for n in range(4, min(len(prompt_token_ids), 23) + 1):
        suffix = prompt_token_ids[-n:]
        if "\ufffd" not in tokenizer.decode(suffix):
            return suffix
    return prompt_token_ids
