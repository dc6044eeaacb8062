"""Mixture-of-experts models reproduce transformers' logits under every schedule of the parity suite (Mixtral,
Qwen2-MoE with its shared expert and a dense layer, Qwen3-MoE), from safetensors and from GGUF files written as
llama.cpp writes them (experts stacked, Mixtral as architecture "llama"); FusedMoE's tensor- and expert-parallel slices sum to
the whole layer; a split the model cannot take is a config error."""

import pytest
import torch
from transformers import (MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

from pagedllm.config import ParallelConfig
from pagedllm.distributed.parallel_state import ParallelRank
from pagedllm import native
from pagedllm.layers.fused_moe import FusedMoE, expert_weight_target, fused_experts, routed_experts, select_experts
from pagedllm.layers.gemm_layout import WeightLayout
from pagedllm.native.fused import fused_moe
from pagedllm.models.hf_config import load_hf_config
from pagedllm.models.loader import get_model
from pagedllm.platforms.interface import KernelChoice
from tests.model_fixtures import write_tiny_gguf
from tests.test_model_parity import (MIXED_LENGTHS, MIXED_SCHEDULE, TINY, _check_schedules, _reference_logits,
                                     _run_schedule, _save_tiny)

MOE_MODELS = {
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM,
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, mlp_only_layers=[1])),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
}


@pytest.mark.parametrize("name", sorted(MOE_MODELS))
def test_tiny_moe_parity(tmp_path, name):
    config_class, hf_class, extra = MOE_MODELS[name]
    reference = _save_tiny(hf_class, config_class(**TINY, **extra), tmp_path)
    config = load_hf_config(str(tmp_path))
    model = get_model(str(tmp_path), config, KernelChoice(torch.float32))
    experts = model.model.layers[0].get_submodule(model.mlp_name).experts
    assert experts.w13_weight.shape == (4, 2 * experts.intermediate_size_per_partition, 64)
    _check_schedules(model, reference, config, config.vocab_size, seed=9, block_size=4)


@pytest.mark.parametrize("name, arch", [("mixtral", "llama"), ("qwen2_moe", "qwen2moe"), ("qwen3_moe", "qwen3moe")])
def test_tiny_moe_gguf_parity(tmp_path, name, arch):
    """The experts' sizes, count and weight normalisation come from the file's metadata (transformers' GGUF config
    reading leaves them out); every layer is sparse, as llama.cpp has them."""
    config_class, hf_class, extra = MOE_MODELS[name]
    extra = {k: v for k, v in extra.items() if k != "mlp_only_layers"}
    torch.manual_seed(11)
    reference = hf_class(config_class(**TINY, **extra, tie_word_embeddings=False)).eval()
    path = str(tmp_path / f"tiny-{arch}.gguf")
    write_tiny_gguf(reference, path, arch)
    config = load_hf_config(path)
    assert config.model_type == name
    model = get_model(path, config, KernelChoice(torch.float32))
    _check_schedules(model, reference, config, config.vocab_size, seed=12, block_size=4)


def _expert_weights(num_experts: int, hidden: int, inter: int) -> dict[tuple[int, str], torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = {"w1": (inter, hidden), "w3": (inter, hidden), "w2": (hidden, inter)}
    return {(e, shard): torch.randn(shape, generator=gen) for e in range(num_experts) for shard, shape in shapes.items()}


def _moe(rank: ParallelRank, weights, renormalize: bool = True) -> FusedMoE:
    moe = FusedMoE(4, 2, 16, 8, renormalize, rank)
    for (expert, shard), tensor in weights.items():
        param = moe.w2_weight if shard == "w2" else moe.w13_weight
        moe.weight_loader(param, tensor, expert, shard)
    return moe


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_fused_moe_slices_sum_to_the_layer(expert_parallel):
    """Two ranks' partial outputs (each rank's experts, or each expert's half of the intermediate size) add up to
    one rank's output; and that equals a per-token loop over each token's top-2 experts."""
    weights = _expert_weights(4, 16, 8)
    x, logits = torch.randn(13, 16), torch.randn(13, 4)
    with torch.inference_mode():
        whole = _moe(ParallelRank(), weights)(x, logits)
        parts = [_moe(ParallelRank(r, 2, expert_parallel=expert_parallel), weights) for r in range(2)]
        # One rank's view without its process group: reduce_results would be the identity, so sum by hand.
        partial = [m(x, logits) for m in parts]
    held = [(m.first_expert, m.num_local_experts, m.intermediate_size_per_partition) for m in parts]
    assert held == ([(0, 2, 8), (2, 2, 8)] if expert_parallel else [(0, 4, 4), (0, 4, 4)])
    torch.testing.assert_close(partial[0] + partial[1], whole, rtol=1e-5, atol=1e-5)
    probs = logits.softmax(-1)
    expected = torch.zeros_like(x)
    for t in range(x.shape[0]):
        top = probs[t].topk(2)
        for p, e in zip(top.values / top.values.sum(), top.indices.tolist()):
            h = torch.nn.functional.silu(x[t] @ weights[e, "w1"].t()) * (x[t] @ weights[e, "w3"].t())
            expected[t] += p * (h @ weights[e, "w2"].t())
    torch.testing.assert_close(whole, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens, experts, top_k, renormalize, hidden, inter", [
    (1, 4, 2, True, 64, 32), (7, 6, 3, False, 20, 13), (33, 8, 2, True, 72, 40), (128, 60, 4, False, 32, 24)])
