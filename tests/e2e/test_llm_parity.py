"""Greedy output identical to transformers, token for token, in float32 on the same dequantized SmolLM2 weights,
through the engine as users run it (the EngineCore in its own process; ``llm`` is the package's shared engine of
the default settings, conftest.py).

Each engine configuration exercises a different path: one-step prefill, chunked prefill with preemption and
recompute, prefix-cache hits, cascade attention, and one request at a time.
"""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.e2e.conftest import assert_transformers_greedy, in_process_llm, running_llm

MAX_TOKENS = 48
PROMPT_LENGTHS = [5, 17, 33, 64, 100, 150, 260, 400]
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based inks and a wooden press adapted from wine making. Books, once copied by "
    "hand over months, could now be produced by the hundreds. Literacy spread, ideas travelled faster, and "
    "scholars across Europe could compare identical texts for the first time. The Reformation, the "
    "Scientific Revolution and the rise of newspapers all owe something to this invention. In the centuries "
    "that followed, steam power, rotary presses and offset lithography made printing cheaper still, until "
    "the twentieth century brought photocomposition and, finally, digital typesetting. Today most text is "
    "read on screens, yet the habits of the printed page, such as paragraphs, margins, page numbers and "
    "footnotes, still shape how we write and read. Historians continue to debate how much credit belongs "
    "to Gutenberg himself, since earlier printers in Korea and China had used movable type, and since the "
    "economic conditions of the Rhine valley made a printing business possible. What is clear is that "
    "cheap, reliable copies changed the relationship between authors, readers and authority. Universities "
    "grew their libraries, merchants printed price lists, governments issued proclamations, and ordinary "
    "people began to own books of their own. The same pattern, in which a technology of copying lowers the "
    "cost of sharing knowledge, has repeated with the telegraph, radio, television and the internet. Each "
    "time, people worried about misinformation and about the loss of older skills, and each time society "
    "slowly built new institutions of trust. Librarians, editors, peer reviewers and fact checkers are all "
    "answers to the question of how we decide what to believe when copying is easy. Teachers, meanwhile, "
    "had to rethink what it means to know something when facts can be looked up in seconds. The lesson of "
    "the printing press may be that new tools rarely replace judgment; they move it somewhere else, and "
    "they reward those who learn to use it well. " * 2
)
SYSTEM = TEXT[:900]


def make_prompts(tokenizer, prefix: str = "") -> list[list[int]]:
    base = tokenizer.encode(prefix + TEXT)
    return [base[:n] if not prefix else base[:len(tokenizer.encode(prefix)) + n] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return make_prompts(tokenizer)


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_prompts_span_5_to_400_tokens(prompts):
    assert [len(p) for p in prompts] == PROMPT_LENGTHS


def test_default_settings(llm, hf_model, prompts):
    assert_transformers_greedy(hf_model, prompts, run(llm, prompts), MAX_TOKENS)


def test_chunked_prefill_and_preemption(hf_model, prompts):
    """Prompts cut into 64-token chunks (five of the eight are longer), and 40 blocks where the longest request
    needs 28 (448 tokens) and all eight 127: requests are preempted and recomputed, in chunks too."""
    with running_llm(dtype="float32", max_model_len=1024, max_num_batched_tokens=64, num_kv_blocks=40) as llm:
        assert_transformers_greedy(hf_model, prompts, run(llm, prompts), MAX_TOKENS)
        assert llm.get_stats().num_preemptions > 0


def test_max_num_seqs_1(hf_model, prompts):
    """Requests one at a time: three of the prompts (5, 64 and 260 tokens) show it."""
    with running_llm(dtype="float32", max_model_len=1024, max_num_seqs=1, num_kv_blocks=256) as llm:
        assert_transformers_greedy(hf_model, prompts[::3], run(llm, prompts[::3]), MAX_TOKENS)


def test_shared_system_prompt_hits_prefix_cache(llm, tokenizer, hf_model):
    shared = make_prompts(tokenizer, prefix=SYSTEM)[:4]
    hits = llm.get_stats().prefix_cache_hits
    run(llm, shared[:1])  # warm the cache with the system prompt
    assert_transformers_greedy(hf_model, shared, run(llm, shared), MAX_TOKENS)
    assert llm.get_stats().prefix_cache_hits > hits


def test_long_shared_prefix_uses_cascade_attention(tokenizer, hf_model, monkeypatch):
    """A cached prefix over CASCADE_MIN_PREFIX_TOKENS shared by the whole batch is attended once for all
    requests (cascade attention); the output must not change. In process, to see the attention plans."""
    from pagedllm.layers.attention import cpu_backend

    plans, build_plan = [], cpu_backend.build_plan

    def recording_build_plan(*args):
        plans.append(build_plan(*args))
        return plans[-1]

    monkeypatch.setattr(cpu_backend, "build_plan", recording_build_plan)
    shared = make_prompts(tokenizer, prefix=TEXT[:1800])[:4]
    llm = in_process_llm(dtype="float32", max_model_len=1024, num_kv_blocks=512)
    run(llm, shared[:1])  # cache the shared prefix
    assert_transformers_greedy(hf_model, shared, run(llm, shared), MAX_TOKENS)
    prefix_tokens = {p.prefix.num_tokens for p in plans if p.prefix is not None}
    assert prefix_tokens and min(prefix_tokens) >= 256
