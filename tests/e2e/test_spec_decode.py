"""Speculative decoding end to end, through the engine process, for each method: greedy output token for token
that of plain decoding on the default model (8 mixed prompts in one batch, chunked prefill, forced preemption,
prefix-cache hits, stop strings and max_tokens ending mid-draft, logprobs), and random sampling drawing the exact
distribution of a tiny model (transformers' probabilities as the oracle), whose greedy output is transformers'."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedllm import SamplingParams, native
from pagedllm.models.resolve import DEFAULT_MODEL, resolve_model
from tests.e2e.conftest import assert_transformers_greedy, running_llm

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
# Self-speculation: the model's own GGUF with its Q4 weights kept 4-bit. In float32 on the native Q4 panels those
# compute what the dense target computes, so every draft is the target's token and any draft computed on stale or
# misplaced K/V (after a rejection, a preemption, a prefix hit) would show as a rejection.
SELF_DRAFT = {"method": "draft_model", "model": resolve_model(DEFAULT_MODEL), "quantization": "gguf_int4",
              "num_speculative_tokens": 3}
FRUITS = "apple, banana, cherry, damson, elderberry, fig, grape, honeydew, kiwi, lemon, mango"
CODE = "def area(width, height):\n    result = width * height\n    return result\n"
# The second prompt is the first's, so that it hits the prefix cache whatever the schedule: FCFS admits it right
# after the first, before any other request takes a block, so its lookup finds the first's prompt blocks (held by the
# first while it runs; evicted by no allocation if it has finished). Placed after other requests, it could find them
# evicted under this tight cache, depending on how the engine process's steps and the requests' arrival interleaved
# (dynamic speculation sizes steps by their measured times): prefix_cache_hits was then 0.
PROMPTS = [
    f"Fruits: {FRUITS}.\nThe same fruits again: apple, banana,",
    f"Fruits: {FRUITS}.\nThe same fruits again: apple, banana,",
    f"Copy this code exactly.\n{CODE}\nCopy:\n",
    "The capital of France is",
    f"Rename result to total in this code.\n{CODE}\nRenamed:\n",
    "Count: one, two, three, four, five, six,",
    "A short poem about the sea:\n",
    "def fibonacci(n):",
]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=40),
    SamplingParams(temperature=0, max_tokens=40, stop=["kiwi"]),
    SamplingParams(temperature=0, max_tokens=37, stop=["return"]),  # a stop string the draft runs past
    SamplingParams(temperature=0, max_tokens=24, logprobs=2),
    SamplingParams(temperature=0, max_tokens=40),
    SamplingParams(temperature=0, max_tokens=13),  # max_tokens ending mid-draft
    SamplingParams(temperature=0, max_tokens=24),
    SamplingParams(temperature=0, max_tokens=30),
]


SUFFIX = {"method": "suffix"}  # vLLM's defaults: trees 24 deep, up to 24 drafts


@pytest.fixture(scope="module", params=["ngram", "draft_model", "suffix"])
def spec_llm(request):
    """Chunked prefill (64-token budget) and a cache of 12 blocks (192 tokens) for a batch that needs ~40 (forced
    preemption)."""
    config = {"ngram": NGRAM, "draft_model": SELF_DRAFT, "suffix": SUFFIX}[request.param]
    with running_llm(dtype="float32", max_model_len=1024, max_num_batched_tokens=64, num_kv_blocks=12,
                     speculative_config=config) as engine:
        engine.method = request.param
        yield engine


@pytest.fixture(scope="module")
def expected(llm):
    """Plain decoding's outputs, once for the three methods."""
    return llm.generate(PROMPTS, PARAMS, use_tqdm=False)


