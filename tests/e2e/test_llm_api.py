"""The offline LLM API end to end with the real default model: chat, seeds, n, stop strings, logprobs. ``llm`` is
the package's shared float32 engine (conftest.py), in its own process as users run it."""
from __future__ import annotations

import asyncio
import logging
import math
import re

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, StructuredOutputsParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.outputs import RequestOutput
from tests.e2e.conftest import running_llm


def test_chat_answers_paris(llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason in ("stop", "length")
    rendered = llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out[0].prompt == rendered  # as vLLM's chat: the template's text


def test_chat_renders_each_conversation_once(llm, monkeypatch):
    """As vLLM's LLM.chat: the template is rendered once per conversation (its text, then tokenized), the prompt's
    token ids those the template's tokenize=True gives."""
    tokenizer = llm.get_tokenizer()
    render = tokenizer.apply_chat_template
    conversations = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "What is 2 + 2?"}]]
    expected = [render(turns, tokenize=True, return_dict=False, add_generation_prompt=True) for turns in conversations]
    calls = []
    monkeypatch.setattr(tokenizer, "apply_chat_template", lambda *args, **kwargs: calls.append(1) or render(
        *args, **kwargs))
    outputs = llm.chat(conversations, SamplingParams(max_tokens=1), use_tqdm=False)
    assert len(calls) == len(conversations)
    assert [out.prompt_token_ids for out in outputs] == [list(ids) for ids in expected]


def test_chat_passes_chat_template_kwargs_and_tools_to_the_template(llm):
    """As vLLM's LLM.chat: chat_template_kwargs (e.g. Qwen3's enable_thinking) and tools reach the template."""
    template = ("{% for m in messages %}{{ m.content }}{% endfor %}|{{ flavour }}|"
                "{% for t in tools or [] %}{{ t.function.name }}{% endfor %}")
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False,
                   chat_template=template, chat_template_kwargs={"flavour": "vanilla"}, tools=[tool])
    assert out[0].prompt == "Hi|vanilla|get_weather"
    assert out[0].prompt_token_ids == llm.get_tokenizer().encode("Hi|vanilla|get_weather", add_special_tokens=False)
    # vLLM's order: messages, sampling_params, use_tqdm, lora_request, priority, chat_template, ...
    positional = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=1), False,
                          None, 0, template)
    assert positional[0].prompt == "Hi||"


def test_chat_and_enqueue_chat_take_tokenization_and_mm_processor_kwargs(llm):
    """vLLM's LLM.chat and enqueue_chat tokenization_kwargs: the tokenizer's for the rendered text, over
    add_special_tokens=False (here a truncation); mm_processor_kwargs, checked as generate()'s."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params, cut = SamplingParams(temperature=0, max_tokens=1), {"truncation": True, "max_length": 5}
    full = llm.chat(messages, params, use_tqdm=False)[0].prompt_token_ids
    assert llm.chat(messages, params, use_tqdm=False, tokenization_kwargs=cut,
                    mm_processor_kwargs={})[0].prompt_token_ids == full[:5]
    llm.enqueue_chat(messages, params, use_tqdm=False, tokenization_kwargs=cut, mm_processor_kwargs={})
    assert [o.prompt_token_ids for o in llm.wait_for_completion(use_tqdm=False)] == [full[:5]]
    with pytest.raises(ValueError, match="mm_processor_kwargs must be a dict"):
        llm.chat(messages, params, use_tqdm=False, mm_processor_kwargs="x")
    with pytest.raises(ValueError, match=r"tokenization_kwargs must be a dict, got \['max_length'\]"):  # as generate()
        llm.chat(messages, params, use_tqdm=False, tokenization_kwargs=["max_length"])


def test_chat_continues_the_final_message_only_without_a_generation_prompt(llm):
    """As vLLM's LLM.chat (where transformers refuses the two together): continue_final_message with the default
    add_generation_prompt=True is a ValueError naming them, before anything runs; with it off, the last message is
    left open for the model to continue."""
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    params = SamplingParams(temperature=0, max_tokens=1)
    with pytest.raises(ValueError, match="^continue_final_message and add_generation_prompt"):
        llm.chat(messages, params, use_tqdm=False, continue_final_message=True)
    out = llm.chat(messages, params, use_tqdm=False, continue_final_message=True, add_generation_prompt=False)[0]
    assert out.prompt.endswith("The colour is")
    assert not llm.llm_engine.has_unfinished_requests()


def test_seeded_request_same_alone_and_in_a_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [f"Story number {i}:" for i in range(16)]
    other_params = [SamplingParams(temperature=0.8, max_tokens=24 + i % 5) for i in range(16)]
    batch = llm.generate(others[:7] + ["Once upon a time"] + others[7:], other_params[:7] + [params] + other_params[7:],
                         use_tqdm=False)
    assert batch[7].outputs[0].token_ids == alone
    assert len({tuple(o.outputs[0].token_ids) for o in batch}) > 1


def test_outputs_in_input_order_with_token_prompts(llm):
    prompts = [{"prompt_token_ids": [1, 2, 3, 4][:n]} for n in (4, 1, 3)]
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (9, 2, 5)],
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [9, 2, 5]
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in prompts]


def test_outputs_carry_no_metrics_as_vllms_llm_keeps_no_stats(llm):
    """vLLM's RequestOutput.metrics is its RequestStateStats or None, and None from LLM (disable_log_stats by
    default): code reading ``if out.metrics is not None: out.metrics.first_token_latency`` must find None."""
    assert llm.generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False)[0].metrics is None


def test_n_independent_samples(llm):
    out = llm.generate("The weather today is", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_stop_string_truncates_text(llm):
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = llm.generate("Count: 1, 2, 3,", greedy, use_tqdm=False)[0].outputs[0].text
    assert " 6" in full
    stopped = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=40, stop=[" 6"]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.text == full[:full.index(" 6")]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == " 6"
    included = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=40, stop=[" 6"],
                                                              include_stop_str_in_output=True),
                            use_tqdm=False)[0].outputs[0]
    assert included.text == full[:full.index(" 6") + 2]
    # The stop string completed by the last token max_tokens allows: a stop, as vLLM reports it, not "length".
    tokens = llm.generate("Count: 1, 2, 3,", greedy, use_tqdm=False)[0].outputs[0].token_ids
    last = next(n for n in range(1, len(tokens) + 1) if " 6" in llm.get_tokenizer().decode(tokens[:n]))
    at_the_limit = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=last, stop=[" 6"]),
                                use_tqdm=False)[0].outputs[0]
    assert at_the_limit.text == stopped.text
    assert (at_the_limit.finish_reason, at_the_limit.stop_reason) == ("stop", " 6")


def test_logprobs_and_prompt_logprobs(llm, hf_model):
    prompt = [1, 504, 3458, 282, 4649, 314]
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=1),
                       use_tqdm=False)[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 3
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt + completion.token_ids[:2]])).logits[0].float(), -1)
    for i, token in enumerate(completion.token_ids):
        entry = completion.logprobs[i]
        assert entry[token].rank == 1  # greedy picks the top token
        assert math.isclose(entry[token].logprob, ref[len(prompt) - 1 + i, token].item(), abs_tol=1e-3)
        assert len(entry) <= 3
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        assert math.isclose(out.prompt_logprobs[pos][prompt[pos]].logprob, ref[pos - 1, prompt[pos]].item(),
                            abs_tol=1e-3)


def test_logprob_token_ids_report_the_models_logprobs_of_those_ids(llm, hf_model):
    """vLLM's logprob_token_ids: each generated token's logprobs are its own and exactly those of the ids asked for
    (as many as they are, whatever max_logprobs), their values the model's full distribution's; the request beside it
    in the batch keeps its top-k. Ids outside the vocabulary are refused, naming the field."""
    prompt = [1, 504, 3458, 282, 4649, 314]
    ids = [30000, 28, 5, 1, 17, 900, 12, 40000, 3, 77, 2000, 9, 451, 6000, 8, 31, 64, 128, 256, 4096, 10000, 49000]
    asked, plain = llm.generate([{"prompt_token_ids": prompt}] * 2, [
        SamplingParams(temperature=0, max_tokens=3, logprob_token_ids=ids),
        SamplingParams(temperature=0, max_tokens=3, logprobs=2)], use_tqdm=False)
    completion = asked.outputs[0]
    assert completion.token_ids == plain.outputs[0].token_ids
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt + completion.token_ids[:2]])).logits[0].float(), -1)
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert next(iter(entry)) == token and set(entry) == {token, *ids}
        assert entry[token].rank == 1
        for t in ids:
            assert math.isclose(entry[t].logprob, ref[len(prompt) - 1 + i, t].item(), abs_tol=1e-3)
    assert math.isclose(completion.cumulative_logprob, sum(e[t].logprob for t, e in zip(completion.token_ids,
                                                                                       completion.logprobs)))
    assert all(len(entry) <= 3 for entry in plain.outputs[0].logprobs)
    with pytest.raises(ValueError, match="^logprob_token_ids contains out-of-vocabulary token ids"):
        llm.generate("Hello", SamplingParams(max_tokens=2, logprob_token_ids=[3, 10 ** 6]), use_tqdm=False)


@pytest.mark.parametrize("params, message", [
    ({"logprob_token_ids": [1, 2], "logprobs": 3}, "^logprob_token_ids must be as many as logprobs"),
    ({"logprob_token_ids": list(range(129))}, "^logprob_token_ids must hold at most 128")])
def test_bad_logprob_token_ids_name_the_field(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params)


@pytest.mark.parametrize("budget", [-2, True, 1.5, "8"])
def test_bad_thinking_token_budgets_name_the_field(budget):
    with pytest.raises(ValueError, match="^thinking_token_budget must be a non-negative integer"):
        SamplingParams(thinking_token_budget=budget)


def test_thinking_token_budget_is_refused_not_ignored(llm):
    """vLLM enforces a thinking_token_budget only with a reasoning config (reasoning_parser), and refuses it without
    one, as here (test_sampling_controls.py enforces it). -1 is vLLM's no budget."""
    with pytest.raises(ValueError, match="^thinking_token_budget is set but reasoning_config is not configured"):
        llm.generate("Hello", SamplingParams(max_tokens=2, thinking_token_budget=8), use_tqdm=False)
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None
    assert len(llm.generate("Hello", SamplingParams(max_tokens=2, thinking_token_budget=-1),
                            use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_processed_logprobs_mode_reports_what_was_sampled_from():
    """vLLM's logprobs_mode="processed_logprobs": a token's logprobs are of the distribution it was sampled from,
    here top_k 3 (the others -inf, the three summing to 1); prompt logprobs stay the model's own."""
    prompt = [1, 504, 3458, 282, 4649, 314]
    params = SamplingParams(temperature=0.5, top_k=3, seed=0, max_tokens=4, logprobs=5, prompt_logprobs=0)
    with running_llm(dtype="float32", max_model_len=256, kv_cache_memory="64MiB",
                     logprobs_mode="processed_logprobs") as engine:
        out = engine.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    for token, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        values = sorted((lp.logprob for lp in entry.values()), reverse=True)
        assert entry[token].rank <= 3 and values[3:] == [float("-inf")] * 2
        assert math.isclose(sum(math.exp(v) for v in values[:3]), 1.0, rel_tol=1e-4)
    assert all(-30 < entry[prompt[i]].logprob < 0 for i, entry in enumerate(out.prompt_logprobs) if entry)


@pytest.mark.parametrize("bad, field", [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                                        ({"n": 0}, "n"), ({"logprobs": -2}, "logprobs"),
                                        ({"max_tokens": 0}, "max_tokens"), ({"min_p": 2}, "min_p"),
                                        ({"output_kind": 3}, "output_kind")])
def test_bad_sampling_params_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad)


def test_sampling_params_clone_is_a_deep_copy():
    """As vLLM's SamplingParams.clone: the copy is equal, and changing it leaves the original as it was."""
    params = SamplingParams(temperature=0.5, stop=["x"], logit_bias={3: 1.0}, seed=7)
    clone = params.clone()
    assert clone == params and clone is not params
    clone.stop.append("y")
    clone.logit_bias[4] = 2.0
    assert params.stop == ["x"] and params.logit_bias == {3: 1.0}


def test_more_logprobs_than_max_logprobs_name_the_field(llm):
    """The engine's max_logprobs (vLLM's default 20) bounds logprobs and prompt_logprobs: a ValueError naming the
    field, the engine serving on."""
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"^{field} "):
            llm.generate("Hello", SamplingParams(max_tokens=2, **{field: 21}), use_tqdm=False)
    assert len(llm.generate("Hello", SamplingParams(max_tokens=2, logprobs=20), use_tqdm=False)[0].outputs[0]
               .logprobs[0]) >= 20


