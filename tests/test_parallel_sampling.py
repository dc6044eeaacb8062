"""ParentRequest (engine/parallel_sampling.py): an n > 1 request's children gathered into one output."""
from __future__ import annotations

from pagedllm.engine.parallel_sampling import ParentRequest
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams


def _child_output(index: int, error=None) -> RequestOutput:
    completion = CompletionOutput(index=index, text=f"c{index}", token_ids=[index], finish_reason="stop")
    return RequestOutput(f"{index}_r", None, [1, 2], None, [completion], finished=True, error=error)


def test_final_only_output_keeps_an_earlier_childs_error():
    """Final-only, the gathered output is built on the last child's: an error only an earlier child carried (its
    grammar refused a token) must not be dropped, or the request would read as a success."""
    parent = ParentRequest("r", SamplingParams(n=3))
    assert parent.add_child_output(_child_output(0), final_only=True) is None
    assert parent.add_child_output(_child_output(1, error="grammar refused"), final_only=True) is None
    gathered = parent.add_child_output(_child_output(2), final_only=True)
    assert gathered.request_id == "r" and [c.text for c in gathered.outputs] == ["c0", "c1", "c2"]
    assert gathered.error == "grammar refused"
