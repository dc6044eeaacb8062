"""Dynamic speculation: the step-cost fit recovers t0 + c * tokens, and drafts are kept while their expected
worth beats their cost: all of them for one well-accepted stream, none for a compute-bound batch of doubtful
ones, none where a draft-free step (a CPU graph's) outruns verifying them, but once in a while all the same."""
import pytest

from pagedllm.core.sched.spec_budget import _PROBE_INTERVAL, SpecDecodeBudget
from tests.core.helpers import make_request


def fitted(t0: float, c: float) -> SpecDecodeBudget:
    budget = SpecDecodeBudget()
    for n in (1, 5, 3, 8, 2, 40, 12):
        budget.observe_step(n, 1, t0 + c * n)
    return budget


def drafting(i: int, accepted: int, trials: int, num_drafts: int = 4):
    request = make_request(f"r{i}", [1, 2, 3])
    request.spec_accepted, request.spec_trials = accepted, trials
    request.set_spec_token_ids(list(range(10, 10 + num_drafts)))
    return request


def test_the_fit_recovers_the_step_cost_and_needs_steps_of_different_sizes():
    assert fitted(0.012, 0.002).verify_steps.cost() == pytest.approx((0.012, 0.002))
    same_size = SpecDecodeBudget()
    for _ in range(5):
        same_size.observe_step(4, 2, 0.02)
    assert same_size.verify_steps.cost() is None
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


def test_drafts_go_where_a_draft_free_step_is_faster_and_are_tried_again_now_and_then():
    """Eight streams, 80% acceptance: verifying their drafts takes 0.02 + 0.001 per token, a draft-free (graph)
    step of 8 rows 0.006 s: ~22 tokens in 0.037 s lose to 8 in 0.006 s."""
    budget = fitted(0.02, 0.001)
    for _ in range(3):
        budget.observe_step(8, 0, 0.006)
    kept = []
    for step in range(2 * _PROBE_INTERVAL):
        requests = [drafting(i, 80, 100) for i in range(8)]
        budget.trim_drafts(requests, only_decodes=True)
        kept.append(sum(len(r.spec_token_ids) for r in requests))
    # A probe every _PROBE_INTERVAL steps verifies what the marginal rule keeps: 3 drafts each (a = 81 / 102).
    assert kept == ([0] * (_PROBE_INTERVAL - 1) + [24]) * 2
    requests = [drafting(i, 80, 100) for i in range(8)]
    budget.trim_drafts(requests, only_decodes=False)  # a prefill in the step: it runs eagerly whatever happens
    assert [len(r.spec_token_ids) for r in requests] == [3] * 8


def test_drafts_stay_where_they_beat_a_draft_free_step_and_a_probe_times_one():
    """One stream bound by weight reads: 5 tokens in 0.013 s beat 1 in 0.010 s. Before any draft-free step was
    timed, the probe step is one."""
    budget = fitted(0.012, 0.0002)
    kept = []
    for step in range(_PROBE_INTERVAL + 1):
        request = drafting(0, 90, 100)
        budget.trim_drafts([request], only_decodes=True)
        kept.append(len(request.spec_token_ids))
        if not request.spec_token_ids:
            budget.observe_step(1, 0, 0.010)
    assert kept == [4] * (_PROBE_INTERVAL - 1) + [0, 4]


def test_while_draft_free_steps_win_the_worker_proposes_only_for_the_probes():
    budget = fitted(0.02, 0.001)
    for _ in range(3):
        budget.observe_step(8, 0, 0.006)
    requests = [drafting(i, 80, 100) for i in range(8)]
    budget.trim_drafts(requests, only_decodes=True)
    assert budget.proposals_wanted is False
    wanted, verified = [], []
    for step in range(2 * _PROBE_INTERVAL):
        # The worker proposed only when asked after the step before.
        requests = [drafting(i, 80, 100, num_drafts=4 if wanted and wanted[-1] else 0) for i in range(8)]
        budget.trim_drafts(requests, only_decodes=True)
        wanted.append(budget.proposals_wanted)
        verified.append(sum(len(r.spec_token_ids) for r in requests))
    assert wanted.count(True) == 2 and verified.count(24) == 2  # asked once a probe interval; the probe verifies
    assert [i for i, v in enumerate(verified) if v] == [i + 1 for i, w in enumerate(wanted) if w]
    budget.trim_drafts([drafting(0, 80, 100)], only_decodes=False)  # a prefill: the marginal rule, drafts wanted
    assert budget.proposals_wanted is True


def test_a_batch_whose_drafts_none_are_worth_stops_proposing_but_for_the_probes():
    """64 doubtful requests in a compute-bound step: the marginal rule keeps none of their drafts, so the worker
    is told not to propose (searching for drafts costs time too) until the step before a probe."""
    budget = fitted(0.02, 0.003)
    wanted = []
    for step in range(2 * _PROBE_INTERVAL):
        # The worker proposed only when asked after the step before (always before the first decision).
        propose = not wanted or wanted[-1]
        requests = [drafting(i, 1, 8, num_drafts=4 if propose else 0) for i in range(64)]
        budget.trim_drafts(requests, only_decodes=True)
        assert not any(r.spec_token_ids for r in requests)  # a = 0.2: never worth a token of this step
        wanted.append(budget.proposals_wanted)
    assert wanted.count(True) == 2  # asked once a probe interval
