"""Decode steps replayed from CPU graphs give exactly the tokens of eager steps, while requests join, leave and
cross block boundaries, in float32 dense and 4-bit."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams, native
from pagedllm.native.graph import CpuGraph
from pagedllm.worker import cpu_graphs

pytestmark = pytest.mark.usefixtures("share_loaded_models")  # the tests patch and inspect the worker

PROMPT_LENGTHS = [5, 17, 30, 47, 64, 90, 120, 15, 33, 200]
MAX_GRAPH_BATCH = 6  # fewer than the requests: larger batches run eagerly in between
# A graph replays native kernels only: where the GEMMs are torch's (dense without AVX2 or AVX-512, gguf_int4
# without AVX-512; cascade attention too without AVX-512) the captures are refused and every step runs
# eagerly, which the token comparisons still check.
CAPTURES = {None: native.gemm() is not None, "gguf_int4": native.gemm_q4() is not None}


def _run(**engine_kwargs) -> tuple[list[list[int]], LLM]:
    # Prompts without a common prefix: batches sharing a long one attend it by cascade attention, eagerly.
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    llm = LLM(dtype="float32", max_model_len=1024, max_num_batched_tokens=96, **engine_kwargs)
    # Different output lengths: batches shrink as requests finish; chunked prefill staggers their starts.
    params = [SamplingParams(temperature=0.0, max_tokens=20 + 3 * i, ignore_eos=True)
              for i in range(len(PROMPT_LENGTHS))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm


@pytest.mark.parametrize("quantization", [None, "gguf_int4"])
def test_graph_replays_match_eager_steps(monkeypatch, quantization):
    monkeypatch.setattr(cpu_graphs, "MAX_GRAPH_BATCH", MAX_GRAPH_BATCH)
    replays = []
    replay = CpuGraph.replay
    monkeypatch.setattr(CpuGraph, "replay", lambda self: replays.append(self) or replay(self))
    graphed, llm = _run(quantization=quantization)
    eager, eager_llm = _run(quantization=quantization, enforce_eager=True)
    assert graphed == eager
    assert eager_llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.decode_graphs is None
    if not CAPTURES[quantization]:
        pytest.skip("no native GEMM for these weights here: decode steps ran eagerly, tokens compared")
    graphs = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.decode_graphs
    sizes = {n for n, static in graphs._by_size.items() if static.graphs}
    assert sizes and max(sizes) <= MAX_GRAPH_BATCH and not graphs._refused
    assert len(replays) >= 15  # steps of 8 rows or fewer, after the first two requests finish


def test_graphs_with_cascade_attention_over_a_shared_prefix_match_eager_steps():
    generator = torch.Generator().manual_seed(1)
    shared = torch.randint(100, 40000, (300,), generator=generator).tolist()  # 18 whole blocks: cascade
    prompts = [{"prompt_token_ids": shared + torch.randint(100, 40000, (10,), generator=generator).tolist()}
               for _ in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=12 + 2 * i, ignore_eos=True) for i in range(len(prompts))]
    outputs = {}
    for eager in (False, True):
        llm = LLM(dtype="float32", max_model_len=1024, enforce_eager=eager)
        outputs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        graphs = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.decode_graphs
        if not eager and CAPTURES[None] and native.cascade() is not None:
            keys = {(n, p) for n, static in graphs._by_size.items() for p, _ in static.graphs}
            assert any(p == 288 for _, p in keys) and not graphs._refused
    assert outputs[False] == outputs[True]
