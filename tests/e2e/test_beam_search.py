"""LLM.beam_search against transformers' beam search on the same float32 weights, and its validation. ``llm`` is
the package's shared float32 engine (conftest.py), in its own process as users run it."""
from __future__ import annotations

import weakref

import pytest
import torch

from pagedllm.sampling_params import MAX_N_SEQUENCES, BeamSearchParams
from tests.e2e.conftest import in_process_llm

BEAM_WIDTH = 4


_searched: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def hf_beam_search(hf_model, prompt_token_ids: list[int], max_new_tokens: int, eos_token_id: int) -> list[list[int]]:
    """HF's beams, best first: generated ids up to and including the EOS (the rest is padding). Memoized per model:
    tests compare several engines' (or adapters') searches with the same one."""
    searched = _searched.setdefault(hf_model, {})
    key = (tuple(prompt_token_ids), max_new_tokens, eos_token_id)
    if key not in searched:
        searched[key] = _hf_beam_search(hf_model, prompt_token_ids, max_new_tokens, eos_token_id)
    return [list(beam) for beam in searched[key]]


def _hf_beam_search(hf_model, prompt_token_ids: list[int], max_new_tokens: int, eos_token_id: int) -> list[list[int]]:
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt_token_ids]), num_beams=BEAM_WIDTH,
                                num_return_sequences=BEAM_WIDTH, do_sample=False, max_new_tokens=max_new_tokens,
                                length_penalty=1.0)
    beams = []
    for row in out[:, len(prompt_token_ids):].tolist():
        beams.append(row[:row.index(eos_token_id) + 1] if eos_token_id in row else row)
    return beams


def test_beams_equal_transformers_beam_search(llm, hf_model, tokenizer):
    """Three chat prompts in one batch, each needing one of HF's rules to come out the same (checked by breaking
    each rule): Japan stops early once four answers have ended, "hot" has an EOS candidate ranked past the top
    four that must not finish, and France's ranking depends on scoring by generated length only."""
    questions = ["What is the capital of Japan?", "What is the opposite of hot?", "What is the capital of France?"]
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)) for q in questions]
    max_tokens, eos = 24, tokenizer.eos_token_id
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=BEAM_WIDTH, max_tokens=max_tokens))
    for question, prompt, out in zip(questions, prompts, outs):
        ours = [seq.tokens[len(prompt):] for seq in out.sequences]
        assert ours == hf_beam_search(hf_model, prompt, max_tokens, eos), question
        for seq, generated in zip(out.sequences, ours):
            assert seq.tokens[:len(prompt)] == prompt
            assert seq.finish_reason == ("stop" if generated[-1] == eos else "length")
            assert seq.text == tokenizer.decode(generated[:-1] if generated[-1] == eos else generated,
                                                skip_special_tokens=True)
            # vLLM's logprobs: each token's step candidates, which hold the token and add up to cum_logprob
            assert len(seq.logprobs) == len(generated)
            assert sum(step[t].logprob for t, step in zip(generated, seq.logprobs)) == pytest.approx(seq.cum_logprob)
            assert all(len(step) >= 2 * BEAM_WIDTH for step in seq.logprobs)
    assert all(seq.finish_reason == "stop" for seq in outs[0].sequences)


@pytest.mark.parametrize("kwargs, field", [
    ({"beam_width": 0, "max_tokens": 4}, "beam_width"),
    ({"beam_width": MAX_N_SEQUENCES + 1, "max_tokens": 4}, "beam_width"),
    ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
    ({"beam_width": 2, "max_tokens": 4, "temperature": -1.0}, "temperature"),
])
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        BeamSearchParams(**kwargs)


def test_vllms_other_fields_are_taken_in_its_order(caplog):
    """vLLM 0.32's fields, in its order: structured_outputs (which a beam's step request cannot resume) refused by
    name; watermarking, which an engine without a watermark config (pagedllm's) only warns of, as vLLM's does."""
    from pagedllm.sampling_params import StructuredOutputsParams, _warn_no_watermarking

    _warn_no_watermarking.cache_clear()  # given once a process: here whatever ran before

    params = BeamSearchParams(2, 4, False, 0.0, 1.0, False, None, False, False)
    assert (params.structured_outputs, params.skip_special_tokens, params.watermarking) == (None, False, False)
    with pytest.raises(ValueError, match="^structured_outputs is not supported with beam search"):
        BeamSearchParams(beam_width=2, max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a+"))
    with caplog.at_level("WARNING", logger="pagedllm.sampling_params"):
        assert BeamSearchParams(beam_width=2, max_tokens=4, watermarking=True).watermarking is True
    assert any("will run without watermarking" in r.getMessage() for r in caplog.records)


def test_beam_width_is_bounded_by_the_engines_max_logprobs(llm):
    """Each step asks for 2 * beam_width logprobs: the default max_logprobs (20) allows 10 beams, and a raised one
    more (vLLM's engine bounds them the same way)."""
    with pytest.raises(ValueError, match="^beam_width must be at most 10"):
        llm.beam_search("Hello", BeamSearchParams(beam_width=11, max_tokens=2))
    wide = in_process_llm(dtype="float32", max_model_len=256, kv_cache_memory="128MiB", max_logprobs=24)
    try:
        out = wide.beam_search("The capital of France is", BeamSearchParams(beam_width=12, max_tokens=2))
    finally:
        wide.shutdown()
    assert len(out[0].sequences) == 12


def test_max_tokens_must_fit_the_context(llm):
    with pytest.raises(ValueError, match="^max_tokens"):
        llm.beam_search("Hello", BeamSearchParams(beam_width=2, max_tokens=1024))


@pytest.mark.parametrize("length_penalty", [1000.0, -1000.0])
def test_extreme_length_penalty_scores_instead_of_raising(llm, length_penalty):
    """len ** length_penalty leaves float's range by the third token (an OverflowError, or 0 and a
    ZeroDivisionError); the scores take their limits and the search ends as usual."""
    out = llm.beam_search("The capital of France is", BeamSearchParams(beam_width=2, max_tokens=4,
                                                                        length_penalty=length_penalty))
    assert len(out[0].sequences) == 2
    assert all(seq.finish_reason in ("stop", "length") for seq in out[0].sequences)