def test_greedy_output_is_that_of_plain_decoding(expected, spec_llm):
    got = spec_llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    for e, g in zip(expected, got):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids, g.prompt
        assert g.outputs[0].text == e.outputs[0].text
        assert g.outputs[0].finish_reason == e.outputs[0].finish_reason
    e, g = expected[3].outputs[0], got[3].outputs[0]  # the request with logprobs
    assert [list(step) for step in g.logprobs] == [list(step) for step in e.logprobs]
    for e_step, g_step in zip(e.logprobs, g.logprobs):
        for token_id, logprob in e_step.items():
            assert g_step[token_id].logprob == pytest.approx(logprob.logprob, abs=1e-4)
    stats = spec_llm.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    if spec_llm.method != "draft_model":  # the repeated lists and code are found in the prompts: many drafts are right
        assert stats.spec_decode_num_accepted_tokens > 0.3 * stats.spec_decode_num_draft_tokens > 0
    elif native.gemm_q4() is not None:  # the draft computes what the target does, from K/V kept in step (preemption,
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0  # prefix hits)
    else:  # the draft's Q4 layers on torch's int4 kernel (no native Q4 panels), which rounds differently: a near-tie
        assert stats.spec_decode_num_accepted_tokens >= 0.95 * stats.spec_decode_num_draft_tokens > 0  # can flip
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos  # a draft token is accepted only after the ones before it
    assert stats.spec_decode_num_drafts >= per_pos[0] and per_pos == sorted(per_pos, reverse=True)
    assert sum(per_pos) == stats.spec_decode_num_accepted_tokens
    accepted = stats.spec_decode_num_accepted_tokens
    assert stats.spec_decode_acceptance_rate == accepted / stats.spec_decode_num_draft_tokens
    assert stats.spec_decode_mean_acceptance_length == 1 + accepted / stats.spec_decode_num_drafts
    assert stats.kv_cache_usage == 0.0  # every block given back


def test_a_seeded_request_samples_what_plain_decoding_does(llm, spec_llm):
    """A seeded request draws each token's noise by its output position, so with speculation it emits the tokens
    plain decoding with that seed emits, alone or in a batch, however many drafts each step verified."""
    seeded = SamplingParams(temperature=0.8, top_p=0.95, presence_penalty=0.2, seed=1234, max_tokens=24,
                            ignore_eos=True)
    others = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    plain = llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
    alone = spec_llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
    batched = spec_llm.generate(PROMPTS[:4], [seeded, others, others, others], use_tqdm=False)[0].outputs[0]
    assert alone == plain and batched.token_ids == plain


def test_a_stop_token_among_accepted_drafts_cuts_the_logprobs_too(spec_llm):
    """A stop token accepted mid-draft ends the output there, and its logprobs with it (the drafts after it were
    sampled, and had logprobs, but are not the output)."""
    count = "one, two, three, four, five, six, seven, eight, nine, ten"
    prompt = f"Count: {count}. Again: {count}. Again: one, two,"  # whose continuation its drafts find in it
    plain = spec_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    for at in (4, 6, 9):
        stop = plain.token_ids[at]
        params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop], logprobs=1)
        got = spec_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        end = plain.token_ids.index(stop) + 1
        assert got.token_ids == plain.token_ids[:end] and got.finish_reason == "stop"
        assert len(got.logprobs) == end


def test_a_stop_string_among_accepted_drafts_cuts_the_tokens_and_logprobs(spec_llm):
    """A stop string completed by an accepted draft ends the output at the token completing it, as plain decoding
    ends it: the tokens after it in the same step, and their logprobs, are not the output."""
    count = "one, two, three, four, five, six, seven, eight, nine, ten"
    prompt = f"Count: {count}. Again: {count}. Again: one, two,"
    plain = spec_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    tokenizer = spec_llm.get_tokenizer()
    for word in ("four", "six", "nine"):
        params = SamplingParams(temperature=0, max_tokens=30, stop=[word], logprobs=1)
        got = spec_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        end = next(n for n in range(1, len(plain.token_ids) + 1)
                   if word in tokenizer.decode(plain.token_ids[:n]))
        assert got.token_ids == plain.token_ids[:end] and len(got.logprobs) == end, word
        assert (got.text, got.finish_reason, got.stop_reason) == (plain.text[:plain.text.index(word)], "stop", word)


TINY_VOCAB = 8
TOP_K = 3


def save_tiny_llama(path, tokenizer, seed: int, num_layers: int, max_position_embeddings: int = 256
                    ) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
                         initializer_range=0.2, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tokenizer):
    """A tiny random Llama over 8 tokens: the n-gram drafts a prompt over them proposes are often among its top-k,
    so verification both accepts and rejects."""
    path = tmp_path_factory.mktemp("tiny-spec")
    return str(path), save_tiny_llama(path, tokenizer, seed=0, num_layers=2)


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory, tokenizer) -> str:
    """Another tiny random Llama over the same 8 tokens, one layer: its greedy drafts are the target's top token
    some of the time."""
    path = tmp_path_factory.mktemp("tiny-draft")
    save_tiny_llama(path, tokenizer, seed=1, num_layers=1)
    return str(path)