@pytest.mark.parametrize("field, value, message", [
    ("max_num_seqs", 2.5, "must be an integer"), ("block_size", 16.0, "must be an integer"),
    ("max_model_len", "128", "must be an integer"), ("max_model_len", 0, "must be at least 1"),
    ("num_kv_blocks", -3, "must be at least 1"), ("kv_cache_memory", "2 gigs", "a size like '2GiB'"),
    ("kv_cache_memory_bytes", "2G", "must be an integer"), ("num_gpu_blocks_override", 0, "must be at least 1"),
    ("scheduling_policy", "lifo", "must be one of fcfs, priority"),
    ("enable_prefix_caching", "false", "must be True or False"), ("enforce_eager", "false", "must be True or False"),
    ("enable_lora", "no", "must be True or False"), ("trust_remote_code", "False", "must be True or False")])
def test_engine_arguments_of_the_wrong_kind_name_the_field(field, value, message):
    """Checked with the config, before any process starts, rather than failing in the engine process."""
    with pytest.raises(ValueError, match=f"{field}.*{message}"):
        EngineArgs(**{field: value}).create_engine_config()


def test_enable_prefix_caching_none_is_the_default():
    """vLLM's None: prefix caching on (it was off, None being falsy); chunked prefill likewise."""
    assert EngineArgs(enable_prefix_caching=None).create_engine_config().cache_config.enable_prefix_caching is True
    scheduler_config = EngineArgs(enable_chunked_prefill=None).create_engine_config().scheduler_config
    assert (scheduler_config.enable_chunked_prefill, scheduler_config.max_num_batched_tokens) == (True, 2048)
    with pytest.raises(ValueError, match="enable_chunked_prefill must be True or False, got 'false'"):
        EngineArgs(enable_chunked_prefill="false").create_engine_config()


def test_max_num_seqs_defaults_to_at_most_max_num_batched_tokens():
    """vLLM's: left unset, max_num_seqs is 256 cut to max_num_batched_tokens; set above it, a ValueError."""
    assert EngineArgs().create_engine_config().scheduler_config.max_num_seqs == 256
    assert EngineArgs(max_num_batched_tokens=64).create_engine_config().scheduler_config.max_num_seqs == 64
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(64\) must be greater than or equal to "
                                         r"max_num_seqs \(128\)"):
        EngineArgs(max_num_batched_tokens=64, max_num_seqs=128).create_engine_config()


def test_an_architecture_not_served_is_refused_with_the_config(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="Unsupported model"):
        EngineArgs(str(tmp_path)).create_engine_config()


def test_vllms_other_llm_arguments_are_taken_or_refused_with_their_name():
    """vLLM's LLM arguments tokenizer_revision, hf_token, runner, mm_processor_kwargs and logits_processors: taken at
    what they mean here (no Hub download, a text-only generating model, no custom logits processors), else a
    ValueError naming the argument before anything starts, never a TypeError."""
    config = EngineArgs(tokenizer_revision=None, hf_token="hf_x", runner="generate", mm_processor_kwargs={"a": 1},
                        logits_processors=[]).create_engine_config()
    assert config.model_config.max_model_len > 0
    for kwargs, message in (({"tokenizer_revision": "v2"}, "tokenizer_revision='v2': pagedllm never downloads"),
                            ({"runner": "pooling"}, "runner must be 'auto' or 'generate'"),
                            ({"mm_processor_kwargs": "x"}, "mm_processor_kwargs must be a dict"),
                            ({"logits_processors": ["my.Processor"]}, "logits_processors=.*not supported")):
        with pytest.raises(ValueError, match=message):
            EngineArgs(**kwargs).create_engine_config()
    with pytest.raises(ValueError, match="runner must be"):
        LLM(runner="pooling")


