"""SpecDecodeBudget: how many of its draft tokens each request verifies in a step (dynamic speculation).

A draft token costs the step one more token of compute and is worth the chance that it is accepted. Both are
measured, not assumed:
- cost: the engine times its decode steps (every request computing its one known token and its drafts). Steps
  that verify drafts are fitted as ``t0 + c * tokens``, exponentially weighted so the fit follows the batch. With
  few rows a step is bound by reading the weights (t0 large, c small) and drafts are nearly free; with many rows
  it turns compute-bound and each token costs its share. Draft-free decode steps are timed apart: they may replay
  a CPU graph where a verify step runs eagerly, so no drafts at all can be much cheaper than the fit's t0 says.
- worth: per request, acceptance is modelled as independent per draft position with probability ``a`` (its
  accepted drafts over its verification trials, a trial ending at the first rejection, with a prior of one in
  two), so draft j (1-based) is worth ``a ** j`` expected tokens.
Draft tokens are taken in decreasing worth while each raises the step's expected tokens per second,
``(rows + accepted) / (t0 + c * tokens)``; then, for a step of decodes only, the whole set must beat a draft-free
step's rate ``rows / time`` or none is verified. Until the fit has seen steps of different sizes every draft is
kept. One decode step in _PROBE_INTERVAL does the other thing than the rule says, so that both timings (and the
acceptance record) stay current as the batch changes. While draft-free steps win, or the marginal rule keeps
none of the drafts proposed, the worker is told not to propose (``proposals_wanted``: proposing costs a step time
too), except for the step before a probe.
"""
from __future__ import annotations

import heapq
from typing import Optional

from pagedllm.core.request import Request

_DECAY = 0.95  # weight of the older steps in the fit, per step
_PRIOR_ACCEPTED, _PRIOR_TRIALS = 1.0, 2.0
_PROBE_INTERVAL = 32
_SAME_SIZE = 0.25  # without a slope, a mean step time stands for sizes within this fraction of its mean size


class StepTimes:
    """Exponentially weighted least-squares fit of one kind of step's time on its tokens."""

    def __init__(self) -> None:
        self._w = self._n = self._t = self._nn = self._nt = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        d = _DECAY
        self._w = d * self._w + 1.0
        self._n = d * self._n + num_tokens
        self._t = d * self._t + seconds
        self._nn = d * self._nn + num_tokens * num_tokens
        self._nt = d * self._nt + num_tokens * seconds

    def cost(self) -> Optional[tuple[float, float]]:
        """(t0, c) of the current fit, or None while the steps seen do not tell a slope."""
        variance = self._w * self._nn - self._n * self._n
        if self._w < 2 or variance <= 1e-9 * max(self._w * self._nn, 1.0):
            return None
        c = max((self._w * self._nt - self._n * self._t) / variance, 0.0)
        t0 = max((self._t - c * self._n) / self._w, 1e-6)
        return t0, c

    def time_at(self, num_tokens: int) -> Optional[float]:
        """A step of ``num_tokens``: by the fit, else the mean time of steps about that size, else None."""
        cost = self.cost()
        if cost is not None:
            return cost[0] + cost[1] * num_tokens
        if self._w > 0 and abs(self._n / self._w - num_tokens) <= _SAME_SIZE * num_tokens:
            return self._t / self._w
        return None


class SpecDecodeBudget:
    def __init__(self) -> None:
        self.verify_steps = StepTimes()  # decode steps that verified drafts
        self.plain_steps = StepTimes()  # draft-free decode steps
        self._steps_since_probe = 0
        # Whether the worker should propose drafts after the step being scheduled.
        self.proposals_wanted = True

    def observe_step(self, num_tokens: int, num_drafts: int, seconds: float) -> None:
        (self.verify_steps if num_drafts else self.plain_steps).observe(num_tokens, seconds)

    @staticmethod
    def record_verification(request: Request, num_drafts: int, num_accepted: int) -> None:
        request.spec_accepted += num_accepted
        request.spec_trials += num_accepted + (1 if num_accepted < num_drafts else 0)

    @staticmethod
    def acceptance(request: Request) -> float:
        return (request.spec_accepted + _PRIOR_ACCEPTED) / (request.spec_trials + _PRIOR_TRIALS)

    def trim_drafts(self, decodes: list[Request], only_decodes: bool = False) -> None:
        """Cuts each decoding request's spec_token_ids to the drafts this step should verify. ``only_decodes``:
        the step will hold these requests and nothing else (no prefill), so it could run draft-free."""
        if not only_decodes:  # a step with prefill runs eagerly: only the marginal rule below applies
            self.proposals_wanted = True
        cost = self.verify_steps.cost()
        if cost is None:
            return
        t0, c = cost
        rows = tokens = len(decodes)
        expected = 0.0
        keep = {id(r): 0 for r in decodes}
        # Candidates by worth: (-a ** j, index, j); each request's drafts come in order, as worth falls with j.
        heap = [(-self.acceptance(r), i, 1) for i, r in enumerate(decodes) if r.spec_token_ids]
        proposed = bool(heap)
        heapq.heapify(heap)
        while heap:
            negative_worth, i, j = heapq.heappop(heap)
            worth = -negative_worth
            # Worth its cost when the token's value per second of compute beats the step's current rate.
            if worth * (t0 + c * tokens) <= c * (rows + expected):
                break
            request = decodes[i]
            keep[id(request)] = j
            tokens += 1
            expected += worth
            if j < len(request.spec_token_ids):
                heapq.heappush(heap, (negative_worth * self.acceptance(request), i, j + 1))
        if only_decodes and not self._verify_now(rows, tokens, expected, t0 + c * tokens, proposed):
            keep = dict.fromkeys(keep, 0)
        for request in decodes:
            if keep[id(request)] < len(request.spec_token_ids):
                request.set_spec_token_ids(request.spec_token_ids[:keep[id(request)]])

    def _verify_now(self, rows: int, tokens: int, expected: float, verify_time: float, proposed: bool) -> bool:
        """Whether a decode-only step verifies the drafts it has (``tokens`` > ``rows``) rather than run
        draft-free: the rule's answer (a draft-free step not yet timed at this size counts as slower), the other
        one on a probe step. Sets proposals_wanted for the next step by the rule (not wanted either where drafts
        were ``proposed`` but the marginal rule kept none: a compute-bound batch), and for the step before a
        probe."""
        self._steps_since_probe += 1
        probe = self._steps_since_probe >= _PROBE_INTERVAL
        if probe:
            self._steps_since_probe = 0
        verify = False  # nothing proposed (or worth verifying): the step is draft-free whatever the rule
        if tokens > rows:
            plain_time = self.plain_steps.time_at(rows)
            self.proposals_wanted = plain_time is None or (rows + expected) / verify_time > rows / plain_time
            verify = self.proposals_wanted != probe
        elif proposed:
            self.proposals_wanted = False
        self.proposals_wanted |= self._steps_since_probe == _PROBE_INTERVAL - 1
        return verify
