"""The scheduler with structured-output requests: a compiling grammar never holds up other requests, each step's
bitmask covers exactly the constrained requests that sample, and the grammar ends on one of the request's stop
tokens."""
from __future__ import annotations

import re
import threading
from typing import Optional

import msgspec
import pytest
import torch

from pagedllm.config import StructuredOutputsConfig
from pagedllm.core.request import RequestStatus
from pagedllm.engine.protocol import FinishReason
from pagedllm.models.hf_config import load_tokenizer
from pagedllm.models.resolve import DEFAULT_MODEL, resolve_model
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.structured_output.params import StructuredOutputsParams
from tests.core.helpers import fake_model_output, make_request, make_scheduler

EOS = 2  # the default model's <|im_end|>, which its grammars accept as the end
YES = 10407  # the default model's "yes"
OPEN_BRACE, NEWLINE = 107, 198  # the default model's "{" and "\n"


class GatedManager(StructuredOutputManager):
    """Compiles only once the test opens the gate, or fails with ``error``."""

    def __init__(self, error: Optional[Exception] = None, disable_any_whitespace: bool = True) -> None:
        tokenizer = load_tokenizer(resolve_model(DEFAULT_MODEL))
        super().__init__(lambda: tokenizer, 49152, max_num_seqs=8, disable_any_whitespace=disable_any_whitespace)
        self.gate = threading.Event()
        original = self._get_backend

        def gated_backend():
            self.gate.wait(timeout=30)
            if error is not None:
                raise error
            return original()
        self._get_backend = gated_backend


def allowed_tokens(bitmask_row: torch.Tensor) -> list[int]:
    bits = ((bitmask_row.unsqueeze(-1) >> torch.arange(32)) & 1).flatten()
    return torch.nonzero(bits).flatten().tolist()


def constrained_request(req_id: str, sampling: Optional[dict] = None, **so):
    request = make_request(req_id, [5, 6, 7], **{"max_tokens": 64, **(sampling or {})},
                           structured_outputs=StructuredOutputsParams(**so))
    request.eos_token_id = EOS
    return request


def run_to_the_end(request, pick) -> list:
    """Runs ``request`` alone until it finishes; each step the fake model samples ``pick(allowed)`` (allowed: the
    tokens the step's bitmask allows, None where no bitmask constrains the request). Returns its outputs."""
    manager = GatedManager()
    manager.gate.set()
    scheduler = make_scheduler(structured_output_manager=manager)
    scheduler.add_request(request)
    manager.wait_for_any([request], timeout=30)
    outputs = []
    for _ in range(30):
        if not scheduler.get_num_unfinished_requests():
            return outputs
        out = scheduler.schedule()
        row = out.structured_output_request_ids.get(request.request_id)
        token = pick(None if row is None else allowed_tokens(out.grammar_bitmask[row]))
        outputs += scheduler.update_from_output(out, fake_model_output(scheduler, out, lambda *_: token)).outputs
    raise AssertionError("the request did not finish")


def test_compiling_grammar_does_not_block_others_then_constrains_its_request():
    manager = GatedManager()
    scheduler = make_scheduler(structured_output_manager=manager)
    scheduler.add_request(constrained_request("json", choice=["yes", "no"]))
    scheduler.add_request(make_request("free", [1, 2, 3], max_tokens=4))

    out = scheduler.schedule()
    assert list(out.num_scheduled_tokens) == ["free"]
    assert out.grammar_bitmask is None
    assert scheduler.requests["json"].status == RequestStatus.WAITING_FOR_FSM
    # vLLM's waiting by reason: a request whose grammar compiles is deferred, not waiting for the step's capacity
    assert (scheduler.make_stats().num_waiting_reqs, scheduler.make_stats().num_skipped_waiting_reqs) == (0, 1)
    scheduler.update_from_output(out, fake_model_output(scheduler, out))

    manager.gate.set()
    manager.wait_for_any([scheduler.requests["json"]], timeout=30)
    texts = []
    tokenizer = load_tokenizer(resolve_model(DEFAULT_MODEL))
    for _ in range(30):
        if not scheduler.get_num_unfinished_requests():
            break
        out = scheduler.schedule()
        if "json" in out.num_scheduled_tokens:
            assert set(out.structured_output_request_ids) == {"json"}
            allowed = allowed_tokens(out.grammar_bitmask[out.structured_output_request_ids["json"]])
            assert 0 < len(allowed) < 49152
            # The fake model picks the longest allowed piece (EOS once nothing else is allowed).
            token = max(allowed, key=lambda t: len(tokenizer.decode([t])) if t != EOS else -1)
            texts.append(token)
            runner_output = fake_model_output(scheduler, out, lambda req_id, pos: token)
        else:
            runner_output = fake_model_output(scheduler, out)
        scheduler.update_from_output(out, runner_output)
    assert "json" not in scheduler.requests, "the request did not end with its grammar"
    assert tokenizer.decode([t for t in texts if t != EOS]) in ("yes", "no")
    assert texts[-1] == EOS


