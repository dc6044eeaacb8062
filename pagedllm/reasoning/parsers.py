"""The reasoning parsers vLLM names deepseek_r1 and qwen3: a thinking model writes its reasoning between <think> and
</think>, then its answer.

Whether the output opens with <think> or the chat template already put it at the end of the prompt (DeepSeek-R1's
distills, Qwen3's thinking models), everything before the first </think> is reasoning, as vLLM's parsers take it;
without a </think> the whole output is (the model was cut off while thinking). Where the prompt already closed the
think block (its last marker a </think>), the whole output is content.

The markers are found in the text, not by token id, so a marker the model spells in several tokens is found too,
and a stream agrees with the whole answer: it holds back the end of a delta that may be the start of a marker until
the next delta says whether it is one. The whole answer is parsed as one delta of a stream, so the two cannot
disagree. As vLLM's, deepseek_r1 (token-id based there) refuses at construction a tokenizer whose vocabulary lacks
<think> or </think>; qwen3 (text based there too) does not.
"""
from __future__ import annotations

from typing import Any, Optional

THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START = "<tool_call>"


class DeepSeekR1ReasoningParser:
    # vLLM's reasoning_start_str and reasoning_end_str: what a thinking_token_budget counts from and forces.
    reasoning_start_str, reasoning_end_str = THINK_START, THINK_END
    # Whether the tokenizer's vocabulary must hold <think> and </think> (as vLLM's token-id based deepseek_r1 parser
    # needs them; its qwen3 parser, text based, does not).
    needs_marker_tokens = True
    # What ends the reasoning, and whether it stays in the content (True) or is dropped.
    end_markers: tuple[tuple[str, bool], ...] = ((THINK_END, False),)
    # What is dropped where it appears in the content.
    content_drops: tuple[str, ...] = ()
    # The tokens that start or end a chat turn (ChatML's, as vLLM's qwen3 parser reads the prompt, and DeepSeek's):
    # a </think> of an earlier turn (Qwen3's templates keep the reasoning of the turns after the last user message)
    # has not ended this one's reasoning.
    turn_boundaries: tuple[str, ...] = ("<|im_start|>", "<|im_end|>", "<｜User｜>", "<｜Assistant｜>")

    def __init__(self, tokenizer: Any, chat_template_kwargs: Optional[dict] = None,
                 prompt_token_ids: Optional[list[int]] = None) -> None:
        """chat_template_kwargs: the request's, which may turn the model's thinking off (qwen3). prompt_token_ids:
        the request's prompt; where the last think marker of its last turn is a </think> (a template that closes
        the think block, or a continued message that did), the reasoning is over and the whole output is content,
        as vLLM's is_reasoning_end of the prompt says."""
        if tokenizer is None:  # vLLM's ReasoningParser reads the vocabulary: none without a tokenizer
            raise ValueError("The model tokenizer must be passed to the ReasoningParser constructor during "
                             "construction.")
        vocab = tokenizer.get_vocab()
        if self.needs_marker_tokens and not (THINK_START in vocab and THINK_END in vocab):
            raise RuntimeError(f"{type(self).__name__} reasoning parser could not locate think start/end tokens in "
                               "the tokenizer!")
        markers = [THINK_START, *(marker for marker, _ in self.end_markers)]
        # The markers' token ids where each is one token (as in thinking models' vocabularies), for counting.
        self._marker_ids: Optional[list[int]] = [vocab[m] for m in markers] if all(m in vocab for m in markers) \
            else None
        self._boundary_ids = {vocab[m] for m in self.turn_boundaries if m in vocab}
        self.thinking = not self.is_reasoning_end(prompt_token_ids or [])

    def is_reasoning_end(self, token_ids: list[int]) -> bool:
        """Whether ``token_ids`` close the reasoning (vLLM's is_reasoning_end): the last <think> or </think> (each one
        token) of their last turn is a </think>."""
        if self._marker_ids is None:
            return False
        start, end = self._marker_ids[:2]
        for token_id in reversed(token_ids):
            if token_id in (start, end):
                return token_id == end
            if token_id in self._boundary_ids:
                return False
        return False

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)

    def extract_reasoning(self, text: str) -> tuple[Optional[str], Optional[str]]:
        """(reasoning, content) of a whole answer: reasoning None where the model did not think, content None where
        nothing follows the reasoning (vLLM's extract_reasoning)."""
        stream = self.stream()
        reasoning, content = stream.feed(text)
        rest_reasoning, rest_content = stream.finish()
        content += rest_content
        return (reasoning + rest_reasoning if self.thinking else None), content or None

    def reasoning_end_token_ids(self) -> Optional[list[int]]:
        """The ids of the tokens that end the reasoning, where each marker is one token; else None."""
        return None if self._marker_ids is None else self._marker_ids[1:]

    def count_reasoning_tokens(self, token_ids: list[int]) -> Optional[int]:
        """As vLLM's deepseek_r1 (its BaseThinkingReasoningParser's, the same streamed or not): the output's tokens
        inside its own <think> ... </think> spans, nested ones by depth, a stray </think> ignored, whatever the
        prompt holds. Reasoning the chat template opened (no <think> in the output) counts 0, though the answer's
        reasoning holds it."""
        start, end = self._marker_ids  # one token each: the vocabulary must hold them (needs_marker_tokens)
        count = depth = 0
        for token_id in token_ids:
            if token_id == start:
                depth += 1
            elif token_id == end:
                depth = max(depth - 1, 0)
            else:
                count += depth > 0
        return count


