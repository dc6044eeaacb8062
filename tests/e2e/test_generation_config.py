"""The offline LLM samples with the generation config's defaults when generate() gets no sampling_params, as
vLLM's LLM.get_default_sampling_params(); given ones are used as they are."""
from __future__ import annotations

import json

from pagedllm import SamplingParams
from tests.e2e.conftest import in_process_llm


def test_llm_defaults_come_from_the_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5}))
    llm = in_process_llm(dtype="float32", max_model_len=256, kv_cache_memory="32MiB",
                         generation_config=str(tmp_path))
    try:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.max_tokens) == (0.0, 5)
        prompt = "The capital of France is"
        by_default = llm.generate(prompt, use_tqdm=False)[0].outputs[0]
        greedy = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0].outputs[0]
        assert by_default.token_ids == greedy.token_ids and len(greedy.token_ids) == 5
        assert len(llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2),
                                use_tqdm=False)[0].outputs[0].token_ids) == 2
    finally:
        llm.shutdown()
