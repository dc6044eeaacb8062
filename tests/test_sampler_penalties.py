"""Per-request logits controls (allowed_token_ids, bad_words, min_tokens, logit_bias, penalties) through the
persistent batch and the Sampler, against a per-request Python reference of vLLM's formulas."""
from __future__ import annotations

from collections import Counter

import msgspec
import numpy as np
import pytest
import torch

from pagedllm.sample.sampler import Sampler
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import CachedRequestState, InputBatch

V = 1000
EOS = 2
# Prompt and output tokens come from a few ids, so they repeat, and the controls' token ids hit them.
HISTORY_VOCAB = 40


def make_batch(requests: list[tuple[SamplingParams, list[int], list[int]]]) -> InputBatch:
    """An InputBatch holding (params, prompt, output) requests, as the model runner fills it."""
    batch = InputBatch(max_num_reqs=len(requests), max_model_len=128, max_num_blocks_per_req=1, vocab_size=V)
    for i, (params, prompt, output) in enumerate(requests):
        batch.add_request(CachedRequestState(f"req-{i}", list(prompt), params, EOS, ([],), len(prompt) + len(output),
                                             output_token_ids=list(output)))
    return batch


def reference(logits: np.ndarray, params: SamplingParams, prompt: list[int], output: list[int]) -> np.ndarray:
    """One request's logits after the controls, in vLLM V1's order, one token at a time in float32."""
    row = logits.astype(np.float32).copy()
    if params.allowed_token_ids:
        allowed = np.zeros(V, dtype=bool)
        allowed[params.allowed_token_ids] = True
        row[~allowed] = -np.inf
    for word in params.bad_words_token_ids or []:
        prefix = word[:-1]
        if len(prefix) <= len(output) and output[len(output) - len(prefix):] == prefix:
            row[word[-1]] = -np.inf
    if len(output) < params.min_tokens:
        for token in [EOS, *params.stop_token_ids]:
            row[token] = -np.inf
    for token, bias in (params.logit_bias or {}).items():
        row[token] = row[token] + np.float32(bias)
    rp = np.float32(params.repetition_penalty)
    for token in set(prompt) | set(output):
        row[token] = row[token] / rp if row[token] > 0 else row[token] * rp
    for token, count in Counter(output).items():
        row[token] -= np.float32(params.frequency_penalty) * np.float32(count)
    for token in set(output):
        row[token] -= np.float32(params.presence_penalty)
    return row


def random_requests(seed: int, n: int) -> list[tuple[SamplingParams, list[int], list[int]]]:
    """Requests that each use a random subset of the controls (some use none), with random histories."""
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(n):
        prompt = rng.integers(0, HISTORY_VOCAB, rng.integers(1, 30)).tolist()
        output = rng.integers(0, HISTORY_VOCAB, rng.integers(0, 20)).tolist()
        kwargs = {}
        if i % 4 != 0:  # every fourth request uses no control at all
            use = rng.random(6) < 0.5
            if use[0]:
                kwargs["repetition_penalty"] = float(rng.uniform(0.5, 2.0))
            if use[1]:
                kwargs["frequency_penalty"] = float(rng.uniform(-2, 2))
            if use[2]:
                kwargs["presence_penalty"] = float(rng.uniform(-2, 2))
            if use[3]:
                kwargs["allowed_token_ids"] = rng.choice(2 * HISTORY_VOCAB, 30, replace=False).tolist()
            if use[4]:
                kwargs["logit_bias"] = {int(t): float(rng.uniform(-10, 10))
                                        for t in rng.integers(0, HISTORY_VOCAB, 8)}
            if use[5]:
                kwargs["min_tokens"] = 30
                kwargs["stop_token_ids"] = [int(rng.integers(0, V))]
                # A single token, one that completes the output's last two tokens, and one that does not.
                tail = output[-2:] if len(output) >= 2 else [1, 2]
                kwargs["_bad_words_token_ids"] = [[int(rng.integers(0, HISTORY_VOCAB))], [*tail, 7], [999, 998, 9]]
        requests.append((SamplingParams(temperature=0, max_tokens=50, **kwargs), prompt, output))
    return requests


@pytest.mark.parametrize("seed", range(4))
def test_batched_controls_match_per_request_reference(seed):
    requests = random_requests(seed, 10)
    batch = make_batch(requests)
    for req_id in ("req-2", "req-5"):  # rows moving into the holes must carry their settings along
        batch.remove_request(req_id)
    kept = [requests[int(req_id.removeprefix("req-"))] for req_id in batch.req_ids]  # by batch row
    rows = np.random.default_rng(seed).permutation(len(kept))[:6]  # a subset, in a shuffled order
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(seed)) * 3
    before = logits.clone()
    metadata = batch.make_sampling_metadata(rows)
    sampler = Sampler()

    processed = sampler.process_logits(logits, metadata)
    expected = torch.from_numpy(np.stack([reference(logits[j].numpy(), *kept[row]) for j, row in enumerate(rows)]))
    assert torch.equal(processed, expected)
    assert torch.equal(logits, before)  # the raw logits (for logprobs) are left alone
    greedy = sampler(logits, metadata).sampled_token_ids
    assert torch.equal(greedy, expected.argmax(dim=-1))
    free = [j for j, row in enumerate(rows) if kept[row][0] == SamplingParams(temperature=0, max_tokens=50)]
    assert free and torch.equal(processed[free], logits[free])