def tiny_speculative_config(method: str, draft: str | None) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 4,
                "suffix_decoding_min_token_prob": 0.0}
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": 2}


def top_k_probabilities(model, prompt: list[int], num_tokens: int) -> dict[tuple[int, ...], float]:
    """transformers' probability of every sequence of num_tokens top-k (renormalised, temperature 1) tokens."""
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    with torch.inference_mode():
        for _ in range(num_tokens):
            longer = {}
            for seq, p in probs.items():
                logits = model(torch.tensor([prompt + list(seq)])).logits[0, -1].double()
                top = logits.topk(TOP_K)
                for token, q in zip(top.indices.tolist(), top.values.softmax(-1).tolist()):
                    longer[seq + (token,)] = p * q
            probs = longer
    return probs


GREEDY_PROMPTS = [torch.randint(3, TINY_VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
                  for n in (5, 17, 33)]
# min_tokens masks EOS (token 2): the oracle suppresses it too.
GREEDY = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)


def test_tensor_parallel_verification_is_transformers_greedy(tiny_model):
    """tp=2 (multi-process): TP rank 0 verifies the drafts and proposes, the other rank follows its tokens."""
    path, model = tiny_model
    with running_llm(path, dtype="float32", max_model_len=256, tensor_parallel_size=2,
                     speculative_config=tiny_speculative_config("ngram", None)) as llm:
        greedy = llm.generate([{"prompt_token_ids": p} for p in GREEDY_PROMPTS], GREEDY, use_tqdm=False)
        stats = llm.get_stats()
    assert_transformers_greedy(model, GREEDY_PROMPTS, [g.outputs[0].token_ids for g in greedy], 24, (2,))
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_a_draft_model_capped_by_max_model_len_drafts_within_it(tmp_path, tokenizer, tiny_model):
    """vLLM's speculative_config max_model_len: a draft of 32 positions serves a target of 256. Requests draft while
    all drafts fit below 32 tokens, then decode without (one prompt is longer from the start); the output is still
    the target's greedy one."""
    path, model = tiny_model
    save_tiny_llama(tmp_path, tokenizer, seed=1, num_layers=1, max_position_embeddings=32)
    config = {"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2, "max_model_len": 32}
    with running_llm(path, dtype="float32", max_model_len=256, speculative_config=config) as llm:
        greedy = llm.generate([{"prompt_token_ids": p} for p in GREEDY_PROMPTS], GREEDY, use_tqdm=False)
        stats = llm.get_stats()
    assert_transformers_greedy(model, GREEDY_PROMPTS, [g.outputs[0].token_ids for g in greedy], 24, (2,))
    assert stats.spec_decode_num_drafts > 0


@pytest.mark.parametrize("method", ["ngram", "draft_model", "suffix"])
def test_random_sampling_draws_the_models_distribution(tiny_model, tiny_draft, method):
    path, model = tiny_model
    prompt = torch.randint(0, TINY_VOCAB, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    expected = top_k_probabilities(model, prompt, 3)
    num_samples = 3000
    params = SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=3, ignore_eos=True)
    with running_llm(path, dtype="float32", max_model_len=256,
                     speculative_config=tiny_speculative_config(method, tiny_draft)) as llm:
        outputs = llm.generate([{"prompt_token_ids": prompt}] * num_samples, params, use_tqdm=False)
        stats = llm.get_stats()
        greedy = llm.generate([{"prompt_token_ids": p} for p in GREEDY_PROMPTS], GREEDY, use_tqdm=False)
    assert_transformers_greedy(model, GREEDY_PROMPTS, [g.outputs[0].token_ids for g in greedy], 24, (2,))
    # Every request verified drafts; many were accepted, many rejected.
    assert stats.spec_decode_num_drafts >= num_samples
    assert 0.05 < stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_draft_tokens < 0.95
    counts: dict[tuple[int, ...], int] = {}
    for out in outputs:
        seq = tuple(out.outputs[0].token_ids)
        counts[seq] = counts.get(seq, 0) + 1
    assert set(counts) <= set(expected), "a sequence outside the top-k paths"
    statistic = sum((counts.get(seq, 0) - p * num_samples) ** 2 / (p * num_samples) for seq, p in expected.items())
    p_value = torch.special.gammaincc(torch.tensor((len(expected) - 1) / 2, dtype=torch.float64),
                                      torch.tensor(statistic / 2, dtype=torch.float64)).item()
    assert p_value > 1e-3, (counts, expected)