def test_vllms_llm_arguments_for_what_pagedllm_has_not_are_taken_at_their_defaults_or_refused():
    """vLLM's LLM arguments convert, allowed_local_media_path, allowed_media_domains, the offload_* ones,
    pooler_config, quantization_config, enable_return_routed_experts, return_sampling_mask, enable_prompt_embeds,
    worker_extension_cls, worker_cls and kv_transfer_config: at vLLM's defaults (convert "none" too) the engine
    configures, and from_engine_args hands them on; any other value is a ValueError naming the argument, never a
    TypeError nor a setting dropped.
    disable_custom_all_reduce and enable_sleep_mode are honoured either way (no custom all-reduce here; sleep() always
    there); attention_config's "backend" is attention_backend's, its other keys refused."""
    defaults = dict(convert="none", allowed_local_media_path="", allowed_media_domains=None, offload_group_size=0,
                    offload_num_in_group=1, offload_prefetch_step=1, offload_params=set(), pooler_config=None,
                    quantization_config=None, enable_return_routed_experts=False, return_sampling_mask=False,
                    disable_custom_all_reduce=True, attention_config={"backend": "TORCH_SDPA"},
                    enable_prompt_embeds=False, worker_extension_cls="", enable_sleep_mode=True, worker_cls="auto",
                    kv_transfer_config=None)
    engine_args = EngineArgs(**defaults)
    assert engine_args.create_engine_config().model_config.attention_backend == "TORCH_SDPA"
    assert {name: vars(engine_args)[name] for name in defaults} == defaults
    for name, value in (("convert", "embed"), ("allowed_local_media_path", "/tmp"),
                        ("allowed_media_domains", ["example.org"]), ("offload_group_size", 2),
                        ("offload_group_size", False), ("offload_num_in_group", 2), ("offload_prefetch_step", 3),
                        ("offload_params", {"down_proj"}), ("pooler_config", {"pooling_type": "MEAN"}),
                        ("quantization_config", {"linear": "fp8"}), ("enable_return_routed_experts", True),
                        ("return_sampling_mask", True), ("enable_prompt_embeds", True),
                        ("worker_extension_cls", "my.Extension"), ("worker_cls", "my.Worker"),
                        ("kv_transfer_config", {"kv_connector": "ExampleConnector", "kv_role": "kv_both"})):
        with pytest.raises(ValueError, match=f"^{name}={re.escape(repr(value))}: pagedllm does not support"):
            EngineArgs(**{name: value}).create_engine_config()
    for kwargs, message in (({"disable_custom_all_reduce": "yes"}, "disable_custom_all_reduce must be True or False"),
                            ({"enable_sleep_mode": "yes"}, "enable_sleep_mode must be True or False"),
                            ({"attention_config": {"backend": "TORCH_SDPA"}, "attention_backend": "TORCH_SDPA"},
                             "attention_backend and attention_config.backend are mutually exclusive"),
                            ({"attention_config": {"flash_attn_version": 3}},
                             "attention_config 'flash_attn_version' is not supported"),
                            ({"attention_config": {"backend": "FLASH_ATTN"}}, "attention_backend must be one of")):
        with pytest.raises(ValueError, match=message):
            EngineArgs(**kwargs).create_engine_config()
    with pytest.raises(ValueError, match="offload_group_size=4"):
        LLM(offload_group_size=4)


def test_engine_threads_are_checked_and_passed_on():
    with pytest.raises(ValueError, match="num_cpu_threads"):
        EngineArgs(num_cpu_threads=0).create_engine_config()
    assert EngineArgs(num_cpu_threads=1).create_engine_config().num_cpu_threads == 1
    assert EngineArgs().create_engine_config().num_cpu_threads is None  # torch's default: one per core


def test_bad_prompts_are_rejected_without_leaking(llm):
    with pytest.raises(ValueError, match="maximum context length is 1024"):
        llm.generate({"prompt_token_ids": [5] * 1024}, use_tqdm=False)
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate({"prompt_token_ids": [10**9]}, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    stats = llm.get_stats()
    assert stats.num_running_reqs == stats.num_waiting_reqs == stats.num_skipped_waiting_reqs == 0
    assert stats.kv_cache_usage == 0.0


def test_reset_prefix_cache(llm):
    prompt = {"prompt_token_ids": list(range(1000, 1100))}
    llm.generate(prompt, use_tqdm=False)
    hits = llm.get_stats().prefix_cache_hits
    llm.generate(prompt, use_tqdm=False)
    assert llm.get_stats().prefix_cache_hits > hits
    assert llm.reset_prefix_cache() is True
    hits = llm.get_stats().prefix_cache_hits
    llm.generate(prompt, use_tqdm=False)
    assert llm.get_stats().prefix_cache_hits == hits
    assert llm.reset_prefix_cache(reset_running_requests=True) is True  # vLLM's argument (nothing runs here)
    # vLLM's reset_connector: without a KV connector (pagedllm has none) there is nothing more to reset
    assert llm.reset_prefix_cache(False, True) is True and llm.reset_prefix_cache(reset_connector=True) is True


def test_a_prompts_cache_salt_shares_cached_blocks_only_within_the_salt(llm):
    """vLLM's prompt key "cache_salt" (TextPrompt / TokensPrompt): a prompt reuses cached blocks of prompts with the
    same salt only; a bad one is a ValueError naming it."""
    ids = list(range(4000, 4100))

    def cached(**salt) -> int:
        return llm.generate({"prompt_token_ids": ids, **salt}, use_tqdm=False)[0].num_cached_tokens

    assert [cached(cache_salt="a"), cached(cache_salt="a"), cached(), cached(cache_salt="b")] == [0, 96, 0, 0]
    text = "A text prompt long enough to fill at least one whole block of sixteen tokens in the KV cache, twice."
    assert [llm.generate({"prompt": text, "cache_salt": salt}, use_tqdm=False)[0].num_cached_tokens
            for salt in ("c", "d", "c")] == [0, 0, 16]
    for bad in ("", 7, "a@b"):
        with pytest.raises(ValueError, match="cache_salt"):
            llm.generate({"prompt_token_ids": ids, "cache_salt": bad}, use_tqdm=False)
    # a beam search's steps carry its prompt's salt (vLLM's beams keep it): they cache the prompt's blocks under it
    searched = list(range(5000, 5100))
    llm.beam_search([{"prompt_token_ids": searched, "cache_salt": "e"}], BeamSearchParams(beam_width=2, max_tokens=2))
    assert [llm.generate({"prompt_token_ids": searched, **salt}, use_tqdm=False)[0].num_cached_tokens
            for salt in ({}, {"cache_salt": "e"})] == [0, 96]


def test_a_finished_request_id_can_be_used_again(llm):
    """The model runner learns of a finish on the next step, which may bring a new request with the same id."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)

    def run(prompt_token_ids: list[int]) -> list[int]:
        engine.add_request("reused", {"prompt_token_ids": prompt_token_ids}, params)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert [out.request_id for out in outputs] == ["reused"]
        return outputs[0].outputs[0].token_ids

    story, recipe = llm.get_tokenizer().encode("Once upon a time"), llm.get_tokenizer().encode("To bake bread,")
    first = run(story)
    assert run(recipe) != first
    assert run(story) == first


def test_output_kind_of_the_sampling_params_chooses_what_each_step_returns(llm):
    """As vLLM's: LLMEngine.step follows SamplingParams.output_kind, by default CUMULATIVE (everything so far, each
    step), DELTA (what is new) or FINAL_ONLY (one output); LLM.generate returns the final outputs whatever the params
    say, and leaves the caller's params as they were."""
    engine = llm.llm_engine

    def run(params: SamplingParams) -> list[tuple[list[int], bool]]:
        engine.add_request("kind", {"prompt_token_ids": [1, 504, 3458]}, params)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += [(out.outputs[0].token_ids, out.finished) for out in engine.step()]
        return outputs

    greedy = {"temperature": 0, "max_tokens": 3, "ignore_eos": True}
    assert SamplingParams().output_kind == RequestOutputKind.CUMULATIVE
    final = run(SamplingParams(**greedy, output_kind=RequestOutputKind.FINAL_ONLY))
    [(tokens, _)] = final
    assert run(SamplingParams(**greedy)) == [(tokens[:1], False), (tokens[:2], False), (tokens, True)]
    assert run(SamplingParams(**greedy, output_kind=RequestOutputKind.DELTA)) == [
        ([tokens[0]], False), ([tokens[1]], False), ([tokens[2]], True)]
    delta = SamplingParams(**greedy, output_kind=RequestOutputKind.DELTA)
    assert llm.generate({"prompt_token_ids": [1, 504, 3458]}, delta, use_tqdm=False)[0].outputs[0].token_ids == tokens
    assert delta.output_kind == RequestOutputKind.DELTA


