"""Structured output end to end with the real default model: sampled answers always follow the JSON schema,
regex, choice or EBNF grammar; constrained and free requests share batches without affecting each other. ``llm``
is the package's shared float32 engine (conftest.py), in its own process as users run it."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedllm import SamplingParams
from pagedllm.structured_output.backend_xgrammar import validate_structured_outputs
from pagedllm.structured_output.params import StructuredOutputsParams
from tests.e2e.conftest import running_llm
from tests.e2e.json_schemas import SCHEMAS
from tests.server.chain_model import MESSAGES, save_thinking_model

SEEDS = (0, 1, 2)


def chat(llm, questions: list[str], params: list[SamplingParams]):
    return llm.chat([[{"role": "user", "content": q}] for q in questions], params, use_tqdm=False)


def test_sampled_json_follows_each_schema(llm):
    questions, params, schemas = [], [], []
    for subject, schema in SCHEMAS:
        for seed in SEEDS:
            questions.append(f"Give me {subject} as JSON.")
            params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=200,
                                         structured_outputs=StructuredOutputsParams(json=schema)))
            schemas.append(schema)
    outputs = chat(llm, questions, params)
    for question, schema, out in zip(questions, schemas, outputs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (question, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)


def test_regex_choice_and_grammar_are_obeyed(llm):
    regexes = [r"\d{3}-\d{4}", r"(cat|dog)s? [a-z]{2,8}", r"[A-Z][a-z]{1,10}, [A-Z]{2}"]
    choices = ["Paris", "London", "Berlin", "Rome"]
    grammar = ('root ::= expr\n'
               'expr ::= term (("+" | "-") term){0,3}\n'
               'term ::= num | "(" num ("*" num)? ")"\n'
               'num ::= [1-9] [0-9]?')
    arithmetic = re.compile(r"(\d{1,2}|\(\d{1,2}(\*\d{1,2})?\))([+-](\d{1,2}|\(\d{1,2}(\*\d{1,2})?\))){0,3}")
    specs = ([StructuredOutputsParams(regex=r) for r in regexes] + [StructuredOutputsParams(choice=choices)]
             + [StructuredOutputsParams(grammar=grammar)])
    questions, params = [], []
    for spec in specs:
        for seed in SEEDS:
            questions.append("Answer briefly: what is the capital of France, or write some arithmetic.")
            params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=64, structured_outputs=spec))
    outputs = [o.outputs[0] for o in chat(llm, questions, params)]
    for spec, out in zip([s for s in specs for _ in SEEDS], outputs):
        assert out.finish_reason == "stop", (spec, out.text)
        if spec.regex is not None:
            assert re.fullmatch(spec.regex, out.text), (spec.regex, out.text)
        elif spec.choice is not None:
            assert out.text in choices
        else:
            assert arithmetic.fullmatch(out.text), out.text


def test_choices_beyond_ascii_are_obeyed(llm):
    """Emoji lie beyond U+FFFF: a choice holding one must be generated as written, as any other choice."""
    choices = ["\U0001F44D", "\U0001F44E"]
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=8,
                             structured_outputs=StructuredOutputsParams(choice=choices)) for seed in SEEDS]
    for out in chat(llm, ["Do you like Paris? Answer with an emoji."] * len(SEEDS), params):
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text in choices, out.outputs[0]


def test_free_requests_in_a_mixed_batch_are_unchanged(llm):
    questions = ["What is the capital of France?", "Name a colour.", "Tell me about dogs."]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    alone = [o.outputs[0].text for o in chat(llm, questions, [greedy] * 3)]
    constrained = SamplingParams(temperature=0, max_tokens=24,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMAS[0][1]))
    mixed = chat(llm, [questions[0], "A person?", questions[1], "A person?", questions[2]],
                 [greedy, constrained, greedy, constrained, greedy])
    assert [mixed[i].outputs[0].text for i in (0, 2, 4)] == alone
    json.loads(mixed[1].outputs[0].text)


def test_a_lark_grammar_whose_comment_mentions_ebnf_is_lark(llm):
    """As vLLM's grammar_is_likely_lark: `::=` only in a comment does not make a grammar EBNF."""
    grammar = '// Lark, not EBNF (rule ::= ...)\nstart: "y" /[a-z]{3}/'
    params = SamplingParams(temperature=0, max_tokens=10, structured_outputs=StructuredOutputsParams(grammar=grammar))
    out = llm.generate("Letters:", params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and re.fullmatch("y[a-z]{3}", out.text), out.text


def test_json_object_gives_an_object(llm):
    params = SamplingParams(temperature=0, max_tokens=100, structured_outputs=StructuredOutputsParams(
        json_object=True))
    out = chat(llm, ["Give the capital of France as JSON."], [params])[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    assert json.loads(out.text) == {"capital": "Paris"}


def nested_arrays(depth: int) -> dict:
    """A schema of arrays ``depth`` deep around a string: ``depth + 1`` nested objects."""
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def test_a_schema_nested_as_deep_as_vllm_allows_is_valid():
    validate_structured_outputs(StructuredOutputsParams(json=nested_arrays(63)))
    validate_structured_outputs(StructuredOutputsParams(json=json.dumps(nested_arrays(63))))


@pytest.mark.parametrize("spec, message", [
    ({"json": {"type": "objekt"}}, "structured_outputs.json is invalid"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"regex": "a(b"}, "structured_outputs.regex is invalid: .*parenthesis"),
    ({"grammar": "root ::= missing_rule"}, "structured_outputs.grammar is invalid: .*missing_rule"),
    # keywords the grammar would not enforce (vLLM's xgrammar backend refuses them too)
    ({"json": {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 7}}}},
     "structured_outputs.json is invalid: multipleOf is not supported"),
    ({"json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}, "uniqueItems is not supported"),
    ({"json": {"type": "string", "pattern": "[a-z]+", "maxLength": 3}}, "pattern with minLength/maxLength"),
    # nested past vLLM's 64 levels: a minute to convert at ~950 levels, a RecursionError past ~1000 (as text too)
    ({"json": nested_arrays(65)}, "structured_outputs.json is invalid: the JSON schema is nested too deeply"),
    ({"json": nested_arrays(5000)}, "structured_outputs.json is invalid: the JSON schema is nested too deeply"),
    ({"json": "[" * 100_000}, "structured_outputs.json is invalid: the JSON schema is nested too deeply"),
    # beyond the 64 bits of MessagePack, in which it crosses to the engine
    ({"json": {"enum": ["a", 10**30]}}, "structured_outputs.json is invalid: can't serialize ints"),
    ({"structural_tag": json.dumps({"type": "structural_tag", "format": {
        "type": "tag", "begin": "<a>", "content": {"type": "json_schema", "json_schema": nested_arrays(80)},
        "end": "</a>"}})}, "structured_outputs.structural_tag is invalid: the JSON schema is nested too deeply"),
])
def test_invalid_specs_are_value_errors_without_leaks(llm, spec, message):
    # A valid request ahead of the bad one must not be left queued either.
    with pytest.raises(ValueError, match=message):
        llm.generate(["Hello", "Hi"], [SamplingParams(), SamplingParams(
            structured_outputs=StructuredOutputsParams(**spec))], use_tqdm=False)
    stats = llm.get_stats()
    assert stats.num_running_reqs == stats.num_waiting_reqs == stats.num_skipped_waiting_reqs == 0
    assert stats.kv_cache_usage == 0.0


def test_controls_that_leave_the_grammar_no_token_end_the_request_with_an_error(llm):
    """allowed_token_ids disjoint from what a choice allows: the sampled token breaks the grammar, and the request
    ends with an error (vLLM's FINISHED_ERROR), not as a "stop" whose text is no choice at all."""
    hello = llm.get_tokenizer().encode(" hello", add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=hello,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    out = llm.generate("Is Paris in France? Answer:", params, use_tqdm=False)[0]
    assert out.finished and out.error is not None and "structured_outputs" in out.error, (out.error, out.outputs)
    stats = llm.get_stats()
    assert stats.num_running_reqs == stats.num_waiting_reqs == stats.num_skipped_waiting_reqs == 0
    assert stats.kv_cache_usage == 0.0
    free = llm.generate("Is Paris in France? Answer:", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert free[0].error is None


def test_a_reasoning_parser_holds_the_grammar_back_until_the_reasoning_ends(tmp_path, tokenizer):
    """As vLLM's engine with a reasoning parser, offline too: the model thinks freely (it would answer "<think> Let me
    see</think> Paris is big"), then answers as the grammar says; the </think> a spent thinking_token_budget forces
    ends the reasoning as well, and a prompt that ended it leaves the grammar on from the first token."""
    save_thinking_model(tmp_path, tokenizer)
    json_object = StructuredOutputsParams(json_object=True)
    thought = {"role": "assistant", "content": "<think> Let me see</think>"}
    with running_llm(str(tmp_path), dtype="float32", max_model_len=512, num_kv_blocks=32,
                     reasoning_parser="deepseek_r1") as llm:
        held, budgeted = (o.outputs[0].text for o in llm.chat([MESSAGES, MESSAGES], [
            SamplingParams(temperature=0, max_tokens=8, structured_outputs=json_object),
            SamplingParams(temperature=0, max_tokens=8, structured_outputs=json_object, thinking_token_budget=1)],
            use_tqdm=False))
        ended = llm.chat([*MESSAGES, thought], SamplingParams(temperature=0, max_tokens=8,
                                                              structured_outputs=json_object),
                         add_generation_prompt=False, continue_final_message=True, use_tqdm=False)[0].outputs[0].text
    assert held.startswith("<think> Let me see</think>{") and budgeted.startswith("<think> Let</think>{")
    assert ended.startswith("{")