def test_a_finished_grammar_may_end_on_any_of_the_requests_stop_tokens():
    """As vLLM's grammars (their stop tokens are all_stop_token_ids): EOS, the generation config's other end tokens
    and stop_token_ids; the one sampled stops the request, a stop token with its stop_reason."""
    seen = []

    def pick(allowed):
        seen.append(allowed)
        return YES if len(seen) == 1 else 7

    request = constrained_request("r", {"stop_token_ids": [7], "_extra_eos_token_ids": [3]}, choice=["yes"])
    outputs = run_to_the_end(request, pick)
    assert YES in seen[0] and sorted(seen[1]) == [EOS, 3, 7]
    last = outputs[-1]
    assert (last.new_token_ids, last.finish_reason, last.stop_reason) == ([7], FinishReason.STOP, 7)


def test_a_grammar_ended_on_an_ignored_eos_leaves_the_rest_free():
    """ignore_eos: the grammar still ends on EOS (its only way to end), which stops nothing; vLLM then lets the
    request generate on, unconstrained, to max_tokens."""
    seen = []

    def pick(allowed):
        seen.append(allowed)
        return {1: YES, 2: EOS}.get(len(seen), 1000 + len(seen))

    outputs = run_to_the_end(constrained_request("r", {"ignore_eos": True, "max_tokens": 5}, choice=["yes"]), pick)
    assert seen[1] == [EOS] and seen[2:] == [None, None, None]
    assert [t for o in outputs for t in o.new_token_ids] == [YES, EOS, 1003, 1004, 1005]
    assert outputs[-1].finish_reason == FinishReason.LENGTH


@pytest.mark.parametrize("error, message", [
    (ValueError("structured_outputs.regex is invalid: test failure"),
     "structured_outputs.regex is invalid: test failure"),
    # not the spec's fault (here the tokenizer's files went missing): still that request's end, not the engine's
    (OSError("tokenizer.json not found"),
     "The structured_outputs grammar could not be built: OSError: tokenizer.json not found"),
])
def test_failed_compile_finishes_the_request_with_its_error(error, message):
    manager = GatedManager(error)
    scheduler = make_scheduler(structured_output_manager=manager)
    scheduler.add_request(constrained_request("bad", regex="a+"))
    manager.gate.set()
    manager.wait_for_any([scheduler.requests["bad"]], timeout=30)
    out = scheduler.schedule()
    assert out.total_num_scheduled_tokens == 0
    outputs = scheduler.update_from_output(out, fake_model_output(scheduler, out)).outputs
    assert [(o.request_id, o.error) for o in outputs] == [("bad", message)]


def test_abort_while_compiling_leaves_nothing_behind():
    manager = GatedManager()
    scheduler = make_scheduler(structured_output_manager=manager)
    scheduler.add_request(constrained_request("a", regex="[0-9]+"))
    scheduler.schedule()
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    manager.gate.set()
    assert not scheduler.requests and not len(scheduler.waiting)
    assert scheduler.make_stats().num_skipped_waiting_reqs == 0


def test_engine_without_structured_output_rejects_such_requests():
    scheduler = make_scheduler()
    scheduler.add_request(constrained_request("x", regex="a"))
    out = scheduler.schedule()
    outputs = scheduler.update_from_output(out, fake_model_output(scheduler, out)).outputs
    assert outputs[0].request_id == "x" and "not enabled" in outputs[0].error