def test_native_layer_is_the_torch_layer(tokens, experts, top_k, renormalize, hidden, inter):
    """native/fused_moe.c routes as select_experts and sums as fused_experts (sizes off the vector width too)."""
    if native.fused_ops() is None:
        pytest.skip("no native kernels here")
    gen = torch.Generator().manual_seed(tokens)
    x, logits = torch.randn(tokens, hidden, generator=gen), torch.randn(tokens, experts, generator=gen)
    w13, w2 = torch.randn(experts, 2 * inter, hidden, generator=gen), torch.randn(experts, hidden, inter, generator=gen)
    expected = fused_experts(x, w13, w2, *select_experts(logits, top_k, renormalize))
    torch.testing.assert_close(fused_moe(x, logits, w13, w2, top_k, renormalize), expected, rtol=1e-4, atol=1e-4)


def test_expert_weight_target():
    names = ("w1", "w2", "w3")
    assert expert_weight_target("model.layers.3.block_sparse_moe.experts.7.w3.weight", names) == (
        "model.layers.3.block_sparse_moe.experts.w13_weight", 7, "w3")
    assert expert_weight_target("model.layers.0.block_sparse_moe.experts.0.w2.weight", names) == (
        "model.layers.0.block_sparse_moe.experts.w2_weight", 0, "w2")
    qwen = ("gate_proj", "down_proj", "up_proj")
    assert expert_weight_target("model.layers.1.mlp.experts.2.gate_proj.weight", qwen) == (
        "model.layers.1.mlp.experts.w13_weight", 2, "w1")
    assert expert_weight_target("model.layers.1.mlp.shared_expert.gate_proj.weight", qwen) is None
    assert expert_weight_target("model.layers.1.mlp.gate.weight", qwen) is None


def test_expert_split_errors():
    config = MixtralConfig(**TINY, num_local_experts=6)
    with pytest.raises(ValueError, match="number of experts"):
        ParallelConfig(tensor_parallel_size=4, enable_expert_parallel=True).verify_with_model(config)
    ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True).verify_with_model(config)
    qwen = Qwen2MoeConfig(**TINY, num_experts=4, moe_intermediate_size=30, shared_expert_intermediate_size=48)
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        ParallelConfig(tensor_parallel_size=4).verify_with_model(qwen)
    ParallelConfig(tensor_parallel_size=4, enable_expert_parallel=True).verify_with_model(qwen)
    with pytest.raises(ValueError, match="no experts"):
        ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True).verify_with_model(
            Qwen2MoeConfig(**TINY, num_experts=0))


def test_fused_moe_bfloat16_near_float32():
    """In bfloat16 (the engine's dtype on CPUs with bf16) the layer stays near its float32 output."""
    weights = _expert_weights(4, 16, 8)
    x, logits = torch.randn(21, 16), torch.randn(21, 4)
    with torch.inference_mode():
        exact = _moe(ParallelRank(), weights)(x, logits)
        got = _moe(ParallelRank(), weights).to(torch.bfloat16)(x.bfloat16(), logits.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), exact, rtol=0.05, atol=0.05 * exact.abs().max().item())


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().float()


@pytest.mark.parametrize("tokens, experts, top_k, renormalize, hidden, inter", [
    (1, 4, 2, True, 64, 32), (33, 8, 2, True, 72, 40), (200, 6, 3, False, 96, 24)])
