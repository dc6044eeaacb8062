"""Sampler tests: masks against per-row references, greedy, seeded reproducibility, distribution, logprobs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.sample.logprobs import LogprobsLists, compute_token_logprobs
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.ops import apply_min_p, apply_top_k_top_p
from pagedllm.sample.sampler import Sampler


def make_metadata(temperature, top_p=None, top_k=None, min_p=None, generators=None, max_num_logprobs=None,
                  min_tokens_mask=None, min_tokens_restorable=frozenset()) -> SamplingMetadata:
    """Build metadata the way a runner would: None for knobs no row uses."""
    greedy = [t == 0.0 for t in temperature]
    return SamplingMetadata(
        temperature=None if all(greedy) else torch.tensor(temperature, dtype=torch.float32),
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        top_k=None if top_k is None else torch.tensor(top_k, dtype=torch.int64),
        min_p=None if min_p is None else torch.tensor(min_p, dtype=torch.float32),
        generators=generators or {},
        max_num_logprobs=max_num_logprobs,
        min_tokens_mask=min_tokens_mask or {},
        min_tokens_restorable=min_tokens_restorable,
    )


# Straightforward per-row references, in float64 numpy.

def _softmax(row: np.ndarray) -> np.ndarray:
    e = np.exp(row - row[np.isfinite(row)].max())
    return e / e.sum()


def ref_top_k(row: np.ndarray, k: int) -> np.ndarray:
    if k == 0 or k >= len(row):
        return row.copy()
    threshold = np.sort(row)[::-1][k - 1]
    return np.where(row >= threshold, row, -np.inf)


def ref_top_p(row: np.ndarray, p: float) -> np.ndarray:
    probs = _softmax(row)
    order = np.argsort(-probs, kind="stable")
    mass_above = np.cumsum(probs[order]) - probs[order]
    keep = np.zeros(len(row), dtype=bool)
    keep[order[mass_above < p]] = True
    keep[order[0]] = True
    return np.where(keep, row, -np.inf)


def ref_min_p(row: np.ndarray, min_p: float) -> np.ndarray:
    probs = _softmax(row)
    return np.where(probs >= min_p * probs.max(), row, -np.inf)


def random_logits(batch: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def kept(logits: torch.Tensor) -> np.ndarray:
    return np.isfinite(np.asarray(logits, dtype=np.float64))


B, V = 64, 200


@pytest.mark.parametrize("seed", range(3))
def test_top_k_matches_reference(seed):
    logits = random_logits(B, V, seed)
    k = torch.randint(0, V + 5, (B,), generator=torch.Generator().manual_seed(seed))
    k[:4] = torch.tensor([0, 1, V, V + 3])
    out = apply_top_k_top_p(logits.clone(), k, None)
    ref = np.stack([ref_top_k(row, int(ki)) for row, ki in zip(logits.double().numpy(), k)])
    np.testing.assert_array_equal(kept(out), np.isfinite(ref))
    np.testing.assert_array_equal(out[kept(out)], logits[kept(out)])


@pytest.mark.parametrize("seed", range(3))
def test_top_p_matches_reference(seed):
    logits = random_logits(B, V, seed)
    p = torch.rand(B, generator=torch.Generator().manual_seed(seed)).clamp_(min=0.01)
    p[:3] = torch.tensor([1.0, 1e-6, 0.5])
    out = apply_top_k_top_p(logits.clone(), None, p)
    ref = np.stack([ref_top_p(row, float(pi)) for row, pi in zip(logits.double().numpy(), p)])
    np.testing.assert_array_equal(kept(out), np.isfinite(ref))
    assert kept(out).sum(axis=1).min() >= 1
    assert kept(out)[0].all()  # top_p 1 keeps everything


@pytest.mark.parametrize("seed", range(3))
def test_min_p_matches_reference(seed):
    logits = random_logits(B, V, seed)
    min_p = torch.rand(B, generator=torch.Generator().manual_seed(seed))
    min_p[:3] = torch.tensor([0.0, 1.0, 0.3])
    out = apply_min_p(logits.clone(), min_p)
    ref = np.stack([ref_min_p(row, float(m)) for row, m in zip(logits.double().numpy(), min_p)])
    np.testing.assert_array_equal(kept(out), np.isfinite(ref))
    assert kept(out)[0].all()  # min_p 0 keeps everything
    assert kept(out)[1].sum() == 1  # min_p 1 keeps only the top token


@pytest.mark.parametrize("seed", range(3))
def test_combined_masks_match_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = random_logits(B, V, seed)
    k = torch.randint(0, 50, (B,), generator=gen)
    p = torch.rand(B, generator=gen) * 0.9 + 0.1
    min_p = torch.rand(B, generator=gen) * 0.2
    out = apply_top_k_top_p(apply_min_p(logits.clone(), min_p), k, p)
    ref = np.stack([
        ref_top_p(ref_top_k(ref_min_p(row, float(mi)), int(ki)), float(pi))
        for row, ki, pi, mi in zip(logits.double().numpy(), k, p, min_p)
    ])
    np.testing.assert_array_equal(kept(out), np.isfinite(ref))


def test_min_p_comes_before_top_p():
    """vLLM V1's order: min-p (a logits processor) before the top-k/top-p sampler, whose top-p mass is then that
    of what min-p kept: [.5, .3, .1, .1] with min_p 0.3 keeps [.625, .375], of which top_p 0.6 keeps the first
    (top-p first would keep [.625, .375])."""
    logits = torch.tensor([[0.5, 0.3, 0.1, 0.1]]).log()
    probs = Sampler.final_logits(logits, make_metadata([1.0], top_p=[0.6], min_p=[0.3])).softmax(dim=-1)
    torch.testing.assert_close(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_all_greedy_is_argmax():
    logits = random_logits(B, V, 0)
    out = Sampler()(logits, make_metadata([0.0] * B))
    assert out.sampled_token_ids.dtype == torch.int64
    torch.testing.assert_close(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None


def test_mixed_batch_greedy_rows_are_argmax_and_input_untouched():
    logits = random_logits(B, V, 1)
    before = logits.clone()
    temperature = [0.0 if i % 2 else 0.9 for i in range(B)]
    meta = make_metadata(temperature, top_p=[0.8] * B, top_k=[5] * B, min_p=[0.1] * B)
    sampled = Sampler()(logits, meta).sampled_token_ids
    torch.testing.assert_close(sampled[1::2], logits.argmax(dim=-1)[1::2])
    # Random rows obey top-k 5.
    top5 = logits.topk(5, dim=-1).indices
    assert all(int(s) in top5[i].tolist() for i, s in enumerate(sampled))
    torch.testing.assert_close(logits, before)


def _seeded_tokens(row: int, batch: int, other_seed: int, default_seed: int, steps: int = 12) -> list[int]:
    """Sample a seeded request placed at `row` of a batch whose other rows vary with other_seed."""
    torch.manual_seed(default_seed)
    target = random_logits(1, V, 99)[0] / 3
    generator = torch.Generator().manual_seed(1234)
    others = random_logits(batch, V, other_seed)
    temperature = [0.0 if i % 3 == 0 else 0.7 + 0.1 * i for i in range(batch)]
    temperature[row] = 1.0
    top_k = [0] * batch
    top_k[(row + 1) % batch] = 4
    tokens = []
    for _ in range(steps):
        logits = others.clone()
        logits[row] = target
        meta = make_metadata(temperature, top_k=top_k, generators={row: generator})
        tokens.append(int(Sampler()(logits, meta).sampled_token_ids[row]))
    return tokens


def test_seeded_row_is_independent_of_batch_and_row_index():
    a = _seeded_tokens(row=1, batch=3, other_seed=0, default_seed=0)
    b = _seeded_tokens(row=0, batch=5, other_seed=1, default_seed=1)
    c = _seeded_tokens(row=6, batch=7, other_seed=2, default_seed=2)
    assert a == b == c
    assert len(set(a)) > 3  # it really samples


def test_unseeded_rows_differ_across_default_seeds():
    logits = random_logits(1, V, 5).expand(16, V) / 3
    meta = make_metadata([1.0] * 16)
    torch.manual_seed(0)
    first = Sampler()(logits, meta).sampled_token_ids
    torch.manual_seed(1)
    second = Sampler()(logits, meta).sampled_token_ids
    assert not torch.equal(first, second)


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    nonzero = expected > 0
    assert counts[~nonzero].sum() == 0
    return float(((counts[nonzero] - expected[nonzero]) ** 2 / expected[nonzero]).sum())


# Chi-square 0.999 quantiles, so a fixed seed is far from the edge unless the sampler is wrong.
_CHI2_999 = {3: 16.27, 7: 24.32}


def test_sampling_distribution_matches_softmax():
    torch.manual_seed(0)
    n, temperature = 20000, 0.8
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 1.5, -1.0, 0.2])
    meta = make_metadata([temperature] * n)
    sampled = Sampler()(logits.expand(n, -1), meta).sampled_token_ids
    counts = np.bincount(sampled.numpy(), minlength=len(logits))
    probs = torch.softmax(logits.double() / temperature, dim=-1).numpy()
    assert _chi_square(counts, probs) < _CHI2_999[7]


def test_sampling_distribution_with_top_k_top_p():
    torch.manual_seed(1)
    n = 20000
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 1.5, -1.0, 0.2])
    # top_k 5 keeps tokens 4, 5, 0, 1, 7; top_p 0.9 then drops token 7.
    meta = make_metadata([1.0] * n, top_k=[5] * n, top_p=[0.9] * n)
    sampled = Sampler()(logits.expand(n, -1), meta).sampled_token_ids
    counts = np.bincount(sampled.numpy(), minlength=len(logits))
    ref = ref_top_p(ref_top_k(logits.double().numpy(), 5), 0.9)
    probs = _softmax(ref)
    assert (probs > 0).sum() == 4
    assert _chi_square(counts, probs) < _CHI2_999[3]


def test_logprobs_are_raw_log_softmax_with_ranks():
    logits = random_logits(6, V, 3)
    k = 5
    meta = make_metadata([0.0, 0.5, 1.3, 0.0, 2.0, 0.7], top_k=[0, 3, 0, 0, 10, 2], max_num_logprobs=k)
    out = Sampler()(logits, meta)
    lp = out.logprobs
    ref = torch.log_softmax(logits.double(), dim=-1).float()
    sampled = out.sampled_token_ids
    assert lp.logprob_token_ids.shape == (6, k + 1) and lp.logprob_token_ids.dtype == torch.int64
    torch.testing.assert_close(lp.logprob_token_ids[:, 0], sampled)
    torch.testing.assert_close(lp.logprobs[:, 0], ref.gather(1, sampled.unsqueeze(1)).squeeze(1))
    top = ref.topk(k, dim=-1)
    torch.testing.assert_close(lp.logprob_token_ids[:, 1:], top.indices)
    torch.testing.assert_close(lp.logprobs[:, 1:], top.values)
    expected_ranks = [int((ref[i] > ref[i, s]).sum()) + 1 for i, s in enumerate(sampled.tolist())]
    assert lp.selected_token_ranks.tolist() == expected_ranks
    assert lp.selected_token_ranks[[0, 3]].tolist() == [1, 1]  # greedy rows take the top token


def test_logprob_token_ids_rows_report_those_ids():
    """vLLM's logprob_token_ids: a row that names token ids has their logprobs, in their order, where the top ones
    would be; the other rows keep their top k."""
    logits = random_logits(3, V, 4)
    meta = make_metadata([0.0, 0.8, 0.0], max_num_logprobs=3)
    meta.logprob_token_ids = {1: torch.tensor([V - 1, 0, 7])}
    lp = Sampler()(logits, meta).logprobs
    ref = torch.log_softmax(logits.double(), dim=-1).float()
    assert lp.logprob_token_ids[1, 1:].tolist() == [V - 1, 0, 7]
    torch.testing.assert_close(lp.logprobs[1, 1:], ref[1, [V - 1, 0, 7]])
    top = ref.topk(3, dim=-1)
    torch.testing.assert_close(lp.logprob_token_ids[[0, 2], 1:], top.indices[[0, 2]])


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_modes_report_the_logits_vllm_names(mode):
    """vLLM's logprobs_mode: raw_* the model's logits, processed_* those each row sampled from (temperature, min-p,
    top-k, top-p applied; a greedy row's are the processed logits, at temperature 1); *_logits the values
    themselves, *_logprobs their log-softmax. The ranks are the sampled token's in those values."""
    logits = random_logits(4, V, 5)
    k = 4
    meta = make_metadata([0.0, 0.5, 1.3, 2.0], top_k=[0, 3, 0, 10], top_p=[1.0, 1.0, 0.8, 1.0],
                         min_p=[0.0, 0.0, 0.0, 0.05], max_num_logprobs=k)
    out = Sampler(mode)(logits, meta)
    expected = logits if mode == "raw_logits" else Sampler.final_logits(logits, meta)
    if mode == "processed_logprobs":
        expected = torch.log_softmax(expected, dim=-1)
    sampled = out.sampled_token_ids
    lp = out.logprobs
    torch.testing.assert_close(lp.logprobs[:, 0], expected.gather(1, sampled.unsqueeze(1)).squeeze(1))
    torch.testing.assert_close(lp.logprobs[:, 1:], expected.topk(k, dim=-1).values)
    if mode != "raw_logits":
        assert torch.isneginf(lp.logprobs[1, -1]) and torch.isfinite(lp.logprobs[1, :-1]).all()  # its top 3 only
        assert torch.equal(Sampler.final_logits(logits, meta)[0], logits[0])  # the greedy row, as it came
    expected_ranks = [int((expected[i] >= expected[i, t]).sum()) for i, t in enumerate(sampled.tolist())]
    assert lp.selected_token_ranks.tolist() == expected_ranks
    # An all-greedy batch reports its processed logits (here as they came: no control is set).
    greedy = Sampler(mode)(logits, make_metadata([0.0] * 4, max_num_logprobs=0)).logprobs.logprobs[:, 0]
    expected = logits if mode.endswith("_logits") else torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(greedy, expected.max(dim=-1).values)


def test_compute_token_logprobs_for_given_tokens():
    logits = random_logits(4, V, 4)
    token_ids = torch.tensor([7, 0, V - 1, 42])
    lp = compute_token_logprobs(logits, token_ids, 0)
    assert lp.logprob_token_ids.shape == (4, 1)
    ref = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(lp.logprobs[:, 0], ref[torch.arange(4), token_ids])
    lists = lp.tolists()
    assert isinstance(lists, LogprobsLists)
    assert lists.logprob_token_ids == [[7], [0], [V - 1], [42]]
    assert all(isinstance(r, int) for r in lists.sampled_token_ranks)
    assert isinstance(lists.logprobs[0][0], float)


def test_min_tokens_mask_suppresses_stop_tokens():
    eos, stop = 3, 5
    logits = random_logits(4, V, 6)
    logits[:, eos] = 50.0
    logits[:, stop] = 40.0
    before = logits.clone()
    mask = {0: {eos, stop}, 2: {eos, stop}}
    greedy = Sampler()(logits, make_metadata([0.0] * 4, min_tokens_mask=mask, max_num_logprobs=0))
    assert greedy.sampled_token_ids.tolist()[1::2] == [eos, eos]
    assert greedy.sampled_token_ids[0] not in (eos, stop) and greedy.sampled_token_ids[2] not in (eos, stop)
    # Logprobs stay raw: the masked row's sample is ranked below the suppressed tokens.
    assert greedy.logprobs.selected_token_ranks.tolist() == [3, 1, 3, 1]
    torch.testing.assert_close(logits, before)

    # A row with nothing but its stop tokens left (a grammar that may only end) gets them back: it ends. (Rows no
    # grammar or allowed_token_ids constrains are not looked at: the mask alone never empties them.)
    only_stops = torch.full((2, V), float("-inf"))
    only_stops[:, eos], only_stops[:, stop] = 1.0, 2.0
    ended = Sampler().process_logits(only_stops, make_metadata(
        [0.0, 0.0], min_tokens_mask={0: {eos, stop}, 1: {eos, stop}}, min_tokens_restorable=frozenset({0})))
    assert ended[0].argmax().item() == stop and ended[0, eos] == 1.0
    assert torch.isneginf(ended[1]).all()

    torch.manual_seed(0)
    n = 2000
    many = logits[0].expand(n, -1)
    random = Sampler()(many, make_metadata([1.0] * n, min_tokens_mask={i: {eos, stop} for i in range(n)}))
    assert not torch.isin(random.sampled_token_ids, torch.tensor([eos, stop])).any()