@pytest.mark.parametrize("kwargs, message", [({}, "exactly one"), ({"regex": "a", "choice": ["b"]}, "exactly one"),
                                              ({"choice": []}, "choice")])
def test_params_need_exactly_one_constraint(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"choice": "yes"}, "choice must be a non-empty list"),
    ({"json": True}, "json must be a JSON schema"),
    ({"json": {1: {"type": "string"}}}, "json must be a JSON schema"),
    ({"regex": 5}, "regex must be a string"),
    ({"regex": "a", "whitespace_pattern": 1}, "whitespace_pattern must be a string"),
    ({"json_object": "maybe"}, "json_object must be a boolean"),
    ({"regex": "a", "disable_any_whitespace": 2}, "disable_any_whitespace must be a boolean"),
    ({"choice": ["a", 1]}, "choice must be a non-empty list of strings"),
])
def test_params_of_the_wrong_type_are_refused_before_they_reach_the_engine(kwargs, message):
    """The engine process decodes a request strictly typed, and one it cannot decode ends the engine: what it would
    not take is a ValueError naming the field here (vLLM's pydantic gives a 400)."""
    with pytest.raises(ValueError, match=f"structured_outputs.{message}"):
        StructuredOutputsParams(**kwargs)


def test_an_empty_choice_is_an_empty_output():
    """As vLLM's choice [""]: the grammar is done before any token, so only a stop token may come."""
    seen = []
    outputs = run_to_the_end(constrained_request("r", choice=[""]), lambda allowed: seen.append(allowed) or EOS)
    assert seen == [[EOS]] and outputs[-1].finish_reason == FinishReason.STOP


@pytest.mark.parametrize("engine_default, requested, any_whitespace", [
    (True, None, False), (False, None, True), (False, True, False), (True, False, True)])
def test_a_request_that_does_not_set_disable_any_whitespace_gets_the_engines(engine_default, requested,
                                                                             any_whitespace):
    """structured_outputs_config's disable_any_whitespace (vLLM's) is the default; a request's own value wins."""
    manager = GatedManager(disable_any_whitespace=engine_default)
    manager.gate.set()
    request = constrained_request("r", json_object=True, disable_any_whitespace=requested)
    manager.grammar_init(request)
    manager.wait_for_any([request], timeout=30)
    assert request.structured_output_request.is_ready() and request.structured_output_request.grammar.accept_token(
        OPEN_BRACE)
    assert (NEWLINE in allowed_tokens(manager.grammar_bitmask([request])[0])) == any_whitespace


@pytest.mark.parametrize("values, message", [
    ({"backend": "guidance"}, "backend must be one of auto, xgrammar"),
    ({"disable_any_whitespace": "yes"}, "disable_any_whitespace must be True or False"),
    ({"disable_additional_properties": True}, "disable_additional_properties=True is not supported"),
    ({"reasoning_parser": "qwen3"}, "reasoning_parser='qwen3' is not supported (give the server --reasoning-parser)"),
    ({"enable_in_reasoning": True}, "enable_in_reasoning=True is not supported"),
    ({"backnd": "xgrammar"}, "has unknown keys ['backnd']"),
])
def test_structured_outputs_config_refuses_what_this_engine_does_not_do(values, message):
    with pytest.raises(ValueError, match=f"^structured_outputs_config {re.escape(message)}"):
        StructuredOutputsConfig.from_dict(values)


def test_booleans_are_read_as_vllms_pydantic_reads_them():
    params = StructuredOutputsParams(json_object="true", disable_any_whitespace="no",
                                     disable_additional_properties=1.0)
    assert (params.json_object, params.disable_any_whitespace, params.disable_additional_properties) == (
        True, False, True)


def test_params_python_reads_alike_are_taken_in_the_types_the_engine_decodes():
    params = SamplingParams(structured_outputs=StructuredOutputsParams(
        choice=("a", "b"), disable_any_whitespace=0, disable_additional_properties=1))
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams).structured_outputs
    assert (decoded.choice, decoded.disable_any_whitespace, decoded.disable_additional_properties) == (
        ["a", "b"], False, True)
