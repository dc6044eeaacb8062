"""The reasoning parsers (vLLM's deepseek_r1 and qwen3) without a model: whole answers split as vLLM's parsers split
them, and every way of cutting an answer into stream deltas giving the same split."""
from __future__ import annotations

import random

import pytest

from pagedllm.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser, get_reasoning_parser


class _Tokenizer:
    def __init__(self, vocab: dict[str, int] | None = None) -> None:
        self.vocab = {"<think>": 7, "</think>": 8, "<tool_call>": 9, "x": 1, "<|im_start|>": 2, "<|im_end|>": 3} \
            if vocab is None else vocab

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


R1, QWEN3 = DeepSeekR1ReasoningParser(_Tokenizer()), Qwen3ReasoningParser(_Tokenizer())
QWEN3_NOT_THINKING = Qwen3ReasoningParser(_Tokenizer(), {"enable_thinking": False})


@pytest.mark.parametrize("parser, text, split", [
    (R1, "<think>Paris, surely.</think>Paris", ("Paris, surely.", "Paris")),
    (R1, "The template opened it.</think>\n\nParis", ("The template opened it.", "\n\nParis")),
    (R1, "Cut off while thinking", ("Cut off while thinking", None)),
    (R1, "<think>Done.</think>", ("Done.", None)),
    (R1, "</think>No thoughts", ("", "No thoughts")),
    (R1, "<think>a</think>b</think>c", ("a", "b</think>c")),
    (R1, "thinking <tool_call>{}</tool_call>", ("thinking <tool_call>{}</tool_call>", None)),
    (R1, "Ends in half a marker </thi", ("Ends in half a marker </thi", None)),
    (QWEN3, "<think>a</think>b</think>c", ("a", "bc")),  # a later </think> is dropped
    (QWEN3, "Let me call it.<tool_call>{}</tool_call>", ("Let me call it.", "<tool_call>{}</tool_call>")),
    (QWEN3_NOT_THINKING, "<think>\n\n</think>Paris", (None, "<think>\n\n</think>Paris")),
])
def test_a_whole_answer_and_every_stream_of_it_split_alike(parser, text, split):
    assert parser.extract_reasoning(text) == split
    rng = random.Random(0)
    for _ in range(50):
        stream, reasoning, content, at = parser.stream(), "", "", 0
        while at < len(text):
            cut = min(len(text), at + rng.randint(1, 5))
            more_reasoning, more_content = stream.feed(text[at:cut])
            reasoning, content, at = reasoning + more_reasoning, content + more_content, cut
        rest_reasoning, rest_content = stream.finish()
        reasoning, content = reasoning + rest_reasoning, content + rest_content
        assert (reasoning if parser.thinking else None, content or None) == split


def test_a_marker_cut_across_deltas_is_held_back_until_it_is_known():
    stream = R1.stream()
    assert stream.feed("I think</th") == ("I think", "")
    assert stream.feed("ink>Paris") == ("", "Paris")
    stream = R1.stream()
    assert stream.feed("a </") == ("a ", "")
    assert stream.feed("b") == ("</b", "")  # not a marker after all


def test_reasoning_tokens_are_counted_by_the_markers_ids():
    """deepseek_r1 as vLLM's: the tokens inside the output's own <think> ... </think> spans; reasoning the prompt
    opened (no <think> in the output) counts 0, and a closed think block in the prompt changes nothing."""
    assert DeepSeekR1ReasoningParser(_Tokenizer()).count_reasoning_tokens([7, 1, 1, 1, 8, 1, 1]) == 3
    assert DeepSeekR1ReasoningParser(_Tokenizer()).count_reasoning_tokens([1, 1, 8, 1]) == 0  # opened in the prompt
    assert DeepSeekR1ReasoningParser(_Tokenizer()).count_reasoning_tokens([7, 1, 8, 1, 8, 7, 7, 1, 8, 1]) == 3
    assert DeepSeekR1ReasoningParser(_Tokenizer(), None, [7, 8]).count_reasoning_tokens([7, 1, 8]) == 1
    assert Qwen3ReasoningParser(_Tokenizer()).count_reasoning_tokens([7, 1, 9, 1]) == 1
    assert Qwen3ReasoningParser(_Tokenizer(), {"enable_thinking": False}).count_reasoning_tokens([7, 1, 8]) == 0
    assert Qwen3ReasoningParser(_Tokenizer({"x": 1})).count_reasoning_tokens([1, 2]) is None  # no ids to count by


