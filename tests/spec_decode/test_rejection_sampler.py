"""RejectionSampler: greedy verification is greedy decoding; random verification draws from the target's
distribution (a chi-square test that a deliberately broken rule fails); seeded requests are reproducible."""
import pytest
import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler
from pagedllm.sample.sampler import Sampler

V = 6


def metadata(num_rows: int, temperature: float, generators=None, max_num_logprobs=None) -> SamplingMetadata:
    greedy = temperature == 0.0
    return SamplingMetadata(temperature=None if greedy else torch.full((num_rows,), temperature),
                            all_greedy=greedy, all_random=not greedy, top_p=None, top_k=None, min_p=None,
                            generators=generators or {}, max_num_logprobs=max_num_logprobs, min_tokens_mask={})


def one_hot_logits(tokens: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(tokens), V)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def test_greedy_accepts_while_drafts_are_the_argmax_then_emits_the_argmax():
    # Request 0: argmaxes 1 2 3 (+ bonus 4); drafts 1 2 5 -> 1 2 then 3. Request 1: all accepted -> bonus.
    # Request 2: no drafts -> the argmax. Request 3: first draft wrong.
    drafts = [[1, 2, 5], [0, 0], [], [4]]
    logits = one_hot_logits([1, 2, 3, 4] + [0, 0, 5] + [2] + [3, 1])
    out = RejectionSampler(Sampler())(logits, metadata(len(logits), 0.0, max_num_logprobs=1), drafts)
    p = PLACEHOLDER_TOKEN_ID
    assert out.sampled_token_ids.tolist() == [[1, 2, 3, p], [0, 0, 5, p], [2, p, p, p], [3, p, p, p]]
    # One logprobs row per emitted token, in order: 3 + 3 + 1 + 1.
    assert out.logprobs.logprob_token_ids[:, 0].tolist() == [1, 2, 3, 0, 0, 5, 2, 3]


def test_logprob_token_ids_are_reported_for_each_emitted_token_of_the_request_that_names_them():
    """vLLM's logprob_token_ids with drafts: every token a request emits (accepted drafts and the final one) reports
    the ids its rows name, in place of the top ones; the other requests' tokens keep their top k."""
    drafts = [[1, 2, 5], [0, 0], [], [4]]
    logits = one_hot_logits([1, 2, 3, 4] + [0, 0, 5] + [2] + [3, 1])
    meta = metadata(len(logits), 0.0, max_num_logprobs=2)
    meta.logprob_token_ids = {row: torch.tensor([3, 4]) for row in (4, 5, 6)}  # request 1's rows
    lp = RejectionSampler(Sampler())(logits, meta, drafts).logprobs
    # emitted: request 0's rows 0-2, request 1's rows 4-6, request 2's row 7, request 3's row 8
    assert lp.logprob_token_ids[3:6, 1:].tolist() == [[3, 4]] * 3
    torch.testing.assert_close(lp.logprobs[3:6, 1:], torch.log_softmax(logits, -1)[4:7][:, [3, 4]])
    assert lp.logprob_token_ids[[0, 1, 2, 6, 7], 1].tolist() == [1, 2, 3, 2, 3]  # the top token


def test_logprobs_follow_the_samplers_logprobs_mode():
    """Each emitted token's logprobs are of the logits the Sampler's logprobs_mode names: raw by default, those it was
    sampled from (here at temperature 0.5) in a processed mode."""
    drafts = [[1, 2], [3]]
    logits = one_hot_logits([1, 2, 4] + [3, 5])

    def verify(mode: str):  # every row seeded alike, so both modes draw the same tokens
        generators = {row: torch.Generator().manual_seed(row) for row in range(len(logits))}
        return RejectionSampler(Sampler(mode))(logits, metadata(len(logits), 0.5, generators, 0), drafts)

    raw, processed = verify("raw_logprobs"), verify("processed_logits")
    assert torch.equal(processed.sampled_token_ids, raw.sampled_token_ids)
    rows = torch.tensor([0, 1, 2, 3, 4])  # with these seeds every draft is accepted: each row emits a token
    assert raw.sampled_token_ids.tolist() == [[1, 2, 4], [3, 5, PLACEHOLDER_TOKEN_ID]]
    emitted = raw.logprobs.logprob_token_ids[:, 0]
    torch.testing.assert_close(raw.logprobs.logprobs[:, 0], torch.log_softmax(logits, -1)[rows, emitted])
    torch.testing.assert_close(processed.logprobs.logprobs[:, 0], (logits / 0.5)[rows, emitted])


P0 = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])  # the target's distribution at the first position
P1 = torch.tensor([0.40, 0.05, 0.05, 0.20, 0.10, 0.20])  # ... after the first draft token


def draw(sampler: RejectionSampler, num: int, draft: int) -> torch.Tensor:
    """``num`` requests, each with drafts [draft, draft] against P0 then P1 (then a bonus row, P0)."""
    logits = torch.stack([P0.log(), P1.log(), P0.log()]).repeat(num, 1)
    return sampler(logits, metadata(len(logits), 1.0), [[draft, draft]] * num).sampled_token_ids


def chi_square_p(samples: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's goodness-of-fit p-value: the chi-square survival function, Q(df / 2, statistic / 2)."""
    counts = torch.bincount(samples, minlength=V).double()
    expected_counts = expected.double() * counts.sum()
    statistic = ((counts - expected_counts) ** 2 / expected_counts).sum()
    return torch.special.gammaincc(torch.tensor((V - 1) / 2, dtype=torch.float64), statistic / 2).item()


@pytest.mark.parametrize("draft", [1, 5])  # a likely and an unlikely draft token
def test_random_verification_draws_the_target_distribution(draft):
    torch.manual_seed(0)
    sampled = draw(RejectionSampler(Sampler()), 20000, draft)
    assert chi_square_p(sampled[:, 0], P0) > 1e-3
    # The second token, where the first draft was accepted: distributed as P1.
    assert chi_square_p(sampled[sampled[:, 0] == draft, 1], P1) > 1e-3
    assert (sampled[:, 0] == draft).float().mean().item() == pytest.approx(P0[draft].item(), abs=0.02)


class KeepsTheRejectedDraft(RejectionSampler):
    """A broken rule: after a rejection it samples the full p again, the rejected draft included."""

    @staticmethod
    def _sample_after_rejection(probs, rows, rejected, *args):
        return RejectionSampler._sample_after_rejection(probs, rows, torch.full_like(rejected, -1), *args)


def test_the_chi_square_test_catches_a_broken_acceptance_rule():
    torch.manual_seed(0)
    sampled = draw(KeepsTheRejectedDraft(Sampler()), 20000, 1)
    assert chi_square_p(sampled[:, 0], P0) < 1e-6


def test_seeded_requests_get_the_same_tokens_whatever_else_is_in_the_batch():
    def seeded(extra_rows: int) -> list[int]:
        generator = torch.Generator().manual_seed(7)
        logits = torch.stack([P0.log(), P1.log(), P0.log()] + [P1.log()] * extra_rows)
        drafts = [[1, 3]] + [[]] * extra_rows
        return RejectionSampler(Sampler())(logits, metadata(len(logits), 1.0, {0: generator, 1: generator, 2: generator}),
                                           drafts).sampled_token_ids[0].tolist()

    runs = [seeded(extra) for extra in (0, 3, 0, 5)]
    assert runs[0] == runs[1] == runs[2] == runs[3]
