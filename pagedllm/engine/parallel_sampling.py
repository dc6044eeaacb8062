"""ParentRequest: fans a request with n > 1 out into n independent child requests and gathers their outputs."""
from __future__ import annotations

from typing import Optional

import msgspec

from pagedllm.engine.protocol import EngineCoreRequest
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams


class ParentRequest:
    def __init__(self, request_id: str, params: SamplingParams, external_req_id: Optional[str] = None) -> None:
        """``external_req_id``: the caller's id, which the request's outputs carry (None: ``request_id`` is)."""
        self.request_id = request_id
        self.external_req_id = external_req_id or request_id
        self.params = params
        self.n = params.n
        self.child_ids = [f"{i}_{request_id}" for i in range(self.n)]
        self._completions: list[Optional[CompletionOutput]] = [None] * self.n
        self._error: Optional[str] = None  # the first error a child's output carried (a grammar's, say)
        self._num_finished = 0
        self._num_observed = 0  # sequences whose generated-token count the metrics have seen
        self._max_generation_tokens = 0

    def child_params(self, index: int) -> SamplingParams:
        """Each child samples one sequence; a seeded parent gives child i the seed seed + i."""
        seed = self.params.seed + index if self.params.seed is not None else None
        return msgspec.structs.replace(self.params, n=1, seed=seed)

    def observe_num_generation_tokens(self, num_tokens: int) -> Optional[int]:
        """A finished sequence's generated-token count; once all n have finished, the most of them (else None)."""
        self._num_observed += 1
        self._max_generation_tokens = max(self._max_generation_tokens, num_tokens)
        return self._max_generation_tokens if self._num_observed == self.n else None

    def add_child_output(self, child: RequestOutput, final_only: bool) -> Optional[RequestOutput]:
        """Streaming: pass each child's delta on under the caller's id. Final-only: wait for all n."""
        completion = child.outputs[0]
        if child.finished:
            self._num_finished += 1
        if not final_only:
            child.request_id = self.external_req_id
            child.finished = self._num_finished == self.n
            return child
        self._completions[completion.index] = completion
        self._error = self._error or child.error
        if self._num_finished < self.n:
            return None
        child.request_id = self.external_req_id
        child.outputs = list(self._completions)
        child.error = self._error  # an earlier child's, where the last one finished without
        return child


def fan_out(request: EngineCoreRequest) -> tuple[Optional[ParentRequest], list[EngineCoreRequest]]:
    """The engine requests behind one user request: itself, or (n > 1) its n children and their parent."""
    params = request.sampling_params
    if params.n == 1:
        return None, [request]
    parent = ParentRequest(request.request_id, params, request.external_req_id)
    return parent, [msgspec.structs.replace(request, request_id=child_id, sampling_params=parent.child_params(i))
                    for i, child_id in enumerate(parent.child_ids)]
