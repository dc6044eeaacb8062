"""quantization="gguf" on mixture-of-experts GGUFs: the stacked experts stay packed (GGUFFusedMoEMethod) where each
stack is of a kind a native kernel takes, and the model gives the dense model's logits on the same dequantized
weights (up to the order of float32 sums: the dense experts run torch's or fused_moe.c's GEMMs) and its greedy
tokens; the native layer (moe_quant.c) is the torch path's routing and sums and replays in a CPU graph; a layer's
tensor- and expert-parallel slices sum to the whole layer."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from pagedllm import native
from pagedllm.distributed.parallel_state import ParallelRank
from pagedllm.engine.arg_utils import set_quantization
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.fused_moe import FusedMoE, expert_param_name, fused_experts, routed_experts, select_experts
from pagedllm.layers.gemm_layout import BF16_MIN_ROWS, WeightLayout
from pagedllm.layers.quantization.gguf import GGUFConfig
from pagedllm.layers.quantization.gguf_moe import GGUFFusedMoEMethod
from pagedllm.models.gguf_loader import PACKED_PARTS, dequantize_fast, unpack
from pagedllm.models.hf_config import load_hf_config
from pagedllm.models.loader import get_model, get_quant_config
from pagedllm.models.mixtral import MixtralForCausalLM as OurMixtral
from pagedllm.models.qwen3_moe import Qwen3MoeForCausalLM as OurQwen3Moe
from pagedllm.native.gemms import BF16_MODEL
from pagedllm.native.graph import CpuGraph
from pagedllm.platforms.cpu import choose_kernels
from tests.model_fixtures import quantize_gguf, write_tiny_gguf
from tests.test_gguf_quantization import PROMPTS, _greedy, _load
from tests.test_model_parity import TINY

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(native.gemm_q4() is None or native.gemm_q8() is None,
                                 reason="no quantized GEMMs here (needs a C compiler and AVX-512 or AVX2)")]

# Qwen3-MoE as a Q4_K_M file has it (Q4_K gate, up and attention, Q6_K down: one [gate | up] weight of Q4_K panels);
# Mixtral with a Q4_0 gate and a Q8_0 up (two kinds: each half of the output in its own) and a Q4_1 down.
CASES = {
    "qwen3_moe-q4_k_m": (Qwen3MoeConfig, Qwen3MoeForCausalLM, OurQwen3Moe, "qwen3moe",
                         dict(hidden_size=256, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                              norm_topk_prob=True),
                         {"down_proj": T.Q6_K}, T.Q4_K, [("gemm_q4kc_f32", 512)], "gemm_q6kc_f32"),
    "mixtral-mixed": (MixtralConfig, MixtralForCausalLM, OurMixtral, "llama",
                      dict(num_local_experts=4, num_experts_per_tok=2),
                      {"gate_proj": T.Q4_0, "up_proj": T.Q8_0, "down_proj": T.Q4_1}, T.Q8_0,
                      [("gemm_q4_f32", 128), ("gemm_q8_f32", 128)], "gemm_q4_f32"),
}


def _write_case(tmp_path, case: str) -> str:
    """CASES[case]'s tiny random model as a GGUF file of its types; the file's path."""
    config_class, hf_class, _, arch, extra, types, default, _, _ = CASES[case]
    torch.manual_seed(5)
    reference = hf_class(config_class(**{**TINY, **extra}, tie_word_embeddings=False)).eval()
    path = str(tmp_path / f"{case}.gguf")
    write_tiny_gguf(reference, path, arch,
                    layer_type=lambda name: next((t for key, t in types.items() if key in name), default))
    return path


@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_experts_give_the_dense_models_logits(tmp_path, case):
    _, _, model_class, _, _, _, _, w13_kernels, w2_kernel = CASES[case]
    path = _write_case(tmp_path, case)
    dense, config = _load(path, None)
    packed, _ = _load(path, "gguf")
    for layer in packed.model.layers:
        experts = layer.get_submodule(packed.mlp_name).experts
        method = experts.quant_method
        assert isinstance(method, GGUFFusedMoEMethod) and experts.runs_natively and method.bf16_gemm is None
        assert not list(experts.parameters(recurse=False))  # only panels: no float32 stacks
        assert len(method.w13) == len(method.w2) == 4
        assert [(w.kernel.name, w.out_features) for _, w in method.w13[0]] == w13_kernels
        assert method.w2[0].kernel.name == w2_kernel
    assert packed.supports_cpu_graphs  # moe_quant.c decides the routing as it runs
    summary = get_quant_config("gguf", path, model_class).summary(packed)
    assert "; experts kept packed: " in summary and summary.endswith("experts dequantized at load: none")
    (dense_tokens, dense_logits), (packed_tokens, packed_logits) = (_greedy(m, config, PROMPTS, 8)
                                                                    for m in (dense, packed))
    assert packed_tokens == dense_tokens
    torch.testing.assert_close(packed_logits, dense_logits, rtol=1e-4, atol=1e-4)


def test_gguf_int4_keeps_a_q4_k_m_files_experts_packed(tmp_path):
    """gguf_int4 keeps only Q4 linear layers packed, but a mixture's Q6_K down stacks stay packed with their Q4_K gate
    and up (dequantizing them would take every expert of the layer to float32)."""
    config_class, hf_class, model_class, arch, extra, types, default, *_ = CASES["qwen3_moe-q4_k_m"]
    torch.manual_seed(7)
    reference = hf_class(config_class(**{**TINY, **extra}, tie_word_embeddings=False)).eval()
    path = str(tmp_path / "qwen3_moe-q4_k_m.gguf")
    write_tiny_gguf(reference, path, arch,
                    layer_type=lambda name: next((t for key, t in types.items() if key in name), default))
    model, _ = _load(path, "gguf_int4")
    method = model.model.layers[0].mlp.experts.quant_method
    assert isinstance(method, GGUFFusedMoEMethod) and method.w2[0].kernel.name == "gemm_q6kc_f32"
    assert get_quant_config("gguf_int4", path, model_class).summary(model).endswith(
        "experts kept packed: Q4_K+Q6_K x2; experts dequantized at load: none")


def test_experts_with_a_kind_no_kernel_takes_are_dequantized(tmp_path):
    """An F16 down stack: that layer's experts load dense (float32 stacks, the native path, CPU graphs)."""
    config_class, hf_class, _, arch, extra, *_ = CASES["mixtral-mixed"]
    torch.manual_seed(6)
    reference = hf_class(config_class(**{**TINY, **extra}, tie_word_embeddings=False)).eval()
    path = str(tmp_path / "mixtral-f16-down.gguf")
    write_tiny_gguf(reference, path, arch, layer_type=lambda name: T.F16 if "down_proj" in name else T.Q8_0)
    model, _ = _load(path, "gguf")
    experts = model.model.layers[0].block_sparse_moe.experts
    assert experts.w13_weight.dtype == torch.float32 and experts.runs_natively
    assert get_quant_config("gguf", path, OurMixtral).summary(model).endswith(
        "experts kept packed: none; experts dequantized at load: F16+Q8_0 x2")