class Qwen3ReasoningParser(DeepSeekR1ReasoningParser):
    """As deepseek_r1, and as vLLM's qwen3 parser: a <tool_call> ends the reasoning too (it opens the answer's tool
    call, which stays in the content); a </think> after the reasoning's is dropped; and with the request's
    chat_template_kwargs enable_thinking false (the template closes an empty think block in the prompt) the whole
    output is content."""

    end_markers = ((THINK_END, False), (TOOL_CALL_START, True))
    content_drops = (THINK_END,)
    needs_marker_tokens = False

    def __init__(self, tokenizer: Any, chat_template_kwargs: Optional[dict] = None,
                 prompt_token_ids: Optional[list[int]] = None) -> None:
        super().__init__(tokenizer, chat_template_kwargs, prompt_token_ids)
        self.thinking = self.thinking and bool((chat_template_kwargs or {}).get("enable_thinking", True))

    def count_reasoning_tokens(self, token_ids: list[int]) -> Optional[int]:
        """How many of the output's tokens are its reasoning (the markers left out); None where a marker is not one
        token of the vocabulary, and the count cannot be read off the ids."""
        if not self.thinking:
            return 0
        if self._marker_ids is None:
            return None
        start, *ends = self._marker_ids
        count = 0
        for token_id in token_ids:
            if token_id in ends:
                break
            count += token_id != start
        return count


class ReasoningStream:
    """One answer's deltas split as they come: feed() gives each delta's (reasoning, content), finish() what it held
    back at the end."""

    def __init__(self, parser: DeepSeekR1ReasoningParser) -> None:
        self.parser = parser
        self.in_reasoning = parser.thinking
        self._held = ""  # the end of the text so far, which may be the start of a marker

    def _markers(self) -> list[tuple[str, Optional[bool]]]:
        """The markers that matter now: (text, whether it ends the reasoning and stays in the content; None: it
        is dropped and changes nothing)."""
        if self.in_reasoning:
            return [(THINK_START, None), *((marker, kept) for marker, kept in self.parser.end_markers)]
        if not self.parser.thinking:  # no reasoning: the output is the content as it is
            return []
        return [(marker, None) for marker in self.parser.content_drops]

    def feed(self, delta: str) -> tuple[str, str]:
        text, self._held = self._held + delta, ""
        reasoning, content = [], []
        while text:
            markers = self._markers()
            found = [(text.find(marker), marker, kept) for marker, kept in markers if marker in text]
            if not found:
                held = max((_prefix_overlap(text, marker) for marker, _ in markers), default=0)
                (reasoning if self.in_reasoning else content).append(text[:len(text) - held])
                self._held = text[len(text) - held:]
                break
            at, marker, kept = min(found)
            (reasoning if self.in_reasoning else content).append(text[:at])
            text = text[at + len(marker):]
            if kept is not None:  # the reasoning ends here
                self.in_reasoning = False
                if kept:  # the content starts with it
                    content.append(marker)
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        return (held, "") if self.in_reasoning else ("", held)


def _prefix_overlap(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``marker``."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


REASONING_PARSERS = {"deepseek_r1": DeepSeekR1ReasoningParser, "qwen3": Qwen3ReasoningParser}


def get_reasoning_parser(name: str) -> type[DeepSeekR1ReasoningParser]:
    if not isinstance(name, str) or name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser {name!r} is not one of {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]