def test_bf16_panel_layer_is_the_bf16_product(tokens, experts, top_k, renormalize, hidden, inter):
    """Under bf16 panels the experts become gemm_bf16's panels (the float32 stacks dropped) and every step, past
    NATIVE_MAX_TOKENS too, is one moe_bf16 call: the routing and order of sums of fused_experts, each product the
    dense bf16 layers' (rows rounded to bf16, float32 sums); sizes off the panels' 32 and the tiles' 16 too."""
    if native.moe_bf16() is None:
        pytest.skip("no bf16 panels here (the CPU has no AVX512-BF16)")
    gen = torch.Generator().manual_seed(tokens)
    moe = FusedMoE(experts, top_k, hidden, inter, renormalize)
    w13, w2 = torch.randn(experts, 2 * inter, hidden, generator=gen), torch.randn(experts, hidden, inter, generator=gen)
    moe.w13_weight.data.copy_(w13)
    moe.w2_weight.data.copy_(w2)
    moe.quant_method.process_weights_after_loading(moe, WeightLayout(bf16_panels=True))
    assert moe.runs_natively and not hasattr(moe, "w13_weight") and moe.quant_method.w13_panels.dtype == torch.bfloat16
    x, logits = torch.randn(tokens, hidden, generator=gen), torch.randn(tokens, experts, generator=gen)

    def expert_mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = (_bf16(rows) @ _bf16(w13[expert]).t()).chunk(2, dim=-1)
        return _bf16(torch.nn.functional.silu(gate) * up) @ _bf16(w2[expert]).t()

    expected = routed_experts(x, *select_experts(logits, top_k, renormalize), experts, expert_mlp)
    with torch.inference_mode():
        torch.testing.assert_close(moe(x, logits), expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_bf16_panel_slices_sum_to_the_layer(expert_parallel):
    """Tensor- and expert-parallel ranks keep their slices of every expert, or their experts, in bf16 panels too;
    their partial outputs add up to one rank's output."""
    if native.moe_bf16() is None:
        pytest.skip("no bf16 panels here (the CPU has no AVX512-BF16)")
    weights = _expert_weights(4, 64, 32)
    x, logits = torch.randn(13, 64), torch.randn(13, 4)
    layout = WeightLayout(bf16_panels=True)

    def laid_out(rank: ParallelRank) -> FusedMoE:
        moe = FusedMoE(4, 2, 64, 32, True, rank)
        for (expert, shard), tensor in weights.items():
            moe.weight_loader(moe.w2_weight if shard == "w2" else moe.w13_weight, tensor, expert, shard)
        moe.quant_method.process_weights_after_loading(moe, layout)
        return moe

    with torch.inference_mode():
        whole = laid_out(ParallelRank())(x, logits)
        parts = [laid_out(ParallelRank(r, 2, expert_parallel=expert_parallel)) for r in range(2)]
        assert all(m.quant_method.w13_panels is not None for m in parts)
        torch.testing.assert_close(parts[0](x, logits) + parts[1](x, logits), whole, rtol=1e-4,
                                   atol=1e-4 * whole.abs().max().item())
    assert [m.num_local_experts for m in parts] == ([2, 2] if expert_parallel else [4, 4])


def test_tiny_mixtral_in_bf16_panels(tmp_path):
    """A bfloat16 Mixtral under bf16 panels keeps its experts in them (decode steps replay CPU graphs: every block
    is native) and stays near transformers' bfloat16 logits over the mixed schedule."""
    if native.moe_bf16() is None:
        pytest.skip("no bf16 panels here (the CPU has no AVX512-BF16)")
    config_class, hf_class, extra = MOE_MODELS["mixtral"]
    _save_tiny(hf_class, config_class(**TINY, **extra), tmp_path)
    reference = hf_class.from_pretrained(str(tmp_path), dtype=torch.bfloat16).eval()
    config = load_hf_config(str(tmp_path))
    model = get_model(str(tmp_path), config, KernelChoice(torch.bfloat16, bf16_panels=True))
    experts = model.model.layers[0].get_submodule(model.mlp_name).experts
    assert experts.quant_method.w13_panels is not None and model.supports_cpu_graphs
    tokens = {req: torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(6)).tolist()
              for req, n in MIXED_LENGTHS.items()}
    ours = _run_schedule(model, config, tokens, MIXED_SCHEDULE)
    for req, t in tokens.items():
        ref = _reference_logits(reference, t)
        assert (ours[req] - ref).abs().max().item() < 0.1 * ref.abs().max().item()
