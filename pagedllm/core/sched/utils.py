"""Stop conditions checked after each sampled token."""
from __future__ import annotations

from pagedllm.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Sets the request's finished status and returns True when its last token ends it.

    EOS (unless ignore_eos) and stop_token_ids, then length limits. Under min_tokens the sampler holds EOS and the
    stop tokens back, so one comes only where nothing else may (a grammar's end, sample/ops.apply_min_tokens), and
    then it ends the request, as in vLLM's check_stop.
    """
    params = request.sampling_params
    last_token_id = request.output_token_ids[-1]
    if not params.ignore_eos and last_token_id == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last_token_id in params.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last_token_id
        return True
    if request.num_tokens >= max_model_len or (
            request.max_tokens is not None and request.num_output_tokens >= request.max_tokens):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