def test_a_prompt_that_closed_the_think_block_leaves_the_whole_output_content():
    """vLLM's is_reasoning_end of the prompt: its last marker a </think>, the reasoning is over."""
    closed = DeepSeekR1ReasoningParser(_Tokenizer(), None, [1, 7, 1, 8, 1])
    assert not closed.thinking and closed.extract_reasoning("Paris</think>") == (None, "Paris</think>")
    assert closed.count_reasoning_tokens([1, 8]) == 0
    assert DeepSeekR1ReasoningParser(_Tokenizer(), None, [1, 8, 1, 7]).thinking  # reopened: still thinking
    assert DeepSeekR1ReasoningParser(_Tokenizer(), None, [1, 1]).thinking
    assert not Qwen3ReasoningParser(_Tokenizer(), {"enable_thinking": True}, [7, 8]).thinking
    # the last turn only (vLLM's qwen3 turn boundaries): an earlier turn's </think> leaves this one thinking
    assert Qwen3ReasoningParser(_Tokenizer(), None, [2, 7, 1, 8, 1, 3, 2, 1]).thinking
    assert DeepSeekR1ReasoningParser(_Tokenizer(), None, [2, 7, 1, 8, 1, 3, 2, 1]).thinking
    assert not Qwen3ReasoningParser(_Tokenizer(), None, [2, 7, 1, 8, 1, 3, 2, 1, 7, 8]).thinking


def test_deepseek_r1_needs_the_think_tokens_in_the_vocabulary():
    """As vLLM's parsers, built at a request: deepseek_r1 (token-id based) refuses a vocabulary without <think> or
    </think> with vLLM's error (it split the text as though a thinking model wrote it); qwen3 (text based in vLLM too)
    takes one; neither takes no tokenizer."""
    for vocab in ({"x": 1}, {"<think>": 7}, {"</think>": 8}):
        with pytest.raises(RuntimeError, match="^DeepSeekR1ReasoningParser reasoning parser could not locate think "
                                               "start/end tokens in the tokenizer!$"):
            DeepSeekR1ReasoningParser(_Tokenizer(vocab))
    assert Qwen3ReasoningParser(_Tokenizer({"x": 1})).extract_reasoning("a</think>b") == ("a", "b")
    for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser):
        with pytest.raises(ValueError, match="The model tokenizer must be passed to the ReasoningParser constructor"):
            parser(None)


def test_an_unknown_parser_is_a_value_error_naming_the_choices():
    with pytest.raises(ValueError, match="reasoning_parser 'nope' is not one of deepseek_r1, qwen3"):
        get_reasoning_parser("nope")


def test_the_processor_builds_its_reasoning_parser_once_for_every_grammar():
    """A grammar waits for the reasoning's end unless the prompt ended it; the Processor's parser, which reads the
    whole vocabulary, is built once for all requests (as vLLM's StructuredOutputManager's reasoner)."""
    from types import SimpleNamespace

    from pagedllm.config import ReasoningConfig
    from pagedllm.engine.processor import Processor
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.structured_output.params import StructuredOutputsParams

    class CountingTokenizer(_Tokenizer):
        eos_token_id, vocab_reads = 3, 0

        def get_vocab(self) -> dict[str, int]:
            CountingTokenizer.vocab_reads += 1
            return super().get_vocab()

    model_config = SimpleNamespace(path="/nonexistent", generation_config="auto", hf_config=SimpleNamespace())
    processor = Processor(model_config, CountingTokenizer(),
                          reasoning_config=ReasoningConfig("deepseek_r1", (7,), (8,), (8,)))
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True))
    held = [processor.hold_grammar_while_reasoning(params, prompt).structured_outputs._reasoning_end_token_ids
            for prompt in ([1, 7, 1], [1, 7, 1, 8, 1], [1])]
    assert held == [[8], None, [8]]
    assert CountingTokenizer.vocab_reads == 1