def test_llm_from_engine_args_is_the_llm_they_configure():
    """vLLM's LLM.from_engine_args."""
    llm = LLM.from_engine_args(EngineArgs(dtype="float32", max_model_len=128, kv_cache_memory="16MiB"))
    try:
        assert llm.llm_engine.config.model_config.max_model_len == 128
        assert len(llm.generate("Hi", SamplingParams(max_tokens=2, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0].token_ids) == 2
    finally:
        llm.shutdown()


def test_llm_engine_from_engine_args_runs_vllms_engine_loop():
    """vLLM's LLMEngine.from_engine_args and get_tokenizer, then its loop: add_request (which returns the request's
    id), step while has_unfinished_requests. Statistics are on, as EngineArgs.disable_log_stats is False by default
    (vLLM's; LLM() sets it True). vLLM's positional arguments (usage_context, stat_loggers,
    enable_multiprocessing): the last runs the engine core in a process of its own even where the environment asks
    for this one, as vLLM's."""
    from pagedllm.engine.core_client import SyncMPClient
    from pagedllm.engine.llm_engine import LLMEngine
    from tests.e2e.conftest import _engines_in_this_process

    vllm_usage_context = object()  # a vllm.usage.usage_lib.UsageContext member there
    with pytest.MonkeyPatch.context() as patcher:
        _engines_in_this_process(patcher)
        engine = LLMEngine.from_engine_args(EngineArgs(dtype="float32", max_model_len=512, kv_cache_memory="64MiB"),
                                            vllm_usage_context, None, True)
    try:
        assert isinstance(engine.engine_core, SyncMPClient)
        assert engine.get_tokenizer() is engine.tokenizer is not None
        assert re.fullmatch("0-[0-9a-f]{8}", engine.add_request("0", "Hello", SamplingParams(max_tokens=3,
                                                                                           ignore_eos=True)))
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert [(len(out.outputs[0].token_ids), out.finished) for out in outputs] == [(1, False), (2, False), (3, True)]
        assert outputs[-1].metrics.num_generation_tokens == 3
        assert any(metric.name == "pagedllm:generation_tokens" for metric in engine.get_metrics())
    finally:
        engine.shutdown()


def test_tokenization_kwargs_reach_the_tokenizer(llm):
    """vLLM's tokenization_kwargs of LLM.generate, LLM.enqueue and LLMEngine.add_request (its arguments in vLLM's
    order, trace_headers dropped without tracing): the tokenizer's, here truncating a text prompt; generate's
    mm_processor_kwargs have nothing to act on with a text-only model."""
    text, params = "One, two, three, four", SamplingParams(max_tokens=1)
    truncate = {"truncation": True, "max_length": 2}
    expected = llm.get_tokenizer().encode(text)[:2]
    assert llm.generate(text, params, use_tqdm=False, tokenization_kwargs=truncate,
                        mm_processor_kwargs={})[0].prompt_token_ids == expected
    llm.enqueue(text, params, use_tqdm=False, tokenization_kwargs=truncate)
    assert llm.wait_for_completion(use_tqdm=False)[0].prompt_token_ids == expected
    engine = llm.llm_engine
    engine.add_request("t", text, params, None, None, truncate, {"traceparent": "00-0af7651916cd43dd-01"}, 0)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].prompt_token_ids == expected
    with pytest.raises(ValueError, match="tokenization_kwargs must be a dict"):
        llm.generate(text, params, use_tqdm=False, tokenization_kwargs="truncate")


def test_llm_engine_from_vllm_config_logs_stats_when_asked(caplog):
    """vLLM's LLMEngine.from_vllm_config (the engine of a created config), do_log_stats (the stats line now) and
    reset_encoder_cache (no encoder cache to reset)."""
    from pagedllm.engine.llm_engine import LLMEngine
    from tests.e2e.conftest import _engines_in_this_process

    with pytest.MonkeyPatch.context() as patcher:
        _engines_in_this_process(patcher)
        config = EngineArgs(dtype="float32", max_model_len=512, kv_cache_memory="64MiB").create_engine_config()
        engine = LLMEngine.from_vllm_config(config, object())  # vLLM's usage_context before its stat_loggers
    try:
        assert engine.config is config and engine.log_stats
        engine.add_request("0", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        with caplog.at_level(logging.INFO):
            engine.do_log_stats()
        assert any(r.getMessage().startswith("Engine 000: Avg prompt throughput: ") for r in caplog.records)
        assert engine.reset_encoder_cache() is None
    finally:
        engine.shutdown()


def test_requests_may_share_an_id_each_running_as_its_own_and_aborted_together(llm):
    """As vLLM's LLMEngine.add_request: an id already running is taken (each request runs under a unique id, the
    one returned), each request's outputs are its own under the caller's id, and abort_request(id) stops every
    request added under it, leaving no KV block held. "1_x" is no clash with the sequences of an n = 2 "x"."""
    engine = llm.llm_engine
    final = dict(ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    added = [engine.add_request("x", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=6, **final)),
             engine.add_request("x", {"prompt_token_ids": [4, 5]}, SamplingParams(n=2, max_tokens=3, **final)),
             engine.add_request("1_x", {"prompt_token_ids": [6]}, SamplingParams(max_tokens=2, **final))]
    assert len(set(added)) == 3
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert sorted((out.request_id, out.prompt_token_ids, [len(c.token_ids) for c in out.outputs]) for out in outputs) \
        == [("1_x", [6], [2]), ("x", [1, 2, 3], [6]), ("x", [4, 5], [3, 3])]
    for prompt_token_ids in ([1, 2, 3], [4, 5]):
        engine.add_request("x", {"prompt_token_ids": prompt_token_ids}, SamplingParams(max_tokens=400, **final))
    engine.step()
    engine.abort_request(["x"])
    assert not engine.has_unfinished_requests() and engine.step() == []
    stats = llm.get_stats()
    assert stats.num_running_reqs == stats.num_waiting_reqs == 0 and stats.kv_cache_usage == 0.0


def test_an_interrupted_generate_leaves_no_request_running(llm, monkeypatch):
    """Ctrl-C (or any error) in generate aborts its requests: none keeps running in the engine, and the next call
    waits only for its own."""
    step, steps = llm.llm_engine.step, []

    def interrupted_at_the_third_step():
        steps.append(1)
        if len(steps) == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.llm_engine, "step", interrupted_at_the_third_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["Tell me a story"] * 4, SamplingParams(n=2, max_tokens=400, ignore_eos=True), use_tqdm=False)
    monkeypatch.undo()
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate("Hi", SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    assert llm.get_stats().num_running_reqs == 0


def test_a_kv_cache_smaller_than_one_request_is_warned_of_and_refuses_what_it_cannot_hold(caplog):
    """vLLM refuses to start with a KV cache that cannot hold one request of max_model_len; this engine starts (a
    small cache still serves short requests) but says so at start-up, and refuses a request that could outgrow the
    cache with an error in its output instead of stalling it."""
    from tests.e2e.conftest import in_process_llm

    with caplog.at_level(logging.WARNING, logger="pagedllm.worker.worker"):
        llm = in_process_llm(max_model_len=512, num_kv_blocks=8, enforce_eager=True)
    try:
        assert any("smaller than one request of max_model_len (512)" in r.getMessage() for r in caplog.records)
        short, long = llm.generate([{"prompt_token_ids": list(range(1000, 1010))},
                                    {"prompt_token_ids": list(range(1000, 1200))}],
                                   SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        assert short.error is None and len(short.outputs[0].token_ids) == 4
        assert "KV cache" in long.error and long.outputs[0].token_ids == []
    finally:
        llm.shutdown()


def test_max_model_len_minus_one_fits_the_context_to_the_kv_cache():
    """vLLM's max_model_len=-1 (auto-fit), through the engine process: the engine lowers the model's context length
    (8192) to the longest request its cache holds, and its ready response carries that and the cache's blocks to
    the frontend, which then refuses a prompt that fills the fitted length and serves one a token shorter."""
    with running_llm(dtype="float32", max_model_len=-1, kv_cache_memory="16MiB", enforce_eager=True) as llm:
        config = llm.llm_engine.config
        num_blocks = config.cache_config.num_blocks
        assert num_blocks and config.model_config.max_model_len == num_blocks * config.cache_config.block_size < 8192
        assert config.scheduler_config.max_model_len == config.model_config.max_model_len
        fitted = config.model_config.max_model_len
        with pytest.raises(ValueError, match=f"maximum context length is {fitted} tokens"):
            llm.generate({"prompt_token_ids": [1000] * fitted}, use_tqdm=False)
        (out,) = llm.generate({"prompt_token_ids": list(range(1000, 999 + fitted))},
                              SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        assert out.error is None and len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"


def test_streamed_prompt_logprobs_come_once_and_whole_with_the_first_token():
    """A prompt prefilled in chunks sends no output per chunk: its prompt logprobs come once, all of them, with the
    first token (as vLLM sends them), so a stream neither repeats them nor starts with a part."""
    from tests.e2e.conftest import in_process_llm

    llm = in_process_llm(dtype="float32", max_model_len=512, kv_cache_memory="64MiB", max_num_batched_tokens=64)
    try:
        engine = llm.llm_engine
        prompt = {"prompt_token_ids": list(range(1000, 1151))}  # three chunks of at most 64
        engine.add_request("streamed", prompt, SamplingParams(max_tokens=2, prompt_logprobs=0, temperature=0,
                                                              output_kind=RequestOutputKind.DELTA))
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert all(out.outputs[0].token_ids for out in outputs)
        assert len(outputs[0].prompt_logprobs) == 151 and outputs[0].prompt_logprobs[0] is None
        assert all(out.prompt_logprobs is None for out in outputs[1:])
    finally:
        llm.shutdown()


def test_use_tqdm_may_be_the_callable_that_makes_the_progress_bar(llm):
    """As vLLM's: use_tqdm=functools.partial(tqdm, ...) or any tqdm-like callable makes generate's progress bar."""
    bars = []

    class ProgressBar:
        def __init__(self, total: int, **kwargs) -> None:
            self.total, self.n, self.closed = total, 0, False
            bars.append(self)

        def update(self, n: int = 1) -> None:
            self.n += n

        def close(self) -> None:
            self.closed = True

    llm.generate(["Hi", "Hello"], SamplingParams(max_tokens=1), use_tqdm=ProgressBar)
    [bar] = bars
    assert (bar.total, bar.n, bar.closed) == (2, 2, True)


def test_a_list_of_token_ids_is_a_prompt(llm):
    """As vLLM's DecoderOnlyPrompt: a list of token ids is one prompt, a list of such lists a batch of them."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    as_dict = llm.generate({"prompt_token_ids": [1, 504, 3458]}, params, use_tqdm=False)[0]
    one = llm.generate([1, 504, 3458], params, use_tqdm=False)
    batch = llm.generate([[1, 504, 3458], [1, 504]], params, use_tqdm=False)
    assert [out.prompt_token_ids for out in one] == [[1, 504, 3458]]
    assert [out.prompt_token_ids for out in batch] == [[1, 504, 3458], [1, 504]]
    assert one[0].outputs[0].token_ids == batch[0].outputs[0].token_ids == as_dict.outputs[0].token_ids


def test_priority_is_one_for_every_prompt_or_one_per_prompt(llm):
    """As vLLM's generate and chat: priority is an int for every prompt, or a list of one per prompt."""
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    outputs = llm.generate(["Hi", "Hello"], params, use_tqdm=False, priority=0)
    assert [len(out.outputs[0].token_ids) for out in outputs] == [2, 2]
    with pytest.raises(ValueError, match="priority"):
        llm.generate(["Hi", "Hello"], params, use_tqdm=False, priority=[0])
    chat = llm.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False, priority=0)
    assert len(chat[0].outputs[0].token_ids) == 2


def test_chat_reads_content_parts_and_its_arguments_override_chat_template_kwargs(llm):
    """As vLLM's LLM.chat: content as OpenAI's list of text parts is their text, joined by newlines (not the list's
    repr); chat_template_kwargs naming an argument of chat itself (add_generation_prompt, tools) are overridden by
    it, rather than a TypeError."""
    tokenizer, params = llm.get_tokenizer(), SamplingParams(temperature=0, max_tokens=1)
    as_text = llm.chat([{"role": "user", "content": "Hi\nthere"}], params, use_tqdm=False)[0]
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    as_parts = llm.chat([{"role": "user", "content": parts}], params, use_tqdm=False)[0]
    assert as_parts.prompt == as_text.prompt and as_parts.prompt_token_ids == as_text.prompt_token_ids
    overridden = llm.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False,
                          chat_template_kwargs={"add_generation_prompt": False, "tools": None})[0]
    assert overridden.prompt == tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                              add_generation_prompt=True)


