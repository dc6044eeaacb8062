"""kv_cache_dtype (fp8_e4m3, fp8_e5m2, int8): what a one-byte cache keeps of a row, the capacity it buys, the errors
for what it does not take, and the real model's agreement with its full-precision cache, teacher-forced. (Every
attention kernel over these caches: tests/test_paged_attention.py.)"""

import argparse

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from pagedllm import SamplingParams, native
from pagedllm.distributed.parallel_state import ParallelRank
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.openai.cli_args import make_arg_parser
from pagedllm.kv_cache_dtype import dequantize_rows, quantize_rows
from pagedllm.models.hf_config import load_hf_config
from pagedllm.models.loader import get_model
from pagedllm.models.resolve import DEFAULT_MODEL, resolve_model
from pagedllm.native import fused
from pagedllm.native.graph import CpuGraph
from pagedllm.platforms.interface import KernelChoice
from pagedllm.worker.worker import kv_cache_bytes_per_block
from tests.conftest import DENSE_SMOLLM_ARGS
from tests.e2e.conftest import in_process_llm
from tests.model_fixtures import Chunk, PagedBatchRunner, teacher_forced
from tests.test_int8_quantization import PROMPTS


def test_quantized_rows_round_trip():
    """fp8 saturates at its largest finite value instead of overflowing; int8 rows keep max |x| / 127 as their
    scale, so each value comes back within half a step."""
    x = torch.randn(50, 3, 64) * 4
    x[0, 0, 0], x[1, 0, 0] = 1e6, -1e6
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        back = dequantize_rows(quantize_rows(x, dtype), 64, torch.float32)
        assert back[0, 0, 0] == torch.finfo(dtype).max and back[1, 0, 0] == -torch.finfo(dtype).max
        assert torch.isfinite(back).all()
    rows = quantize_rows(x, torch.int8)
    assert rows.shape == (50, 3, 68) and rows.dtype == torch.int8
    step = x.abs().amax(-1, keepdim=True) / 127
    assert ((dequantize_rows(rows, 64, torch.float32) - x).abs() <= step / 2 + 1e-6 * x.abs()).all()
    assert not dequantize_rows(quantize_rows(torch.zeros(2, 64), torch.int8), 64, torch.float32).any()


def test_capacity():
    """A block of a one-byte cache takes half a bf16 block's bytes (int8 also its rows' scales), so the same
    memory holds about twice the tokens."""
    def per_block(cache_dtype: str) -> int:
        return kv_cache_bytes_per_block(EngineArgs(dtype="bfloat16", kv_cache_dtype=cache_dtype).create_engine_config())

    bf16 = per_block("auto")
    assert per_block("fp8") == per_block("fp8_e5m2") == bf16 // 2
    assert per_block("int8") == bf16 * (64 + 4) // (2 * 64)  # SmolLM2's head size 64, a 4-byte scale a row


