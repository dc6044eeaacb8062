"""Steps replayed from CPU graphs (decode steps, steps with prompt chunks, verify steps) give exactly the tokens of
eager steps, while requests join, leave and cross block boundaries, in float32 dense, 4-bit and W8A8."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams, native
from pagedllm.core.sched.scheduler import Scheduler
from pagedllm.layers.gemm_layout import BF16_MIN_ROWS
from pagedllm.core.sched.spec_budget import SpecDecodeBudget
from pagedllm.native.graph import CpuGraph, GraphReplayError
from pagedllm.worker import cpu_graphs
from pagedllm.worker.model_runner import ModelRunner

pytestmark = pytest.mark.usefixtures("share_loaded_models")  # the tests patch and inspect the worker

PROMPT_LENGTHS = [5, 17, 30, 47, 64, 90, 120, 15, 33, 200]
MAX_GRAPH_BATCH = 6  # fewer than the requests: larger batches run eagerly in between
# A graph replays native kernels only: where the GEMMs are torch's (dense and gguf_int4 without AVX2 or AVX-512,
# int8 without AVX2; cascade attention too) the captures are
# refused and every step runs eagerly, which the token comparisons still check.
CAPTURES = {None: native.gemm() is not None, "gguf_int4": native.gemm_q4() is not None,
            "int8": native.gemm_w8a8() is not None}


def _run(rounds: int = 1, **engine_kwargs) -> tuple[list[list[int]], LLM]:
    """Rounds of prompts of the same lengths (new tokens each round, so no prefix hits): the steps with prompt
    chunks take the same shapes each round, and a shape's graph is captured at its second step."""
    # Prompts without a common prefix: batches sharing a long one attend it by cascade attention, eagerly.
    generator = torch.Generator().manual_seed(0)
    llm = LLM(dtype="float32", max_model_len=1024, max_num_batched_tokens=96, **engine_kwargs)
    # Different output lengths: batches shrink as requests finish; chunked prefill staggers their starts.
    params = [SamplingParams(temperature=0.0, max_tokens=20 + 3 * i, ignore_eos=True)
              for i in range(len(PROMPT_LENGTHS))]
    tokens = []
    for _ in range(rounds):
        prompts = [torch.randint(100, 40000, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens += [o.outputs[0].token_ids for o in outputs]
    return tokens, llm


@pytest.mark.parametrize("quantization", [None, "gguf_int4", "int8"])
def test_graph_replays_match_eager_steps(monkeypatch, quantization):
    monkeypatch.setattr(cpu_graphs, "MAX_GRAPH_BATCH", MAX_GRAPH_BATCH)
    replays = []
    replay = CpuGraph.replay
    monkeypatch.setattr(CpuGraph, "replay", lambda self: replays.append(self) or replay(self))
    graphed, llm = _run(quantization=quantization)
    eager, eager_llm = _run(quantization=quantization, enforce_eager=True)
    assert graphed == eager
    assert eager_llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.step_graphs is None
    if not CAPTURES[quantization]:
        pytest.skip("no native GEMM for these weights here: decode steps ran eagerly, tokens compared")
    graphs = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.step_graphs
    shapes = {shape for shape, static in graphs._by_shape.items() if static.graphs}
    assert shapes and max(n for n, _, _ in shapes) <= MAX_GRAPH_BATCH and not graphs._refused
    assert len(replays) >= 15  # steps of 8 rows or fewer, after the first two requests finish


def test_steps_with_prompt_chunks_replay_graphs_and_match_eager_steps(monkeypatch):
    """Chunked prefill (96 tokens a step) over three rounds of prompts of the same lengths: from the third, the
    steps with prompt chunks replay graphs, some of them after decode rows, with the eager steps' tokens."""
    replays = []
    replay = CpuGraph.replay
    monkeypatch.setattr(CpuGraph, "replay", lambda self: replays.append(self) or replay(self))
    graphed, llm = _run(rounds=3)
    eager, _ = _run(rounds=3, enforce_eager=True)
    assert graphed == eager
    if not CAPTURES[None] or native.paged_prefill() is None:
        pytest.skip("no native GEMM or prefill tiles here: steps with prompt chunks ran eagerly, tokens compared")
    graphs = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.step_graphs
    replayed = {shape for shape, static in graphs._by_shape.items()
                if any(graph in replays for graph in static.graphs.values())}
    assert any(0 < d < n for n, _, d in replayed) and any(d == 0 for _, _, d in replayed)
    assert not graphs._refused


@pytest.mark.skipif(not native.gemm_bf16_uses_amx() or native.dequant_bf16() is None,
                    reason="no AMX tiles here: a bfloat16 model's quantized layers keep their own kernels")
def test_a_bfloat16_gguf_models_long_steps_on_bf16_panels_replay_graphs(monkeypatch):
    """gguf_int4 in a bfloat16 model: steps of BF16_MIN_ROWS rows or more dequantize each Q4 layer into the model's
    bf16 scratch and multiply on AMX tiles; graphs of such steps (prompt chunks up to 128 tokens) replay those calls
    over the same scratch, with the eager engine's tokens, two rounds of prompts of the same lengths."""
    replays = []
    replay = CpuGraph.replay
    monkeypatch.setattr(CpuGraph, "replay", lambda self: replays.append(self) or replay(self))
    generator = torch.Generator().manual_seed(4)
    rounds = [[{"prompt_token_ids": torch.randint(100, 40000, (n,), generator=generator).tolist()}
               for n in (40, 100, 33, 250, 64)] for _ in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for eager in (False, True):
        llm = LLM(dtype="bfloat16", quantization="gguf_int4", max_model_len=1024, max_num_batched_tokens=128,
                  enforce_eager=eager)
        tokens[eager] = [[o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
                         for prompts in rounds]
        if not eager:
            runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
            assert runner.model.model.layers[0].mlp.down_proj.quant_method.packed.bf16_layout is not None
            graphs = runner.step_graphs
            long_steps = [static for (_, t, _), static in graphs._by_shape.items() if t >= BF16_MIN_ROWS]
    assert tokens[False] == tokens[True]
    assert any(graph in static.graphs.values() for static in long_steps for graph in replays)


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
        graphs = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.step_graphs
        if not eager and CAPTURES[None] and native.cascade() is not None:
            keys = {(n, p) for (n, _, _), static in graphs._by_shape.items() for p, _ in static.graphs}
            # The first step's prompts are refused (float32 GEMMs past 128 rows are MKL's), no decode step.
            assert any(p == 288 for _, p in keys) and all(d < n for n, _, d, _, _ in graphs._refused)
    assert outputs[False] == outputs[True]


def test_verify_steps_of_speculative_decoding_replay_graphs_and_match_eager_steps(monkeypatch):
    """Steps verifying n-gram drafts (each request: its token, then 0-4 drafts) replay graphs keyed by their
    requests and tokens; the native prefill kernel reads each request's query start and length from static
    buffers, so one graph serves every split of the step's tokens. A step that captured a graph is not timed for
    dynamic speculation (a capture costs several steps)."""
    replays, captures = [], []
    replay, capture = CpuGraph.replay, CpuGraph.capture
    monkeypatch.setattr(CpuGraph, "replay", lambda self: replays.append(self) or replay(self))
    monkeypatch.setattr(CpuGraph, "capture",
                        lambda self, forward, *run: captures.append(self) or capture(self, forward, *run))
    steps_captured, timed_steps_captured = [], []  # per step run, and per step timed: whether it captured a graph
    execute_model = ModelRunner.execute_model

    def execute_model_noting_captures(self, so):
        before = len(captures)
        output = execute_model(self, so)
        steps_captured.append(len(captures) > before)
        return output

    monkeypatch.setattr(ModelRunner, "execute_model", execute_model_noting_captures)
    record = Scheduler.record_step_time
    monkeypatch.setattr(Scheduler, "record_step_time", lambda self, so, seconds: timed_steps_captured.append(
        steps_captured[-1]) or record(self, so, seconds))
    # Every draft is verified: dynamic speculation, which may run steps draft-free, is not what this test is about.
    monkeypatch.setattr(SpecDecodeBudget, "trim_drafts", lambda self, decodes, only_decodes=False: None)
    code = "def area(width, height):\n    result = width * height\n    return result\n"
    prompts = [f"Copy this code exactly.\n{code}\nCopy:\n", f"Rename result to total in this code.\n{code}\nRenamed:\n",
               "Count: one, two, three, four, five, six,", "The capital of France is"]
    params = [SamplingParams(temperature=0.0, max_tokens=32 + 4 * i, ignore_eos=True) for i in range(len(prompts))]
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    outputs = {}
    for eager in (False, True):
        llm = LLM(dtype="float32", max_model_len=1024, enforce_eager=eager, speculative_config=ngram)
        outputs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if not eager:
            graphed_steps, timed_graphed_steps = list(steps_captured), list(timed_steps_captured)
            graphs = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.step_graphs
            # A verify step: each request its token and up to 4 drafts, every one a chunk (prompt steps: longer).
            verify_graphs = {graph for (n, t, d), static in graphs._by_shape.items() if n < t <= 5 * n and d == 0
                             for graph in static.graphs.values()}
    assert outputs[False] == outputs[True]
    if not (CAPTURES[None] and native.paged_prefill() is not None):
        pytest.skip("no native GEMM or prefill tiles here: verify steps ran eagerly, tokens compared")
    assert verify_graphs and not graphs._refused
    assert sum(graph in verify_graphs for graph in replays) >= 3  # a shape's first step with chunks runs eagerly
    assert any(graphed_steps) and not any(timed_graphed_steps)
    assert len(timed_graphed_steps) == graphed_steps.count(False)  # every other step was timed


def test_prompts_of_nearby_lengths_share_a_graph_padded_to_whole_blocks(monkeypatch):
    """Prompts of 33 to 47 tokens, one at a time: each prompt step is padded to 48 rows (a padding chunk of 1 to
    15 rows in the block past the scheduler's), so all share one shape, captured at the first; the others replay
    its graph, and every request's tokens are the eager engine's."""
    replays = []
    replay = CpuGraph.replay
    monkeypatch.setattr(CpuGraph, "replay", lambda self: replays.append(self) or replay(self))
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(100, 40000, (n,), generator=generator).tolist() for n in (33, 40, 47, 36, 44)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for eager in (False, True):
        llm = LLM(dtype="float32", max_model_len=1024, enforce_eager=eager)
        tokens[eager] = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids
                         for p in prompts]
        if not eager:
            graphs = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.step_graphs
    assert tokens[False] == tokens[True]
    if not CAPTURES[None] or native.paged_prefill() is None:
        pytest.skip("no native GEMM or prefill tiles here: prompt steps ran eagerly, tokens compared")
    padded = graphs._by_shape.get((2, 48, 0))
    assert padded is not None and sum(graph in padded.graphs.values() for graph in replays) == 4


def test_decode_batches_of_nearby_sizes_share_a_graph_padded_to_a_bucket(monkeypatch):
    """Twelve requests finishing one after another: decode steps of 12 down to 1 rows, each padded to its bucket
    (16, 8, 4, 2, 1) by rows before its own that write and read only the padding block, so five decode graphs
    serve them all (the steps of 9 to 12 rows replay the 16-row graph), with every request's tokens those of the
    eager engine. The engine captured every bucket's decode graph at start-up (up to MAX_GRAPH_BATCH rows), each
    without running its kernels (verified by its first replay), and no decode step captures another."""
    replays = []
    replay = CpuGraph.replay
    monkeypatch.setattr(CpuGraph, "replay", lambda self: replays.append(self) or replay(self))
    generator = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(100, 40000, (8 + i,), generator=generator).tolist()}
               for i in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 2 * i, ignore_eos=True) for i in range(12)]
    tokens = {}
    for eager in (False, True):
        llm = LLM(dtype="float32", max_model_len=1024, enforce_eager=eager)
        if not eager:
            graphs = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.step_graphs
            at_start = {shape: dict(static.graphs) for shape, static in graphs._by_shape.items()}
            assert not any(graph.verified for graphs_of in at_start.values() for graph in graphs_of.values())
        tokens[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens[False] == tokens[True]
    if not CAPTURES[None]:
        pytest.skip("no native GEMM here: decode steps ran eagerly, tokens compared")
    buckets = {cpu_graphs.decode_bucket(rows) for rows in range(1, cpu_graphs.MAX_GRAPH_BATCH + 1)}
    assert set(at_start) == {(b, b, b) for b in buckets} and all(len(g) == 1 for g in at_start.values())
    decode_shapes = {shape: static for shape, static in graphs._by_shape.items() if shape[0] == shape[2]}
    assert {shape: static.graphs for shape, static in decode_shapes.items()} == at_start  # none captured since
    replayed = {shape[0] for shape, static in decode_shapes.items()
                if any(graph in static.graphs.values() for graph in replays)}
    assert replayed == {16, 8, 4, 2, 1}
    assert sum(graph in decode_shapes[(16, 16, 16)].graphs.values() for graph in replays) >= 5
    assert all(graph.verified for graph in replays)


def test_a_start_up_graph_that_fails_its_first_replay_leaves_its_steps_eager(monkeypatch):
    """A graph captured without its kernels takes every kernel's status as success: where a kernel refuses its
    arguments at the graph's first replay (simulated here for every start-up graph), that step and its shape's
    later ones run eagerly, with the eager engine's tokens, instead of failing the engine."""
    replay = CpuGraph.replay

    def failing_unverified(self):
        if not self.verified:
            raise GraphReplayError("simulated: a kernel refused its arguments")
        return replay(self)

    monkeypatch.setattr(CpuGraph, "replay", failing_unverified)
    prompts = [{"prompt_token_ids": list(range(200 + 10 * i, 209 + 10 * i))} for i in range(3)]
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 2 * i, ignore_eos=True) for i in range(3)]
    tokens = {}
    for eager in (False, True):
        llm = LLM(dtype="float32", max_model_len=256, kv_cache_memory="16MiB", enforce_eager=eager)
        tokens[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if not eager:
            graphs = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.step_graphs
        llm.shutdown()
    assert tokens[False] == tokens[True]
    if not CAPTURES[None]:
        pytest.skip("no native GEMM here: decode steps ran eagerly, tokens compared")
    replayed = {(rows, rows, rows) for rows in (4, 2, 1)}  # 3 requests' decode steps, then 2's, then 1's
    assert {key[:3] for key in graphs._refused} >= replayed
    assert not any(graphs._by_shape[shape].graphs for shape in replayed)


def test_a_shape_with_prompt_chunks_gets_static_buffers_at_its_second_step_and_the_least_recently_used_go_first(
        monkeypatch):
    """The first step of a shape with prompt chunks beside decode rows (or of more than two chunks) runs eagerly
    (no buffers, no capture: such a shape may not come again); a decode step's, or a lone prompt's, has its buffers
    at once; at most MAX_GRAPH_SHAPES shapes keep their buffers and graphs, the least recently used dropped first,
    and a dropped shape's refusals with it."""
    monkeypatch.setattr(cpu_graphs, "MAX_GRAPH_SHAPES", 2)
    graphs = cpu_graphs.StepGraphs(model=None, kv_caches=[], block_size=16, block_table_width=4)
    assert graphs._static_inputs((2, 48, 0)) is not None  # a lone prompt and its padding chunk
    graphs._by_shape.clear()
    chunks, more_chunks, decodes = (2, 48, 1), (3, 64, 0), (3, 3, 3)
    assert graphs._static_inputs(chunks) is None
    kept = graphs._static_inputs(chunks)
    assert kept is not None and graphs._static_inputs(chunks) is kept
    graphs._refused.add((*chunks, 0, False))
    assert graphs._static_inputs(decodes) is not None
    graphs._static_inputs(more_chunks)
    assert list(graphs._by_shape) == [chunks, decodes]  # more_chunks only seen
    graphs._static_inputs(more_chunks)  # kept: chunks, the least recently used, is dropped
    assert list(graphs._by_shape) == [decodes, more_chunks] and not graphs._refused
    assert graphs._static_inputs(chunks) is None  # seen anew