def test_aborting_a_request_of_n_sequences_by_its_id_stops_them_all(llm):
    """As vLLM's LLMEngine.abort_request: an n > 1 request's own id stands for its sequences, none of which runs on;
    add_request takes vLLM's arrival_time and lora_request, and get_num_unfinished_requests counts what runs."""
    from pagedllm.lora.request import LoRARequest

    engine = llm.llm_engine
    engine.add_request("parent", "Tell me a story", SamplingParams(n=2, max_tokens=400, ignore_eos=True))
    assert [re.sub("-[0-9a-f]{8}$", "", request_id) for request_id in engine.output_processor.unfinished_request_ids()
            ] == ["0_parent", "1_parent"]
    engine.abort_request(["parent"])
    assert engine.output_processor.unfinished_request_ids() == [] and not engine.has_unfinished_requests()
    stats = llm.get_stats()
    assert stats.num_running_reqs == stats.num_waiting_reqs == stats.num_skipped_waiting_reqs == 0
    with pytest.raises(ValueError, match="^lora_request: LoRA is not enabled"):
        engine.add_request("adapter", "Hi", SamplingParams(max_tokens=2), arrival_time=1.0,
                           lora_request=LoRARequest("adapter", 1, "/nonexistent"))
    engine.add_request("counted", "Hi", SamplingParams(n=3, max_tokens=2))
    assert engine.get_num_unfinished_requests() == 3
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_num_unfinished_requests() == 0


def test_a_request_id_or_arrival_time_the_engine_cannot_read_is_refused_and_the_engine_serves_on(llm):
    """The engine process decodes a request strictly typed and ends on one it cannot read: a request_id that is no
    string (vLLM's TypeError) or an arrival_time that is no number is refused in the frontend instead."""
    engine = llm.llm_engine
    with pytest.raises(TypeError, match="^request_id must be a string"):
        engine.add_request(7, "Hi", SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="^arrival_time must be a number"):
        engine.add_request("late", "Hi", SamplingParams(max_tokens=1), arrival_time="now")
    assert not engine.has_unfinished_requests()
    assert len(llm.generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False)[0].outputs[0].token_ids) == 1


class SilentEngineCore:
    """An AsyncLLM's engine core that takes requests and never answers: they run until aborted."""
    dead = False

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.shutdown_timeouts: list = []

    def add_request(self, request) -> None:
        pass

    def abort_requests(self, request_ids: list[str]) -> None:
        self.aborted += request_ids

    async def get_output_async(self):
        await asyncio.Event().wait()

    def shutdown(self, timeout=None) -> None:
        self.shutdown_timeouts.append(timeout)


def test_async_llm_shutdown_takes_vllms_timeout(llm):
    """vLLM's AsyncLLM.shutdown(timeout): the engine core gets it (the wait for its process before a kill), once; one
    that is no finite number of seconds, 0 or more (NaN or a negative one killed the engine at once), is a
    ValueError, nothing stopped."""
    async def run() -> list:
        core = SilentEngineCore()
        engine = AsyncLLM(llm.llm_engine.config, llm.get_tokenizer(), core)
        for bad in ("soon", float("nan"), -1):
            with pytest.raises(ValueError, match=rf"timeout must be a number of seconds \(0 or more\) or None, got "
                                                 rf"{re.escape(repr(bad))}"):
                engine.shutdown(timeout=bad)
        assert engine.is_running
        engine.shutdown(timeout=2.5)
        engine.shutdown()
        return core.shutdown_timeouts

    assert asyncio.run(run()) == [2.5]