def _q4_1_experts(num_experts: int, hidden: int, inter: int) -> dict[tuple[int, str], np.ndarray]:
    """Each expert's projections as Q4_1 blocks."""
    rng = np.random.default_rng(0)
    shapes = {"w1": (inter, hidden), "w3": (inter, hidden), "w2": (hidden, inter)}
    return {(e, shard): quantize_gguf(rng.standard_normal(shape).astype(np.float32), T.Q4_1)
            for e in range(num_experts) for shard, shape in shapes.items()}


def _packed_moe(rank: ParallelRank, blocks, layout: WeightLayout | None = None) -> FusedMoE:
    types = {f"experts.{{expert}}.{name}.weight": T.Q4_1 for name in ("gate", "down", "up")}
    moe = FusedMoE(4, 2, 64, 64, True, rank, quant_config=GGUFConfig(types, [], ("gate", "down", "up")),
                   prefix="experts")
    params = dict(moe.named_parameters())
    for (expert, shard), data in blocks.items():
        for part, array in zip(PACKED_PARTS, unpack(data, T.Q4_1)):
            param = params[expert_param_name(shard, part)]
            param.weight_loader(param, torch.from_numpy(array), expert, shard)
    moe.quant_method.process_weights_after_loading(moe, layout)
    return moe


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_packed_slices_sum_to_the_dense_layer(expert_parallel):
    """Two ranks' partial outputs (each rank's experts, or each expert's half of the intermediate size, its down
    projection's scales cut per block) add up to the dense layer's on the dequantized weights."""
    blocks = _q4_1_experts(4, 64, 64)
    x, logits = torch.randn(9, 64), torch.randn(9, 4)
    weights = {key: torch.from_numpy(dequantize_fast(data, T.Q4_1)) for key, data in blocks.items()}
    w13 = torch.stack([torch.cat([weights[e, "w1"], weights[e, "w3"]]) for e in range(4)])
    w2 = torch.stack([weights[e, "w2"] for e in range(4)])
    with torch.inference_mode():
        expected = fused_experts(x, w13, w2, *select_experts(logits, 2, True))
        parts = [_packed_moe(ParallelRank(r, 2, expert_parallel=expert_parallel), blocks) for r in range(2)]
        partial = [m(x, logits) for m in parts]
    assert [len(m.quant_method.w2) for m in parts] == ([2, 2] if expert_parallel else [4, 4])
    torch.testing.assert_close(partial[0] + partial[1], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_native_layer_is_the_torch_path_and_replays(tokens):
    """moe_quant.c routes and sums as routed_experts over the experts' panels; captured in a CPU graph, a replay
    follows new inputs to new experts."""
    moe = _packed_moe(ParallelRank(), _q4_1_experts(4, 64, 64))
    method = moe.quant_method
    assert moe.runs_natively
    gen = torch.Generator().manual_seed(tokens)
    x, logits = torch.randn(tokens, 64, generator=gen), torch.randn(tokens, 4, generator=gen)

    def torch_path():
        return routed_experts(x, *select_experts(logits, 2, True), 4, method.expert_mlp)

    with torch.inference_mode():
        torch.testing.assert_close(moe(x, logits), torch_path(), rtol=1e-4, atol=1e-4)
        graph = CpuGraph()
        graph.capture(lambda: moe(x, logits))
        assert graph.failure is None and len(graph.calls) == 1
        x.copy_(torch.randn(tokens, 64, generator=gen))
        logits.copy_(torch.randn(tokens, 4, generator=gen))
        torch.testing.assert_close(graph.replay(), torch_path(), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(native.gemm_q4().for_bf16_model() is None,
                    reason="no block sums here (gemm_quant.h's tile_quant_sums: AVX512-VBMI)")
def test_a_bfloat16_models_experts_take_block_sums_in_decode_rows():
    """As its dense GGUF layers do, a bfloat16 model's packed experts sum each block's codes against a decode step's
    rows before their scale (gemm.c's block sums, the BF16_MODEL format flag): the float32 model's result (the dense
    kernel's, which the tests above hold to the dequantized experts) up to sums rounded in another order."""
    blocks = _q4_1_experts(4, 64, 64)
    float32_model, moe = _packed_moe(ParallelRank(), blocks), _packed_moe(ParallelRank(), blocks,
                                                                          WeightLayout(bf16_panels=True))
    method = moe.quant_method
    assert (method.w13_formats[:, 0] & BF16_MODEL).all() and (method.w2_formats & BF16_MODEL).all()
    assert not (float32_model.quant_method.w2_formats & BF16_MODEL).any()
    gen = torch.Generator().manual_seed(5)
    x, logits = torch.randn(3, 64, generator=gen), torch.randn(3, 4, generator=gen)  # up to 3 rows an expert
    with torch.inference_mode():
        expected, got = float32_model(x, logits), moe(x, logits)
    assert not torch.equal(got, expected)
    assert (got - expected).abs().max() < 1e-4 * expected.abs().max()


AMX = pytest.mark.skipif(not WeightLayout(bf16_panels=True).quantized_steps_on_amx(),
                         reason="no AMX tiles granted here")


@AMX
def test_a_bfloat16_models_experts_take_the_tiles_in_long_steps(tmp_path):
    """Loaded into a bfloat16 model on AMX, a file's packed experts multiply their long steps on the tiles (the
    float32 models above keep the quantized panels in every step)."""
    path = _write_case(tmp_path, "qwen3_moe-q4_k_m")
    config = load_hf_config(path)
    set_quantization(config, "gguf", path)
    model = get_model(path, config, choose_kernels(torch.bfloat16))
    for layer in model.model.layers:
        experts = layer.get_submodule(model.mlp_name).experts
        assert experts.runs_natively and experts.quant_method.bf16_gemm == native.gemm_bf16_address()


@AMX
def test_long_steps_multiply_dequantized_on_amx_tiles():
    """In a bfloat16 model on AMX the native layer's experts with BF16_MIN_ROWS rows or more in a step multiply their
    projections dequantized to bf16 panels on the tiles, as the model's dense quantized layers do (rows rounded to
    bf16, float32 sums); an expert with fewer keeps its quantized panels."""
    blocks = _q4_1_experts(4, 64, 64)
    weights = {key: torch.from_numpy(dequantize_fast(data, T.Q4_1)) for key, data in blocks.items()}
    moe = _packed_moe(ParallelRank(), blocks, WeightLayout(bf16_panels=True))
    assert moe.runs_natively and moe.quant_method.bf16_gemm is not None
    gen = torch.Generator().manual_seed(3)
    x, logits = torch.randn(100, 64, generator=gen), torch.randn(100, 4, generator=gen)
    logits[:, 3] -= 4.0  # expert 3 gets a few rows only
    topk_weights, topk_ids = select_experts(logits, 2, True)
    rows_per_expert = torch.bincount(topk_ids.flatten(), minlength=4).tolist()
    assert min(rows_per_expert) < BF16_MIN_ROWS <= max(rows_per_expert)

    def expert_mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
        on_tiles = rows.shape[0] >= BF16_MIN_ROWS

        def linear(r: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return r.bfloat16().float() @ w.bfloat16().float().t() if on_tiles else r @ w.t()

        gate_up = torch.cat([linear(rows, weights[expert, "w1"]), linear(rows, weights[expert, "w3"])], dim=1)
        return linear(SiluAndMul()(gate_up), weights[expert, "w2"])

    with torch.inference_mode():
        torch.testing.assert_close(moe(x, logits), routed_experts(x, topk_weights, topk_ids, 4, expert_mlp),
                                   rtol=1e-4, atol=1e-4)