def test_bad_kv_cache_dtype_is_a_config_error():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2, int8"):
        EngineArgs(kv_cache_dtype="fp16").create_engine_config()
    parser = make_arg_parser(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp4"])
    assert parser.parse_args(["--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"


# Teacher-forced agreement with the float32 cache over these prompts' 64-token greedy continuations, as measured
# (docs/benchmarks.md has the figures: int8 0.991, fp8_e4m3 0.969 on an AVX-512 machine), less a margin for other
# machines' kernels. fp8_e5m2 (0.928 there) differs from e4m3 only in how its bytes widen, which the attention tests
# check on every path; one engine fewer keeps the suite's time.
MIN_AGREEMENT = {"int8": 0.97, "fp8_e4m3": 0.9}


def test_real_model_agrees_with_the_full_precision_cache(dense_smollm):
    """SmolLM2 with each one-byte cache, teacher-forced on its own greedy continuations with a float32 cache: the
    top token agrees at most positions, log-probs are near (every prompt's prefill and every forced token's key
    and value go through the quantized cache: prompt_logprobs attend to the cached, quantized rows). The engines
    share the float32 reference's loaded model (the cache's dtype is the engine's, not the model's)."""
    reference = dense_smollm
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    expected = [o.prompt_token_ids + list(o.outputs[0].token_ids)
                for o in reference.generate(PROMPTS, greedy, use_tqdm=False)]
    for cache_dtype, least in MIN_AGREEMENT.items():
        # prefills only: no graphs
        forced_only = in_process_llm(kv_cache_dtype=cache_dtype, enforce_eager=True, **DENSE_SMOLLM_ARGS)
        try:
            ranks, deltas = teacher_forced(forced_only, reference, expected, 64)
        finally:
            forced_only.shutdown()
        agreement = sum(rank == 1 for rank in ranks) / len(ranks)
        print(f"{cache_dtype} cache: teacher-forced agreement {agreement:.3f}, max |logprob diff| "
              f"{max(deltas):.3f}")
        assert agreement >= least and 0 < max(deltas) < 2.0


# A checkpoint's fp8 KV cache scales (vLLM's per-tensor k_scale and v_scale) for keys of ~250 and values of ~0.002
# (_save_llama_with_kv_scales): divided by them, both sit well inside fp8 e4m3's range; unscaled, keys past 448
# saturate and values fall among its subnormals (steps of 2^-9).
K_SCALE, V_SCALE = 4.0, 0.002


def _save_llama_with_kv_scales(path, kv_scale_names: tuple[str, ...]) -> None:
    """A tiny random Llama (head size 64, which the prefill tiles take) whose q_proj weights are divided by what its
    k_proj ones are multiplied by (1000), and its o_proj ones by its v_proj ones' (0.01): it computes as the plain
    model does, its keys of ~250 and values of ~0.002. Each layer has the scale tensors ``kv_scale_names`` (within
    self_attn, each named for the scale it holds: "k_scale", "k_proj.k_scale", "kv_scale", ...)."""
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tensors = load_file(str(path / "model.safetensors"))
    factors = {"q_proj": 1e-3, "k_proj": 1e3, "v_proj": 1e-2, "o_proj": 1e2}
    for name in list(tensors):
        module = name.split(".")[-2]
        if module in factors:
            tensors[name] = tensors[name] * factors[module]
    for i in range(config.num_hidden_layers):
        for scale_name in kv_scale_names:
            value = V_SCALE if scale_name.split(".")[-1] == "v_scale" else K_SCALE
            tensors[f"model.layers.{i}.self_attn.{scale_name}"] = torch.tensor([value])
    save_file(tensors, str(path / "model.safetensors"))


def _logits(path, cache_dtype: torch.dtype) -> torch.Tensor:
    """The model's float32 logits over a prompt and then two decode steps (one row each), its KV cache of
    ``cache_dtype``."""
    config = load_hf_config(str(path))
    runner = PagedBatchRunner(get_model(str(path), config, KernelChoice(torch.float32)), config, block_size=16,
                              dtype=cache_dtype)
    tokens = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = runner.step({0: tokens}, [Chunk(0, 0, 38)])
    logits += [runner.step({0: tokens}, [Chunk(0, pos, 1)])[0] for pos in (38, 39)]
    return torch.cat(logits)


def _use_attention_path(path: str, monkeypatch) -> None:
    """The fp8 cache's engines of this test run on ``path``: "torch" (no native attention kernels or KV writer) or
    "native" (skipped where the kernels are not built)."""
    if path == "torch":
        monkeypatch.setattr(native, "paged_decode", lambda kv_dtype=torch.float32: None)
        monkeypatch.setattr(native, "paged_prefill", lambda kv_dtype=torch.float32: None)
        monkeypatch.setattr(fused, "write_kv", lambda *rows_and_scales: False)
    elif native.paged_decode(torch.float8_e4m3fn) is None:
        pytest.skip("no native kernels here")


@pytest.mark.parametrize("path", ["native", "torch"])
def test_fp8_cache_applies_the_checkpoints_kv_scales(tmp_path, monkeypatch, path):
    """vLLM scales an fp8 cache by the checkpoint's k_scale and v_scale: the cache holds k / k_scale and v / v_scale,
    and attention reads them back times those. With them the fp8 cache's logits stay near the float32 cache's, on
    the native kernels (the writes, the prefill tiles and the decode rows) and on the torch path alike; the same
    checkpoint without its scales (as they were ignored) saturates its keys and loses its values, far off. vLLM's
    names for them load alike: ModelOpt's k_proj.k_scale, and the deprecated kv_scale standing for both."""
    _use_attention_path(path, monkeypatch)
    _save_llama_with_kv_scales(tmp_path / "scaled", ("k_scale", "v_scale"))
    _save_llama_with_kv_scales(tmp_path / "unscaled", ())
    reference = _logits(tmp_path / "unscaled", torch.float32)
    scaled = _logits(tmp_path / "scaled", torch.float8_e4m3fn)
    unscaled = _logits(tmp_path / "unscaled", torch.float8_e4m3fn)
    error, error_unscaled = ((x - reference).abs().max().item() for x in (scaled, unscaled))
    print(f"{path}: max |logit error| with the scales {error:.4f}, without {error_unscaled:.4f}, "
          f"max |logit| {reference.abs().max().item():.3f}")
    assert error < 0.1 * reference.abs().max() and error < error_unscaled / 4
    assert torch.equal(_logits(tmp_path / "scaled", torch.float32), reference)  # only an fp8 cache is scaled
    _save_llama_with_kv_scales(tmp_path / "modelopt", ("k_proj.k_scale", "v_proj.v_scale"))
    assert torch.equal(_logits(tmp_path / "modelopt", torch.float8_e4m3fn), scaled)
    _save_llama_with_kv_scales(tmp_path / "deprecated", ("kv_scale",))
    attention = get_model(str(tmp_path / "deprecated"), load_hf_config(str(tmp_path / "deprecated")),
                          KernelChoice(torch.float32)).model.layers[1].self_attn.attn.impl
    assert torch.equal(attention.kv_scales, torch.full((2, 1), K_SCALE))  # k_scale and v_scale of its one KV head


# _save_llama_with_head_scales's model: its two KV heads' keys are ~200 and ~0.0002, its values ~0.00002 and ~2 (each
# head's k_proj and v_proj rows multiplied by these factors, its query heads' q_proj rows and o_proj columns divided);
# HEAD_SCALES, per KV head (rows k_scale and v_scale, vLLM's "attn_head" ones), bring each to ~50, well inside fp8
# e4m3's range. One scale a tensor (the heads' max) rounds head 1's keys and head 0's values to 0, below e4m3's
# subnormals.
HEAD_FACTORS = {"k": (1e3, 1e-3), "v": (1e-4, 10.0)}
HEAD_SCALES = torch.tensor([[4.0, 4e-6], [4e-7, 0.04]])
SHARPNESS = 8.0  # the queries' factor: a random model's attention is near uniform, each head's output the mean of
# many values, which rounding its keys (even to 0) would hardly change; multiplied, the scores pick a few keys out


def _save_llama_with_head_scales(path, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """A tiny random Llama of two KV heads (two query heads each, head size 64) that computes as the plain model does
    but for its queries (times SHARPNESS), its KV heads' magnitudes HEAD_FACTORS apart; each layer's self_attn.k_scale
    and v_scale are these tensors."""
    config = LlamaConfig(hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tensors = load_file(str(path / "model.safetensors"))
    for kind, factors in HEAD_FACTORS.items():
        factors = torch.tensor(factors)
        kv_rows, query_heads = factors.repeat_interleave(64).unsqueeze(1), factors.repeat_interleave(128)
        for i in range(config.num_hidden_layers):
            prefix = f"model.layers.{i}.self_attn"
            tensors[f"{prefix}.{kind}_proj.weight"] = tensors[f"{prefix}.{kind}_proj.weight"] * kv_rows
            if kind == "k":
                tensors[f"{prefix}.q_proj.weight"] = tensors[f"{prefix}.q_proj.weight"] * (SHARPNESS / query_heads
                                                                                            ).unsqueeze(1)
            else:
                tensors[f"{prefix}.o_proj.weight"] = tensors[f"{prefix}.o_proj.weight"] / query_heads
            tensors[f"{prefix}.{kind}_scale"] = (k_scale if kind == "k" else v_scale).clone()  # none shares memory
    save_file(tensors, str(path / "model.safetensors"))


@pytest.mark.parametrize("path", ["native", "torch"])
def test_fp8_cache_applies_per_head_kv_scales(tmp_path, monkeypatch, path):
    """vLLM's per-KV-head fp8 scales (a kv_cache_scheme of strategy "attn_head", saved as LLM-Compressor does,
    ``[num_kv_heads, 1, 1]``): each KV head is cached divided by its own k_scale and v_scale and read back times them,
    on the native kernels and the torch path alike. Over KV heads whose magnitudes differ 10^5-fold, the logits stay
    near the float32 cache's, far nearer than under one scale a tensor (the heads' max); a per-head scale equal for
    all heads is that per-tensor scale, bit for bit."""
    _use_attention_path(path, monkeypatch)
    per_tensor = HEAD_SCALES.amax(1)
    _save_llama_with_head_scales(tmp_path / "per_head", *HEAD_SCALES.view(2, 2, 1, 1))
    _save_llama_with_head_scales(tmp_path / "per_tensor", *per_tensor.view(2, 1))
    _save_llama_with_head_scales(tmp_path / "equal", *per_tensor.view(2, 1).expand(2, 2).contiguous())
    reference = _logits(tmp_path / "per_head", torch.float32)
    per_head, one_scale = (_logits(tmp_path / name, torch.float8_e4m3fn) for name in ("per_head", "per_tensor"))
    error, error_one_scale = ((x - reference).abs().max().item() for x in (per_head, one_scale))
    print(f"{path}: max |logit error| with per-head scales {error:.4f}, with one scale {error_one_scale:.4f}, "
          f"max |logit| {reference.abs().max().item():.3f}")
    assert error < 0.1 * reference.abs().max() and error < error_one_scale / 4
    assert torch.equal(_logits(tmp_path / "equal", torch.float8_e4m3fn), one_scale)


@pytest.mark.parametrize("k_scale, message", [
    (torch.ones(3), r"must be one \(per-tensor\) value or one per KV head \(2\), got shape \(3,\)"),
    (torch.tensor([0.5, float("inf")]), "must be positive and finite, got inf")])
def test_bad_per_head_kv_cache_scale_is_a_load_error(tmp_path, k_scale, message):
    """Per-head KV cache scales are one positive, finite value for each of the model's KV heads: anything else is a
    ValueError naming the tensor."""
    _save_llama_with_head_scales(tmp_path, k_scale, HEAD_SCALES[1])
    with pytest.raises(ValueError, match=f"'model.layers.0.self_attn.k_scale': a KV cache scale {message}"):
        get_model(str(tmp_path), load_hf_config(str(tmp_path)), KernelChoice(torch.float32))


def test_per_head_kv_cache_scales_follow_the_ranks_kv_heads(tmp_path):
    """Under tensor parallelism a rank keeps its own KV heads' per-head scales, as vLLM's TP-aware loader of
    "attn_head" scales does: of the two KV heads, rank r of 2 holds head r's; of 4 ranks (each KV head on two of
    them) rank r holds head r // 2's."""
    _save_llama_with_head_scales(tmp_path, *HEAD_SCALES.view(2, 2, 1, 1))
    config = load_hf_config(str(tmp_path))
    for tp_size in (2, 4):
        for tp_rank in range(tp_size):
            model = get_model(str(tmp_path), config, KernelChoice(torch.float32), rank=ParallelRank(tp_rank, tp_size))
            head = tp_rank * 2 // tp_size
            assert torch.equal(model.model.layers[1].self_attn.attn.impl.kv_scales, HEAD_SCALES[:, head : head + 1])


def test_fp8_cache_scales_in_the_engines_decode_graphs(tmp_path):
    """The engine over the scaled checkpoint's fp8 cache, its decode steps replaying CPU graphs (which recorded the
    layers' scales as kernel arguments): each greedy token's logprob is near the float32 cache's for the same token,
    that engine teacher-forced on the fp8 engine's tokens."""
    _save_llama_with_kv_scales(tmp_path, ("k_scale", "v_scale"))
    prompts = [list(range(10, 50)), list(range(100, 117))]
    args = dict(tokenizer=resolve_model(DEFAULT_MODEL), dtype="float32", max_model_len=128, kv_cache_memory="16MiB")
    fp8 = in_process_llm(str(tmp_path), kv_cache_dtype="fp8", **args)
    replays = []
    replay = CpuGraph.replay
    try:
        with pytest.MonkeyPatch.context() as patcher:
            patcher.setattr(CpuGraph, "replay", lambda self: replays.append(self) or replay(self))
            outputs = [o.outputs[0] for o in fp8.generate(
                [{"prompt_token_ids": p} for p in prompts],
                SamplingParams(temperature=0, max_tokens=12, logprobs=0, ignore_eos=True), use_tqdm=False)]
    finally:
        fp8.shutdown()
    assert len(replays) >= 10
    reference = in_process_llm(str(tmp_path), **args)
    try:
        forced = reference.generate([{"prompt_token_ids": p + list(o.token_ids)} for p, o in zip(prompts, outputs)],
                                    SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    finally:
        reference.shutdown()
    deltas = [abs(ours[token].logprob - theirs[token].logprob) for o, f in zip(outputs, forced)
              for token, ours, theirs in zip(o.token_ids, o.logprobs, f.prompt_logprobs[-len(o.token_ids):])]
    print(f"max |logprob diff| over {len(deltas)} tokens: {max(deltas):.4f}")
    assert max(deltas) < 0.04


@pytest.mark.parametrize("scale, message", [(torch.full((1, 1), 0.0), "must be positive and finite, got 0.0"),
                                            (torch.tensor([float("nan")]), "must be positive and finite, got nan"),
                                            (torch.ones(2), r"must be one \(per-tensor\) value or one per KV head "
                                                            r"\(1\), got shape \(2,\)")])
def test_bad_kv_cache_scale_is_a_load_error(tmp_path, scale, message):
    """A checkpoint's KV cache scale is one positive, finite number (or one a KV head, here one): anything else is a
    ValueError naming the tensor, not a cache of NaN or infinities."""
    _save_llama_with_kv_scales(tmp_path, ("k_scale",))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.1.self_attn.v_scale"] = scale
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"'model.layers.1.self_attn.v_scale': a KV cache scale {message}"):
        get_model(str(tmp_path), load_hf_config(str(tmp_path)), KernelChoice(torch.float32))