def test_async_llm_abort_ends_each_stream_with_an_abort_output(llm):
    """As vLLM's AsyncLLM.abort: it takes one request id or several, and the generate() of each ends with a last
    output whose finish_reason is "abort" (rather than an exception); the engine core aborts each sequence."""
    async def run() -> tuple[list[str], list[list]]:
        core = SilentEngineCore()
        engine = AsyncLLM(llm.llm_engine.config, llm.get_tokenizer(), core)
        assert engine.vllm_config is llm.llm_engine.config and engine.model_config is engine.vllm_config.model_config

        async def outputs(request_id: str, n: int) -> list:
            return [out async for out in engine.generate({"prompt_token_ids": [1, 2]}, SamplingParams(n=n),
                                                          request_id)]

        streams = [asyncio.create_task(outputs(request_id, n)) for request_id, n in (("a", 1), ("b", 2), ("c", 1))]
        await asyncio.sleep(0)
        await engine.abort("a")
        await engine.abort(["b", "c"])
        results = await asyncio.gather(*streams)
        engine.shutdown()
        return core.aborted, results

    aborted, results = asyncio.run(run())
    assert [re.sub("-[0-9a-f]{8}$", "", request_id) for request_id in aborted] == ["a", "0_b", "1_b", "c"]
    # CUMULATIVE: b's two sequences end in one abort, before its consumer runs, so their outputs reach it merged into
    # one (vLLM's RequestOutputCollector) that holds both completions and finishes the request
    assert [[(out.request_id, out.finished, [c.index for c in out.outputs]) for out in outs] for outs in results] == [
        [("a", True, [0])], [("b", True, [0, 1])], [("c", True, [0])]]
    assert {out.outputs[0].finish_reason for outs in results for out in outs} == {"abort"}


def test_async_llm_generate_takes_vllms_prompt_text(llm):
    """vLLM's AsyncLLM.generate(prompt_text=...) keyword, which vLLM uses only for a request already processed: for a
    prompt, the outputs' prompt is the prompt's own text."""
    async def run():
        engine = AsyncLLM(llm.llm_engine.config, llm.get_tokenizer(), SilentEngineCore())

        async def outputs() -> list:
            return [out async for out in engine.generate("Hello", SamplingParams(), "p", prompt_text="Bye")]

        stream = asyncio.create_task(outputs())
        await asyncio.sleep(0)
        await engine.abort("p")
        result = await stream
        engine.shutdown()
        return result

    assert [(out.prompt, out.outputs[0].finish_reason) for out in asyncio.run(run())] == [("Hello", "abort")]


def test_async_llm_abort_of_an_internal_id_stops_that_request(llm):
    """vLLM's AsyncLLM.abort(request_id, internal=True): the id is the unique one the request runs under
    (add_request's collector.request_id); its consumer gets the abort output, under the id it gave."""
    async def run():
        core = SilentEngineCore()
        engine = AsyncLLM(llm.llm_engine.config, llm.get_tokenizer(), core)
        collector = await engine.add_request("d", {"prompt_token_ids": [1, 2]}, SamplingParams())
        await engine.abort(collector.request_id, internal=True)
        output = await collector.get()
        engine.shutdown()
        return core.aborted, collector.request_id, output

    aborted, request_id, output = asyncio.run(run())
    assert aborted == [request_id] and request_id.startswith("d-")
    assert (output.request_id, output.finished, output.outputs[0].finish_reason) == ("d", True, "abort")


def test_bool_token_ids_and_priority_are_their_ints_on_the_wire(llm):
    """The engine process decodes a request strictly typed, a bool being no int there, and one it cannot decode
    stops its input for good (the caller waiting on): the Processor sends a bool among the prompt's token ids, or
    as the priority, as the int it is."""
    import msgspec

    from pagedllm.engine.protocol import EngineCoreRequest

    _, request = llm.llm_engine.processor.process("r", {"prompt_token_ids": [True, 504]}, SamplingParams(),
                                                  priority=True)
    assert (request.prompt_token_ids, request.priority) == ([1, 504], 1)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest) == request


def test_get_metrics_counts_each_request_once_through_preemptions(llm, monkeypatch, caplog):
    """vLLM's LLM.get_metrics(): the server's metrics as objects, with stat logging on (off by default offline, as
    vLLM's, where asking for them is an error). A cache too small for all four
    requests preempts some; each still counts its prompt, tokens and success once, and its preemptions. The stats
    line is logged too, as vLLM's LLM logs it. Requests sleep() aborts count as finished with "abort", as the abort
    outputs vLLM's engine sends for them do."""
    from pagedllm import LLM
    from pagedllm.metrics.reader import Counter, Gauge, Histogram
    from tests.e2e.conftest import in_process_llm

    with pytest.raises(ValueError, match="disable_log_stats=False"):
        llm.get_metrics()
    with pytest.raises(ValueError, match="disable_log_stats must be True or False"):
        LLM(disable_log_stats="no")
    monkeypatch.setenv("PAGEDLLM_LOG_STATS_INTERVAL", "0")
    caplog.set_level(logging.INFO, logger="pagedllm.metrics.loggers")
    logged = in_process_llm(dtype="float32", max_model_len=512, num_kv_blocks=8, enforce_eager=True,
                            disable_log_stats=False)
    try:
        prompts = [{"prompt_token_ids": list(range(1000 + 100 * i, 1020 + 100 * i))} for i in range(4)]
        outputs = logged.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
        num_preemptions = logged.get_stats().num_preemptions
        assert num_preemptions > 0
        assert [out.metrics.num_generation_tokens for out in outputs] == [20] * 4
        assert sum(out.metrics.num_preemptions for out in outputs) == num_preemptions
        metrics = {(m.name, m.labels.get("finished_reason")): m for m in logged.get_metrics()}
        logged.enqueue(prompts[:2], SamplingParams(max_tokens=20))
        logged.sleep(level=0)
        assert logged.wake_up() is True
        assert [o.outputs[0].finish_reason for o in logged.wait_for_completion(use_tqdm=False)] == ["abort"] * 2
        aborted = [m.value for m in logged.get_metrics()
                   if m.name == "pagedllm:request_success" and m.labels["finished_reason"] == "abort"]
    finally:
        logged.shutdown()
    assert aborted == [2] and metrics["pagedllm:request_success", "abort"].value == 0
    success = metrics["pagedllm:request_success", "length"]
    assert isinstance(success, Counter) and success.value == 4
    assert success.labels == {"model_name": "smollm2-135m-instruct", "engine": "0", "finished_reason": "length"}
    assert metrics["pagedllm:request_success", "stop"].value == 0
    assert metrics["pagedllm:prompt_tokens", None].value == metrics["pagedllm:generation_tokens", None].value == 80
    assert metrics["pagedllm:num_preemptions", None].value == num_preemptions
    per_request = metrics["pagedllm:request_num_preemptions", None]
    assert isinstance(per_request, Histogram) and (per_request.count, per_request.sum) == (4, num_preemptions)
    ttft = metrics["pagedllm:time_to_first_token_seconds", None]
    assert ttft.count == ttft.buckets["+Inf"] == 4
    running = metrics["pagedllm:num_requests_running", None]
    assert isinstance(running, Gauge) and running.value == 0
    assert any(r.getMessage().startswith("Engine 000: Avg prompt throughput: ") for r in caplog.records)


def test_collective_rpc_runs_a_worker_method_or_a_function_on_every_worker(llm):
    """vLLM's LLM.collective_rpc(method, timeout, args, kwargs) and apply_model(func): a Worker method by name, or a
    function (here a closure, sent to the engine process with cloudpickle) called with the worker first; the list of
    the workers' results (one worker here)."""
    offset = 40
    assert llm.collective_rpc("check_health") == [True]
    assert llm.collective_rpc(lambda worker, a, b=0: (worker.rank.rank, a + b + offset), None, (1,), {"b": 2}) == [
        (0, 43)]
    assert llm.apply_model(lambda model: sum(p.numel() for p in model.parameters()) > 0) == [True]