def test_batch_without_controls_is_not_copied():
    requests = [(SamplingParams(temperature=0), [5, 6], [7]), (SamplingParams(temperature=0.7), [8], [])]
    logits = torch.randn(2, V)
    metadata = make_batch(requests).make_sampling_metadata(np.arange(2))
    assert Sampler().process_logits(logits, metadata) is logits


def test_penalties_change_only_the_rows_that_use_them():
    prompt, output = [10, 11, 12], [12, 13, 13]
    logits = torch.full((2, V), 1.0)
    requests = [(SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
                 prompt, output), (SamplingParams(temperature=0), prompt, output)]
    processed = Sampler().process_logits(logits, make_batch(requests).make_sampling_metadata(np.arange(2)))
    assert processed[0, [10, 11, 12, 13, 14]].tolist() == [0.5, 0.5, 0.5 - 0.5 - 0.25, 0.5 - 1.0 - 0.25, 1.0]
    assert torch.equal(processed[1], logits[1])


def test_bad_words_single_and_multi_token():
    logits = torch.zeros(1, V)
    bad_words = [[7], [5, 6, 8], [6, 9], [1, 2, 3], [4, 5, 6, 10]]
    params = SamplingParams(temperature=0, _bad_words_token_ids=bad_words)
    # Prompt tokens do not count as a bad word's beginning: only the generated tokens do, as in vLLM.
    for prompt, output, banned in [([1, 2], [5, 6], {7, 8, 9}), ([5, 6], [1, 2], {3, 7}), ([1], [], {7}),
                                   ([4], [5, 6], {7, 8, 9})]:
        processed = Sampler().process_logits(logits, make_batch([(params, prompt, output)]).make_sampling_metadata(
            np.arange(1)))
        assert set(torch.nonzero(processed[0] == float("-inf")).flatten().tolist()) == banned


def test_allowed_token_ids_are_the_only_ones_sampled():
    n = 500
    allowed = [3, 17, 256, 999]
    requests = [(SamplingParams(temperature=1.0, allowed_token_ids=allowed), [1], [])] * n
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(0)).expand(n, V)
    metadata = make_batch(requests).make_sampling_metadata(np.arange(n))
    torch.manual_seed(0)
    sampled = Sampler()(logits, metadata).sampled_token_ids
    assert set(sampled.tolist()) == set(allowed)  # only allowed ones, and all of them get drawn


def test_logit_bias_forces_a_token_greedy_and_random():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1)) * 3
    forced = int(logits[0].argmin())
    requests = [(SamplingParams(temperature=t, logit_bias={str(forced): 100}), [1], []) for t in (0.0, 1.0)]
    metadata = make_batch(requests).make_sampling_metadata(np.arange(2))
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [forced, forced]


@pytest.mark.parametrize("kwargs, field", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"bad_words": [1]}, "bad_words"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kwargs)


def test_logit_bias_keys_become_ints_clamped_and_survive_the_wire():
    params = SamplingParams(logit_bias={"5": 300, 6: -250.5, "7": 1.5}, _bad_words_token_ids=[[1, 2]])
    assert params.logit_bias == {5: 100.0, 6: -100.0, 7: 1.5}
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded.logit_bias == params.logit_bias and decoded.bad_words_token_ids == [[1, 2]]


def test_a_bad_word_of_no_tokens_is_refused_not_dropped():
    """As vLLM's update_from_tokenizer: a bad word the tokenizer makes nothing of (a normalizer drops it) would ban
    nothing, so the Processor refuses it, naming bad_words, rather than drop it silently."""
    from types import SimpleNamespace

    from pagedllm.engine.processor import Processor

    class DroppingTokenizer:
        """Each character is a token, but for "~", which its normalizer drops."""
        eos_token_id = EOS

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [ord(c) for c in text if c != "~"]

    model_config = SimpleNamespace(path="/nonexistent", generation_config="auto", hf_config=SimpleNamespace(),
                                   vocab_size=V)
    processor = Processor(model_config, DroppingTokenizer())
    kept = processor.process_sampling_controls(SamplingParams(bad_words=["ab"]))
    assert kept.bad_words_token_ids == [[97, 98], [32, 97, 98]]
    with pytest.raises(ValueError, match="^bad_words entries must tokenize to at least one token.$"):
        processor.process_sampling_controls(SamplingParams(bad_words=["ab", "~~"]))
    # A whitespace-only word is refused as vLLM refuses it: stripped, it tokenizes to nothing; an empty one by
    # SamplingParams, in vLLM's words.
    with pytest.raises(ValueError, match="^bad_words entries must tokenize to at least one token.$"):
        processor.process_sampling_controls(SamplingParams(bad_words=["ab", "  "]))
    with pytest.raises(ValueError, match=r"^bad_words cannot contain an empty string. Got bad_words=\['ab', ''\]$"):
        SamplingParams(bad_words=["ab", ""])
