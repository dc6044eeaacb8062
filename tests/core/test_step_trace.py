"""The step trace (PAGEDLLM_STEP_TRACE) classifies each step's work as the scheduler planned it."""
import json

from pagedllm.engine.step_trace import StepTrace
from tests.core.helpers import abort, make_request, make_scheduler, step


def test_trace_lines_split_prompt_chunks_from_decodes(tmp_path, monkeypatch):
    path = tmp_path / "steps.jsonl"
    assert StepTrace.from_env() is None  # off unless asked for
    monkeypatch.setenv("PAGEDLLM_STEP_TRACE", str(path))
    trace = StepTrace.from_env()
    assert StepTrace.from_env(data_parallel_rank=1)._file.name == f"{path}.1"
    scheduler = make_scheduler(max_num_batched_tokens=40)
    scheduler.add_request(make_request("a", list(range(100, 130)), max_tokens=4))
    out, _ = step(scheduler)  # a's prompt (30)
    trace.record(out, 1.0, 1.001, 1.021, 1.022)
    scheduler.add_request(make_request("b", list(range(200, 260)), max_tokens=4))
    out, _ = step(scheduler)  # a decodes beside b's first chunk (39 of 60)
    trace.record(out, 1.030, 1.031, 1.061, 1.062)
    first, second = [json.loads(line) for line in path.read_text().splitlines()]
    assert (first["reqs"], first["tokens"], first["prefill_tokens"], first["prefill_reqs"], first["decode_reqs"]) \
        == (1, 30, 30, 1, 0)
    assert (second["tokens"], second["prefill_tokens"], second["prefill_reqs"], second["decode_reqs"]) == (40, 39, 1, 1)
    assert first["gap"] == 0 and abs(second["gap"] - 8.0) < 1e-6  # 1.030 - 1.022 s
    assert abs(second["schedule"] - 1.0) < 1e-6 and abs(second["execute"] - 30.0) < 1e-6
    assert abs(second["update"] - 1.0) < 1e-6
    abort(scheduler, "a", "b")