def test_a_collective_rpc_that_raises_names_it_and_the_engine_serves_on(llm):
    """As vLLM's: a worker method that raises fails the call with an error naming it; the engine is not failed."""
    def explode(worker):
        raise ValueError("boom")

    with pytest.raises(RuntimeError, match=r"collective_rpc no_such_method failed: worker rank 0 raised "
                                           r"AttributeError: 'Worker' object has no attribute 'no_such_method'$"):
        llm.collective_rpc("no_such_method")
    with pytest.raises(RuntimeError, match="explode failed: worker rank 0 raised ValueError: boom$"):
        llm.collective_rpc(explode)
    assert len(llm.generate("Hi", SamplingParams(max_tokens=2, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids) == 2
    assert llm.collective_rpc("check_health") == [True]


def test_sleep_drops_the_kv_cache_and_wake_up_makes_it_anew(llm):
    """vLLM's LLM.sleep / wake_up: level 1 gives the KV cache back (the weights stay, in host memory), wake_up makes
    it anew and the engine generates as before; level 0 only stops scheduling. While asleep generate() raises rather
    than wait for ever (with no prompts, it returns [], as vLLM's); bad arguments are ValueErrors naming them, before
    anything happens."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    before = llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0].token_ids
    kv_caches = lambda worker: len(worker.model_runner.kv_caches)  # noqa: E731
    assert llm.collective_rpc(kv_caches)[0] > 0
    llm.sleep()
    assert llm.llm_engine.is_sleeping() and llm.collective_rpc(kv_caches) == [0]
    with pytest.raises(RuntimeError, match=r"asleep \(sleep\(\)\); call wake_up\(\)"):
        llm.generate("Hi", params, use_tqdm=False)
    # with nothing to run, vLLM's loop ends at once, asleep or not: [] back
    assert llm.generate([], params) == llm.chat([], params) == llm.wait_for_completion() == []
    assert llm.wake_up(["weights"]) is False and llm.llm_engine.is_sleeping()  # the KV cache still asleep
    assert llm.wake_up() is True and not llm.llm_engine.is_sleeping() and llm.collective_rpc(kv_caches)[0] > 0
    assert llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0].token_ids == before

    llm.sleep(level=0, mode="keep")
    assert llm.llm_engine.is_sleeping() and llm.collective_rpc(kv_caches)[0] > 0
    assert llm.wake_up(tags=["scheduling"]) is True
    for call, message in ((lambda: llm.sleep(3), "level must be 0, 1 or 2, got 3"),
                          (lambda: llm.sleep(mode="drain"), "mode must be 'abort', 'wait' or 'keep', got 'drain'"),
                          (lambda: llm.wake_up(["gpu"]), r"tags must be of .*got \['gpu'\]")):
        with pytest.raises(ValueError, match=message):
            call()
    assert not llm.llm_engine.is_sleeping()


def test_sleep_aborts_the_enqueued_requests_which_wait_for_completion_returns(llm):
    """vLLM's LLM.sleep() with mode "abort": the requests enqueue() queued end, and wait_for_completion() returns
    them finished with "abort", as vLLM's engine sends each one's abort output."""
    request_ids = llm.enqueue(["One, two,", "The sky is"], SamplingParams(max_tokens=3))
    llm.sleep(level=0)
    assert llm.llm_engine.get_num_unfinished_requests() == 2  # as vLLM's: until their abort outputs are returned
    assert llm.wake_up() is True
    outputs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outputs] == request_ids
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outputs)
    assert not llm.llm_engine.has_unfinished_requests() and llm.llm_engine.get_num_unfinished_requests() == 0


def test_sleep_with_mode_wait_finishes_the_requests_in_flight_first(llm):
    """vLLM's LLM.sleep(mode="wait") (its engine in a process of its own): the engine runs the requests in flight to
    their end, then sleeps; wait_for_completion() returns them whole, not aborted, the engine still asleep, as
    vLLM's (with a request the engine holds asleep, it raises rather than wait for ever)."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    request_ids = llm.enqueue(["One, two,", "The sky is"], params)
    llm.sleep(level=1, mode="wait")
    assert llm.llm_engine.is_sleeping()
    outputs = llm.wait_for_completion(use_tqdm=False)
    llm.enqueue("Hi", params)
    with pytest.raises(RuntimeError, match="asleep"):
        llm.wait_for_completion(use_tqdm=False)
    assert llm.wake_up() is True
    assert len(llm.wait_for_completion(use_tqdm=False)[0].outputs[0].token_ids) == 4
    assert [o.request_id for o in outputs] == request_ids
    assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 4 for o in outputs)
    assert [o.outputs[0].token_ids for o in outputs] == [
        o.outputs[0].token_ids for o in llm.generate(["One, two,", "The sky is"], params, use_tqdm=False)]


def test_start_and_stop_profile_write_each_workers_torch_trace(llm, tmp_path):
    """vLLM's LLM.start_profile / stop_profile with profiler_config={"profiler": "torch", "torch_profiler_dir": ...}:
    the worker's trace lands in the directory under the prefix; without a profiler_config, a second start, or a bad
    prefix or config, an error that says why, and the engine serves on."""
    from pagedllm.config import ProfilerConfig

    with pytest.raises(RuntimeError, match="Profiling is not enabled"):
        llm.start_profile()
    with pytest.raises(ValueError, match="profile_prefix must be 1-128 ASCII characters"):
        llm.start_profile("../escape")
    for kwargs, message in (({"delay_iterations": -1}, "delay_iterations must be greater than or equal to 0"),
                            ({"max_iterations": 5}, "max_iterations=5: the profiler traces from start_profile to "
                                                    "stop_profile only")):
        with pytest.raises(ValueError, match=message):
            llm.start_profile(**kwargs)
    with pytest.raises(ValueError, match="torch_profiler_dir must be set"):
        ProfilerConfig.from_dict({"profiler": "torch"})
    with pytest.raises(ValueError, match="profiler_config profiler must be 'torch'"):
        ProfilerConfig.from_dict({"profiler": "cuda", "torch_profiler_dir": str(tmp_path)})
    with running_llm(dtype="float32", max_model_len=256, kv_cache_memory="32MiB",
                     profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path)}) as profiled:
        profiled.start_profile("run1", delay_iterations=0, max_iterations=None)
        with pytest.raises(RuntimeError, match="A profiling session is already active"):
            profiled.start_profile()
        profiled.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)
        profiled.stop_profile()
        assert [p.name.split(".")[0] for p in tmp_path.iterdir()] == ["run1_dp0_pp0_tp0"]
        assert next(tmp_path.iterdir()).name.endswith(".pt.trace.json.gz")


def test_skip_tokenizer_init_generates_from_token_ids_without_text(llm):
    """vLLM's LLM(skip_tokenizer_init=True): no tokenizer; token-id prompts generate the tokens they do with one, and
    outputs have no text. A text prompt, chat, beam search, structured outputs and get_tokenizer() (LLM's, LLMEngine's,
    AsyncLLM's) are ValueErrors."""

    async def async_llm_tokenizer(config):
        engine = AsyncLLM(config, None, SilentEngineCore())
        try:
            return engine.get_tokenizer()
        finally:
            engine.shutdown()

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    prompt = llm.get_tokenizer().encode("The capital of France is")
    expected = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    with running_llm(dtype="float32", max_model_len=256, kv_cache_memory="32MiB", skip_tokenizer_init=True) as bare:
        output = bare.generate([prompt], params, use_tqdm=False)[0]
        assert output.outputs[0].token_ids == expected.token_ids and output.outputs[0].text == ""
        assert output.prompt is None and output.prompt_token_ids == prompt
        for call, message in ((lambda: bare.generate("Hi", use_tqdm=False), "text prompts need a tokenizer"),
                              (lambda: bare.get_tokenizer(), "skip_tokenizer_init=True"),
                              (lambda: bare.llm_engine.get_tokenizer(), "skip_tokenizer_init=True"),
                              (lambda: asyncio.run(async_llm_tokenizer(bare.llm_engine.config)),
                               r"^Tokenizer not available when `skip_tokenizer_init=True`$"),
                              (lambda: bare.chat([{"role": "user", "content": "Hi"}], use_tqdm=False),
                               "skip_tokenizer_init=True"),
                              (lambda: bare.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=2)),
                               "skip_tokenizer_init=True"),
                              (lambda: bare.generate([prompt], SamplingParams(
                                  structured_outputs=StructuredOutputsParams(choice=["a", "b"])), use_tqdm=False),
                               "Structured outputs requires a tokenizer")):
            with pytest.raises(ValueError, match=message):
                call()
        assert not bare.llm_engine.has_unfinished_requests()


