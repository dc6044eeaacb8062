"""The benchmark harnesses' own logic: compare_report.py's medians pool every round and a ratio > 1 always means
pagedllm did better; bench_decode_bound.py counts the bytes a decode step reads; compare.py names what killed an
engine's process."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from compare_report import markdown, summarize  # noqa: E402

WORKLOADS = {"W1": {"num_requests": 2, "max_tokens": 10}, "W3": {"num_requests": 2, "max_tokens": 10}}


def run(engine, workload, *walls):
    return {"engine": engine, "workload": workload, "samples": [{"wall_s": w} for w in walls]}


def test_ratios_favour_pagedllm_when_it_is_faster_for_rates_and_times():
    runs = [run("pagedllm", "W1", 1.0, 3.0), run("pagedllm", "W1", 2.0),  # two rounds, pooled: median 2.0
            run("vllm", "W1", 4.0), run("pagedllm", "W3", 1.0), run("vllm", "W3", 3.0)]
    w1, w3 = summarize(runs, WORKLOADS, ["pagedllm", "vllm", "transformers"])
    assert w1["figure"] == "output tok/s" and w1["engines"]["pagedllm"] == {"median": 10.0, "min": 20 / 3,
                                                                          "max": 20.0, "n": 3}
    assert w1["pagedllm_better_by"] == {"vllm": 2.0}  # 10 tok/s vs 5 tok/s
    assert w3["figure"] == "wall s" and w3["pagedllm_better_by"] == {"vllm": 3.0}  # 1 s vs 3 s
    table = markdown([w1, w3], ["pagedllm", "vllm", "transformers"])
    assert "| W3 | wall s (lower is better) | 1.00 [1.00-1.00] | 3.00 [3.00-3.00] | n/a | 3.00x | n/a |" in table


def test_prefix_caching_cost_compares_w1_with_and_without_the_cache():
    workloads = {"W1": WORKLOADS["W1"], "W1-nopc": WORKLOADS["W1"]}
    runs = [run("pagedllm", "W1", 2.0), run("pagedllm", "W1-nopc", 1.6), run("vllm", "W1", 4.0)]
    rows = summarize(runs, workloads, ["pagedllm", "vllm"])
    table = markdown(rows, ["pagedllm", "vllm"])
    assert "pagedllm: prefix caching costs 20.0% of W1 output tok/s" in table  # 10 vs 12.5 tok/s
    assert "vllm: prefix caching costs" not in table  # no W1-nopc run of vllm


def test_every_workload_has_figures_and_the_grounded_ones_are_the_engines_own_prompts():
    from compare import VARIANTS, build_workloads  # imports pagedllm, which the report module does not
    from compare_report import FIGURES

    from pagedllm.benchmarks.workloads import grounded_prompt
    from pagedllm.models.hf_config import load_tokenizer

    assert set(FIGURES) == set(VARIANTS)
    workloads = build_workloads(["W4", "W4-8"], smoke=True)
    assert workloads["W4"]["kind"] == "stream" and workloads["W4-8"]["kind"] == "batch"
    assert workloads["W4-8"]["num_requests"] == 8 and workloads["W4"]["max_tokens"] == 8  # smoke: short outputs
    text = load_tokenizer("smollm2-135m-instruct").decode(workloads["W4-8"]["prompts"][3])
    assert grounded_prompt(3).splitlines()[0] in text


def test_decode_bound_counts_each_weight_layout_once():
    """bench_decode_bound's bytes a decode token reads: every linear layer's layout (held by its quant method) and
    the LM head's, a storage two layouts share counted once; a layer on a torch fallback path is refused, not
    counted as nothing."""
    import pytest
    import torch
    from bench_decode_bound import weight_bytes_per_token

    from pagedllm.layers.linear import ReplicatedLinear
    from pagedllm.layers.vocab_embedding import VocabParallelEmbedding

    model = torch.nn.Module()
    model.proj = ReplicatedLinear(64, 32, bias=False, params_dtype=torch.float32)
    model.proj.weight_loader(model.proj.weight, torch.randn(32, 64))
    with pytest.raises(SystemExit, match="proj runs on a torch fallback path"):
        weight_bytes_per_token(model)  # its weight not laid out yet: what a fallback path keeps
    model.proj.quant_method.process_weights_after_loading(model.proj)
    model.embed = VocabParallelEmbedding(100, 64, params_dtype=torch.float32)
    model.embed.weight_loader(model.embed.weight, torch.randn(100, 64))
    model.embed.prepare_projection()
    stored = [layout.panels if layout.panels is not None else layout.data
              for layout in (model.proj.quant_method.dense, model.embed._projection)]
    assert stored[0].shape[-1] * stored[0].shape[-2] >= 32 * 64  # the kernel's layout, padding and all
    expected = sum(t.numel() * t.element_size() for t in stored)
    assert weight_bytes_per_token(model) == (expected, 2)
    model.head = VocabParallelEmbedding(100, 64, params_dtype=torch.float32)
    model.head._projection = model.embed._projection  # a second layout over the same storage: its bytes once
    assert weight_bytes_per_token(model) == (expected, 3)


def test_decode_bound_counts_the_lm_heads_few_rows_layout():
    """A Q8_0 LM head under bf16 panels multiplies one row by its Q8_0 panels: those are its bytes, not the bf16
    panels it keeps for larger steps."""
    import numpy as np
    import pytest
    import torch
    from bench_decode_bound import weight_bytes_per_token
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from pagedllm.layers.gemm_layout import WeightLayout
    from pagedllm.layers.quantization.gguf import GGUFInt4Config
    from pagedllm.layers.vocab_embedding import VocabParallelEmbedding
    from pagedllm.models.gguf_loader import unpack_q8
    from pagedllm.platforms.cpu import bf16_panels_apply

    if not bf16_panels_apply():
        pytest.skip("no bf16 weight panels on this CPU")
    blocks = quantize(np.random.default_rng(0).standard_normal((300, 64), dtype=np.float32),
                      GGMLQuantizationType.Q8_0)
    config = GGUFInt4Config({"embedding.weight": GGMLQuantizationType.Q8_0}, [])
    model = torch.nn.Module()
    model.embed = VocabParallelEmbedding(300, 64, quant_config=config, prefix="embedding")
    for param, part in zip((model.embed.qweight, model.embed.scales), unpack_q8(blocks)):
        param.weight_loader(param, torch.from_numpy(part))
    model.embed.prepare_projection(WeightLayout(bf16_panels=True))
    q8_panels = model.embed._few_rows_projection.panels
    assert weight_bytes_per_token(model) == (q8_panels.numel() * q8_panels.element_size(), 1)


def test_an_engine_killed_by_sigill_is_reported_by_name_with_the_llama_cpp_fix(tmp_path):
    """An engine process that dies of a signal (llama.cpp's AMX build: SIGILL at its first tile load) is named by the
    signal, and SIGILL points at the build without AMX, where the exit status alone (-4) said nothing."""
    from argparse import Namespace

    import pytest
    from compare import Engine, run_engine

    engine = Engine("llamacpp", ["/bin/sh", "-c", 'kill -ILL $$', "runner"])
    args = Namespace(dtype="float32", repeats=1, speculative_config=None, run_timeout=60)
    with pytest.raises(SystemExit, match=r"failed \(killed by SIGILL; .*LLAMA_CMAKE_ARGS"):
        run_engine(engine, {"name": "W2", "prefix_caching": True}, tmp_path / "w.json", tmp_path / "log", args)
