"""Dynamic speculation: the step-cost fit recovers t0 + c * tokens, and drafts are kept while their expected
worth beats their cost: all of them for one well-accepted stream, none for a compute-bound batch of doubtful
ones."""
import pytest

from pagedllm.core.sched.spec_budget import SpecDecodeBudget
from tests.core.helpers import make_request


def fitted(t0: float, c: float) -> SpecDecodeBudget:
    budget = SpecDecodeBudget()
    for n in (1, 5, 3, 8, 2, 40, 12):
        budget.observe_step(n, t0 + c * n)
    return budget


def drafting(i: int, accepted: int, trials: int, num_drafts: int = 4):
    request = make_request(f"r{i}", [1, 2, 3])
    request.spec_accepted, request.spec_trials = accepted, trials
    request.set_spec_token_ids(list(range(10, 10 + num_drafts)))
    return request


def test_the_fit_recovers_the_step_cost_and_needs_steps_of_different_sizes():
    assert fitted(0.012, 0.002).step_cost() == pytest.approx((0.012, 0.002))
    same_size = SpecDecodeBudget()
    for _ in range(5):
        same_size.observe_step(4, 0.02)
    assert same_size.step_cost() is None
    request = drafting(0, 0, 50)
    same_size.trim_drafts([request])  # no fit: every draft kept
    assert len(request.spec_token_ids) == 4


def test_one_stream_bound_by_weight_reads_keeps_its_well_accepted_drafts():
    request = drafting(0, 30, 36)  # a = 31 / 38
    fitted(0.012, 0.002).trim_drafts([request])
    assert len(request.spec_token_ids) == 4 and request.num_tokens_with_spec == request.num_tokens + 4


def test_a_compute_bound_batch_verifies_only_drafts_worth_their_cost():
    requests = [drafting(i, 1, 8) for i in range(31)] + [drafting(31, 95, 100)]
    fitted(0.02, 0.003).trim_drafts(requests)
    assert [len(r.spec_token_ids) for r in requests[:31]] == [0] * 31  # a = 0.2: not worth a token
    # a = 96 / 102: drafts worth 0.94, 0.89, 0.83 pay for their token, the fourth (0.78) no longer does.
    assert requests[31].spec_token_ids == [10, 11, 12]


def test_a_verification_trial_ends_at_the_first_rejection():
    request = make_request("r", [1, 2])
    SpecDecodeBudget.record_verification(request, 4, 4)  # all accepted: 4 trials, 4 successes
    SpecDecodeBudget.record_verification(request, 4, 1)  # one accepted, then a rejection: 2 trials
    assert (request.spec_accepted, request.spec_trials) == (5, 6)
    assert SpecDecodeBudget.acceptance(request) == pytest.approx(6 / 8)