def test_world_size_supported_tasks_and_mm_cache_reset_are_vllms(llm):
    """vLLM's LLM.get_world_size (ranks, with data parallelism or without), LLMEngine.get_supported_tasks of a
    generative model (LLM.supported_tasks too, and its runner_type, the model config's), LLM.reset_mm_cache, which
    has nothing to reset for a text-only model, and the configs under vLLM's attribute names (LLM.model_config,
    LLMEngine.model_config and vllm_config)."""
    assert llm.model_config is llm.llm_engine.model_config is llm.llm_engine.vllm_config.model_config
    assert llm.supported_tasks == ("generate",)
    assert llm.runner_type == llm.model_config.runner_type == "generate"
    assert llm.model_config.max_model_len == llm.llm_engine.config.scheduler_config.max_model_len
    assert llm.get_world_size() == llm.get_world_size(include_dp=False) == 1
    assert llm.llm_engine.get_supported_tasks() == ("generate",)
    assert llm.reset_mm_cache() is None


def test_the_pooling_api_refuses_a_generative_model_as_vllms(llm):
    """vLLM's LLM.encode, embed, classify and score on a generative model (every model here): its ValueError, with
    its first sentence, never an AttributeError; encode's check of a plugin's ``data`` prompt comes first, as vLLM's.
    Their arguments are vLLM's (keyword-only where its are), and nothing reaches the engine."""
    for call in (lambda: llm.encode("Hi"), lambda: llm.encode(["Hi", "there"], pooling_task="embed"),
                 lambda: llm.embed("Hi", use_tqdm=False), lambda: llm.classify([[1, 2, 3]], pooling_params=None),
                 lambda: llm.encode({"data": [1.0]}, pooling_task="plugin")):
        with pytest.raises(ValueError, match=r"^LLM\.encode\(\) is only supported for pooling models\. "):
            call()
    with pytest.raises(ValueError, match=r"^The 'data' field is only supported for the 'plugin' pooling task\.$"):
        llm.embed({"data": [1.0]})
    with pytest.raises(ValueError, match=r"^LLM\.score\(\) is only supported for pooling models\. "):
        llm.score("What is the capital of France?", ["Paris.", "Berlin."], chat_template=None)
    for call in (lambda: llm.embed("Hi", None), lambda: llm.score(data_1="a", data_2="b")):
        with pytest.raises(TypeError):
            call()
    assert not llm.llm_engine.has_unfinished_requests()


def test_async_llm_encode_refuses_a_generative_model_as_vllms():
    """vLLM's AsyncLLM.encode on a generative model: its ValueError, with its first words, raised by the first step
    of the iteration (encode is an async generator, as vLLM's), before anything reaches an engine (none here)."""
    outputs = AsyncLLM.encode(object.__new__(AsyncLLM), "Hi", None, "req-0", priority=0, tokenization_kwargs=None)

    async def first():
        return await anext(outputs)

    with pytest.raises(ValueError, match=r"^This model does not support pooling\. .*no pooling runner"):
        asyncio.run(first())


def test_repr_is_the_models_module_tree_as_vllms(llm):
    """vLLM's repr(llm): the model's module tree, from the worker (the engine runs in its own process), its run of
    identical decoder layers printed once; asked of the engine once and kept."""
    text = repr(llm)
    num_layers = llm.model_config.num_layers
    assert text.startswith("LlamaForCausalLM(\n")
    assert f"(0-{num_layers - 1}): {num_layers} x LlamaDecoderLayer(" in text
    assert repr(llm) is text


def test_enqueue_then_wait_for_completion_returns_the_queued_requests_outputs(llm):
    """vLLM's LLM.enqueue (request ids back, nothing run, bad input refused whole) and wait_for_completion (every
    queued request's output, in queue order); a generate() meanwhile runs them with its own, returning its own."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = llm.enqueue(["One, two,", "The sky is"], params)
    assert len(first) == 2 and llm.llm_engine.get_num_unfinished_requests() == 2
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.enqueue([{"prompt_token_ids": [5]}, {"prompt_token_ids": [10**9]}])
    assert llm.llm_engine.get_num_unfinished_requests() == 2
    alone = llm.generate("Hi", params, use_tqdm=False)
    assert [o.prompt for o in alone] == ["Hi"]
    second = llm.enqueue({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=5, ignore_eos=True))
    with pytest.raises(ValueError, match="output_type must be RequestOutput"):  # vLLM's pooling outputs: none here
        llm.wait_for_completion(BeamSearchParams, use_tqdm=False)
    outputs = llm.wait_for_completion(RequestOutput, use_tqdm=False)  # vLLM's output_type, positional
    assert [o.request_id for o in outputs] == first + second
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 3, 5]
    assert outputs[0].outputs[0].token_ids == llm.generate("One, two,", params, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.wait_for_completion(use_tqdm=False) == []


def test_enqueue_while_asleep_at_level_0_then_waking_the_scheduler_runs_them_all(llm):
    """vLLM's recipe for queueing every request before any is scheduled: sleep(level=0), enqueue, then
    wake_up(tags=["scheduling"]); wait_for_completion while still asleep raises rather than wait for ever."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.sleep(level=0)
    try:
        request_ids = llm.enqueue(["One, two,", "The sky is"], params)
        with pytest.raises(RuntimeError, match=r"asleep \(sleep\(\)\); call wake_up\(\)"):
            llm.wait_for_completion(use_tqdm=False)
    finally:
        assert llm.wake_up(tags=["scheduling"]) is True
    outputs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outputs] == request_ids and all(len(o.outputs[0].token_ids) == 4 for o in outputs)


def test_enqueue_chat_queues_what_chat_would_run(llm):
    """vLLM's LLM.enqueue_chat: the conversations rendered as chat() renders them, queued as enqueue() queues
    prompts (their ids back), wait_for_completion() giving what chat() gives; both take vLLM's use_tqdm."""
    conversations = [[{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "user", "content": "Name a colour."}]]
    params = SamplingParams(temperature=0, max_tokens=8)
    request_ids = llm.enqueue_chat(conversations, params, use_tqdm=False)
    assert len(request_ids) == 2 and llm.llm_engine.get_num_unfinished_requests() == 2
    queued = llm.wait_for_completion(use_tqdm=False)
    direct = llm.chat(conversations, params, use_tqdm=False)
    assert [o.request_id for o in queued] == request_ids
    assert [(o.prompt, o.outputs[0].token_ids) for o in queued] == [(o.prompt, o.outputs[0].token_ids) for o in direct]
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        llm.enqueue_chat(conversations, params, continue_final_message=True)
    assert llm.llm_engine.get_num_unfinished_requests() == 0
    request_ids = llm.enqueue("Hi", params, use_tqdm=False)
    assert [o.request_id for o in llm.wait_for_completion(use_tqdm=False)] == request_ids


def test_release_kv_cache_memory_after_a_level_0_sleep_gives_the_kv_cache_back(llm):
    """vLLM's LLM.release_kv_cache_memory: refused unless paused (sleep(level=0)); then the KV cache goes as
    sleep(level=1) drops it, and wake_up(tags=["kv_cache"]) makes it anew, the engine generating as before."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    before = llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0].token_ids
    kv_caches = lambda worker: len(worker.model_runner.kv_caches)  # noqa: E731
    with pytest.raises(RuntimeError, match="requires a completed pause first"):
        llm.release_kv_cache_memory()
    llm.sleep(level=0)
    llm.release_kv_cache_memory()
    assert llm.collective_rpc(kv_caches) == [0]
    with pytest.raises(RuntimeError, match="released already"):
        llm.release_kv_cache_memory()
    assert llm.wake_up(tags=["kv_cache"]) is True and llm.collective_rpc(kv_caches)[0] > 0
    assert llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0].token_ids == before


def test_llm_chat_template_is_what_chat_renders_with_unless_a_call_gives_one(tmp_path):
    """vLLM's LLM(chat_template=...): a Jinja template or a file holding it, chat()'s template when a call gives
    none; one that is neither is a ValueError before any engine starts."""
    with pytest.raises(ValueError, match=r"chat template \(no template\) looks like a file path"):
        LLM(chat_template="no template")
    (tmp_path / "template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    messages = [{"role": "user", "content": "Hi"}]
    params = SamplingParams(temperature=0, max_tokens=1)
    with running_llm(dtype="float32", max_model_len=256, kv_cache_memory="32MiB",
                     chat_template=str(tmp_path / "template.jinja")) as templated:
        assert templated.chat(messages, params, use_tqdm=False)[0].prompt == "[Hi]"
        assert templated.chat(messages, params, use_tqdm=False, chat_template="{{ messages[0].content }}!")[0].prompt \
            == "Hi!"
