"""quantization="int8" (W8A8): the native kernel computes exactly the quantized product (per-token activation codes
times per-channel weight codes, summed in int32, scaled once, plus each token's outliers times their weight codes
in float), torch's int8 path agrees with it, and the quantized
SmolLM2 stays close to the dense one, teacher-forced (tests/e2e/test_cpu_graphs.py: its decode steps replay CPU
graphs); a compressed-tensors W8A8 checkpoint loads its own codes and scales."""

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from pagedllm import LLM, SamplingParams, native
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.openai.cli_args import make_arg_parser
from pagedllm.layers.gemm_layout import WeightLayout
from pagedllm.layers.linear import MergedColumnParallelLinear, ReplicatedLinear
from pagedllm.layers.quantization.int8 import (Int8Config, Int8LinearMethod, outlier_terms,
                                               pack_w8a8_panels, quantize_activations, quantize_symmetric)
from pagedllm.models.hf_config import load_hf_config
from pagedllm.models.loader import get_model
from pagedllm.platforms.cpu import cpu_flags
from pagedllm.platforms.interface import KernelChoice
from tests.conftest import DENSE_SMOLLM_ARGS
from tests.model_fixtures import Chunk, PagedBatchRunner, teacher_forced
from tests.native_paths import native_build, native_or_fallback


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The W8A8 product in exact integer arithmetic (float64 holds these sums exactly), then the kernel's epilogue."""
    x_codes, x_scales, ids, values = quantize_activations(x)
    w_codes, w_scales = quantize_symmetric(weight)
    acc = (x_codes.double() @ w_codes.double().T).float()
    y = (acc * x_scales[:, None] + outlier_terms(ids, values, w_codes)) * w_scales[None, :]
    return y if bias is None else y + bias


# the best body built here (AMX tiles where the CPU and OS allow), the AVX512-VNNI one beside AMX, the 256-bit one with
# and without AVX-VNNI
BODIES = ["native", "no_amx", "avx2", "avx2_no_vnni"]


@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("rows, out_features, in_features", [
    (1, 64, 64), (3, 40, 60), (5, 17, 7), (17, 1536, 576), (130, 576, 1536), (0, 16, 16), (4, 48, 70),
    (9, 40, 60), (40, 17, 7)])  # rows enough for AMX tiles (where there are), with K and N not whole tiles
def test_native_kernel_is_the_quantized_product(body, rows, out_features, in_features):
    kernel = native_build(body, "gemm_w8a8")
    gen = torch.Generator().manual_seed(rows + out_features)
    weight, bias = torch.randn(out_features, in_features, generator=gen), torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    x[:1, : in_features // 2] = 0.0  # a row partly zero, and the zero row below
    if rows > 2:
        x[2] = 0.0
    y = kernel(x, pack_w8a8_panels(*quantize_symmetric(weight)), bias, out_features)
    assert y.shape == (rows, out_features)
    torch.testing.assert_close(y, _reference(x, weight, bias), rtol=1e-6, atol=1e-5)
    if rows:
        relative = ((y - (x @ weight.T + bias)).abs().max() / (x @ weight.T).abs().max()).item()
        assert 0 < relative < 0.03  # quantized: close to the float product, not equal to it


@pytest.mark.parametrize("body", BODIES)
def test_outliers_leave_the_other_entries_their_codes(body):
    """A row whose few largest entries are thousands of times the rest (as the residual stream's outlier features
    are): the product is as close to the float one as a row without them, since they stay out of the codes (with
    them in, the scale they set would code every other entry 0)."""
    kernel = native_build(body, "gemm_w8a8")
    gen = torch.Generator().manual_seed(7)
    weight, x = torch.randn(40, 96, generator=gen), torch.randn(3, 96, generator=gen)
    spiked = x.clone()
    spiked[:, [5, 77]] = torch.tensor([4000.0, -2500.0])
    panels = pack_w8a8_panels(*quantize_symmetric(weight))
    w_codes, w_scales = quantize_symmetric(weight)
    dequantized = w_codes.float() * w_scales[:, None]
    for rows in (x, spiked):
        y = kernel(rows, panels, None, 40)
        torch.testing.assert_close(y, _reference(rows, weight, None), rtol=1e-6, atol=1e-3)
        error = (y - rows @ dequantized.T).abs().max() / (x @ dequantized.T).abs().max()
        assert 0 < error < 0.02


@pytest.mark.parametrize("body", BODIES)
def test_extreme_codes_sum_exactly(body):
    """Every code at +-127 with the signs matching (each product 127 * 127, the int16 pairs of the AVX2 steps at
    their largest) or opposed: the sums are exact, not saturated."""
    kernel = native_build(body, "gemm_w8a8")
    signs = torch.where(torch.arange(256) % 3 == 0, -1.0, 1.0)
    weight = torch.stack([signs, -signs, torch.ones(256)] * 6)  # 18 columns: a partial second panel
    x = torch.stack([signs, -signs, signs.flip(0)])
    y = kernel(x, pack_w8a8_panels(*quantize_symmetric(weight)), None, 18)
    torch.testing.assert_close(y, _reference(x, weight, None), rtol=1e-6, atol=1e-5)
    assert y[0, 0] == y[1, 1] == -y[0, 1] == -y[1, 0] == 256.0


@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("rows, in_features", [(3, 60), (9, 7)])
def test_a_nan_activation_makes_its_rows_outputs_nan(body, rows, in_features):
    """A NaN in a row (a diverged model) makes every output of that row NaN, as the float product and torch's int8
    path (its topk takes the NaN for an outlier) do, not finite values from a code standing for it; other rows keep
    theirs."""
    kernel = native_build(body, "gemm_w8a8")
    gen = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(40, in_features, generator=gen), torch.randn(rows, in_features, generator=gen)
    x[1, in_features // 2] = float("nan")
    y = kernel(x, pack_w8a8_panels(*quantize_symmetric(weight)), None, 40)
    expected = _reference(x, weight, None)
    assert expected[1].isnan().all() and y[1].isnan().all()
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("path", [*BODIES, "torch"])
def test_layer_paths_agree(path):
    """A W8A8 linear layer on either path (chosen when its weight is packed, after loading) gives the quantized
    product; torch's path multiplies the same codes with torch._int_mm."""
    with pytest.MonkeyPatch.context() as patcher:
        native_or_fallback(path, patcher, "gemm_w8a8")
        layer = ReplicatedLinear(96, 48, bias=True, quant_config=Int8Config())
        gen = torch.Generator().manual_seed(1)
        weight, bias = torch.randn(48, 96, generator=gen), torch.randn(48, generator=gen)
        layer.weight_loader(layer.weight, weight)
        layer.weight_loader(layer.bias, bias)
        layer.quant_method.process_weights_after_loading(layer)
        x = torch.randn(2, 7, 96, generator=gen)
        y = layer(x)
    assert layer.weight.dtype == (torch.int8 if path == "torch" else torch.uint8)
    assert y.shape == (2, 7, 48)
    torch.testing.assert_close(y.reshape(14, 48), _reference(x.reshape(14, 96), weight, bias), rtol=1e-5, atol=1e-4)


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "To make a cup of tea, first"]
NUM_TOKENS = 32


def test_int8_model_stays_close_to_dense(dense_smollm):
    """Teacher-forced on the dense model's greedy continuations: the W8A8 model's top token agrees at most
    positions and its log-probs are near (not equal: the products are quantized)."""
    dense = dense_smollm
    with pytest.MonkeyPatch.context() as patcher:
        patcher.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
        int8 = LLM(quantization="int8", **DENSE_SMOLLM_ARGS)
    greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    expected = [o.prompt_token_ids + list(o.outputs[0].token_ids)
                for o in dense.generate(PROMPTS, greedy, use_tqdm=False)]
    ranks, deltas = teacher_forced(int8, dense, expected, NUM_TOKENS)
    agreement = sum(rank == 1 for rank in ranks) / len(ranks)
    print(f"int8 vs dense float32: teacher-forced agreement {agreement:.3f}, max |logprob diff| {max(deltas):.2e}")
    assert agreement >= 0.94  # 0.963 with each token's two largest entries kept out (0.881 without)
    assert 0 < max(deltas) < 1.0


def _save_compressed_tensors(tmp_path, ignore: list[str]) -> LlamaForCausalLM:
    """A tiny Llama as llm-compressor writes W8A8: each linear layer's int8 ``weight`` and float ``weight_scale``
    ``[out, 1]`` (symmetric, per channel), the rest dense. Returns the dense model of the dequantized weights."""
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    tensors = {}
    for name, tensor in model.state_dict().items():
        module = name.removesuffix(".weight")
        if name.endswith("proj.weight") and module not in ignore:
            codes, scales = quantize_symmetric(tensor)
            tensors[name], tensors[f"{module}.weight_scale"] = codes, scales[:, None].to(torch.bfloat16)
            tensor.copy_(codes.float() * tensors[f"{module}.weight_scale"].float())  # the reference's weight
        else:
            tensors[name] = tensor.clone()
    scheme = {"num_bits": 8, "type": "int", "symmetric": True}
    config.quantization_config = {
        "quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head", *ignore],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**scheme, "strategy": "channel",
                                                                         "dynamic": False},
                                      "input_activations": {**scheme, "strategy": "token", "dynamic": True}}}}
    config.save_pretrained(tmp_path)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return model


def test_compressed_tensors_w8a8_checkpoint(tmp_path):
    """Its codes and scales load as they are (layers in ``ignore`` stay dense): the logits equal those of
    ``quantization="int8"`` on the dequantized weights (which quantizes them back to the same codes), and stay
    near the dense model's."""
    reference = _save_compressed_tensors(tmp_path / "w8a8", ignore=[])
    config = load_hf_config(str(tmp_path / "w8a8"))
    model = get_model(str(tmp_path / "w8a8"), config, KernelChoice(torch.float32))
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == (
        torch.uint8 if native.gemm_w8a8() is not None else torch.int8)
    reference.save_pretrained(tmp_path / "dense")
    dense_config = load_hf_config(str(tmp_path / "dense"))
    dense_config.quantization_config = {"quant_method": "int8"}
    requantized = get_model(str(tmp_path / "dense"), dense_config, KernelChoice(torch.float32))
    tokens = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    ours = _logits(model, config, tokens[0].tolist())
    torch.testing.assert_close(ours, _logits(requantized, config, tokens[0].tolist()), rtol=1e-3, atol=1e-3)
    with torch.inference_mode():
        dense = reference(tokens).logits[0]
    assert 0 < (ours - dense).abs().max() < 0.05 * dense.abs().max()


def test_compressed_tensors_ignore_list_stays_dense(tmp_path):
    attention = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    _save_compressed_tensors(tmp_path, ignore=["model.layers.1.mlp.down_proj", *attention])
    model = get_model(str(tmp_path), load_hf_config(str(tmp_path)), KernelChoice(torch.float32))
    layers = model.model.layers
    assert isinstance(layers[1].mlp.gate_up_proj.quant_method, Int8LinearMethod)
    assert not isinstance(layers[1].mlp.down_proj.quant_method, Int8LinearMethod)
    assert not isinstance(layers[0].self_attn.qkv_proj.quant_method, Int8LinearMethod)
    _save_compressed_tensors(tmp_path / "half", ignore=attention[1:2])
    with pytest.raises(ValueError, match="qkv_proj fuses .* ignored all together"):
        get_model(str(tmp_path / "half"), load_hf_config(str(tmp_path / "half")), KernelChoice(torch.float32))


def _change_quantization_config(path, change) -> None:
    """Rewrite the checkpoint's quantization_config by ``change``, a function editing it in place."""
    config = json.loads((path / "config.json").read_text())
    change(config["quantization_config"])
    (path / "config.json").write_text(json.dumps(config))


def test_compressed_tensors_ignore_patterns_match_from_the_names_start(tmp_path):
    """As compressed-tensors' match_name and vLLM: a ``re:`` entry of the ignore list matches from the module name's
    start (re.match), so ``re:.*mlp`` keeps every MLP layer dense, as the checkpoint holds them (read as a full
    match it named none: their dense weights were cast into int8 codes, and the load failed lacking their scales)."""
    _save_compressed_tensors(tmp_path, ignore=[f"model.layers.{i}.mlp.{p}_proj" for i in range(2)
                                               for p in ("gate", "up", "down")])
    _change_quantization_config(tmp_path, lambda qc: qc.update(ignore=["lm_head", "re:.*mlp"]))
    layers = get_model(str(tmp_path), load_hf_config(str(tmp_path)), KernelChoice(torch.float32)).model.layers
    assert not isinstance(layers[1].mlp.gate_up_proj.quant_method, Int8LinearMethod)
    assert not isinstance(layers[0].mlp.down_proj.quant_method, Int8LinearMethod)
    assert isinstance(layers[0].self_attn.qkv_proj.quant_method, Int8LinearMethod)


def test_compressed_tensors_layers_no_group_targets_stay_dense(tmp_path):
    """As vLLM: a layer that no config group's ``targets`` names is dense in the checkpoint and loads so, whatever
    the ignore list says (every linear layer was taken as quantized: the dense attention weights were cast into int8
    codes, and the load failed lacking their scales); a fused layer's parts are targeted all together or not at all."""
    def save(path, targets: list[str]) -> LlamaForCausalLM:
        def change(qc):
            qc["ignore"], qc["config_groups"]["group_0"]["targets"] = ["lm_head"], targets

        reference = _save_compressed_tensors(path, ignore=[f"model.layers.{i}.self_attn.{p}_proj" for i in range(2)
                                                           for p in "qkvo"])
        _change_quantization_config(path, change)
        return reference

    reference = save(tmp_path / "mlp", ["re:.*mlp"])
    config = load_hf_config(str(tmp_path / "mlp"))
    model = get_model(str(tmp_path / "mlp"), config, KernelChoice(torch.float32))
    layers = model.model.layers
    assert isinstance(layers[1].mlp.gate_up_proj.quant_method, Int8LinearMethod)
    assert not isinstance(layers[1].self_attn.qkv_proj.quant_method, Int8LinearMethod)
    assert not isinstance(layers[0].self_attn.o_proj.quant_method, Int8LinearMethod)
    tokens = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        dense = reference(tokens).logits[0]
    assert (_logits(model, config, tokens[0].tolist()) - dense).abs().max() < 0.05 * dense.abs().max()
    save(tmp_path / "q", ["re:.*mlp", "re:.*q_proj"])
    with pytest.raises(ValueError, match="qkv_proj fuses .* targeted all together"):
        get_model(str(tmp_path / "q"), load_hf_config(str(tmp_path / "q")), KernelChoice(torch.float32))


def test_compressed_tensors_kv_cache_scales_load(tmp_path):
    """A checkpoint with a kv_cache_scheme holds each attention's KV cache scales (self_attn.k_scale and v_scale, as
    llm-compressor writes them, with zero points of 0 beside them; k_proj.output_scale in older exports), which vLLM
    loads (the zero points it ignores): it loads, over a float32 cache (which no scale applies to) computing as the
    same checkpoint without them (it failed: a tensor matching no parameter). How an fp8 cache applies them:
    tests/test_kv_cache_dtype.py."""
    _save_compressed_tensors(tmp_path / "plain", ignore=[])
    _save_compressed_tensors(tmp_path / "kv", ignore=[])
    tensors = load_file(str(tmp_path / "kv" / "model.safetensors"))
    for i, kind in enumerate(("self_attn.{}_scale", "self_attn.{}_proj.output_scale")):
        tensors.update({f"model.layers.{i}.{kind.format(kv)}": torch.tensor([0.02]) for kv in "kv"})
    tensors.update({f"model.layers.0.self_attn.{qkv}_zero_point": torch.zeros(1, dtype=torch.int8) for qkv in "qkv"})
    save_file(tensors, str(tmp_path / "kv" / "model.safetensors"))
    _change_quantization_config(tmp_path / "kv", lambda qc: qc.update(kv_cache_scheme={
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}))
    EngineArgs(str(tmp_path / "kv")).create_engine_config()
    tokens = torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(2)).tolist()
    logits = [_logits(get_model(str(path), config, KernelChoice(torch.float32)), config, tokens)
              for path in (tmp_path / "kv", tmp_path / "plain") for config in [load_hf_config(str(path))]]
    assert torch.equal(*logits)


def test_per_head_kv_cache_scales_need_strategy_attn_head(tmp_path):
    """As vLLM, whose k_scale and v_scale under a kv_cache_scheme of strategy "tensor" are one value each (its load of
    a longer tensor fails): per-KV-head scales there are a ValueError naming the tensor and the strategy, before any
    cache exists (they loaded, each head scaled by its own value); under "attn_head" they load, one a KV head."""
    def load(strategy: str):
        path = tmp_path / strategy
        _save_compressed_tensors(path, ignore=[])
        tensors = load_file(str(path / "model.safetensors"))
        scales = {f"model.layers.{i}.self_attn.{kv}_scale": torch.tensor([0.5, 2.0]) for i in range(2) for kv in "kv"}
        save_file({**tensors, **scales}, str(path / "model.safetensors"))
        _change_quantization_config(path, lambda qc: qc.update(kv_cache_scheme={
            "num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False, "symmetric": True}))
        return get_model(str(path), load_hf_config(str(path)), KernelChoice(torch.float32))

    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.k_scale': the kv_cache_scheme's strategy 'tensor' "
                                         r"takes one KV cache scale a layer, got shape \(2,\)"):
        load("tensor")
    kv_scales = load("attn_head").model.layers[0].self_attn.attn.impl.kv_scales
    assert torch.equal(kv_scales, torch.tensor([[0.5, 2.0], [0.5, 2.0]]))


def test_compressed_tensors_kv_cache_only_checkpoint(tmp_path):
    """As vLLM's CompressedTensorsConfig: a checkpoint of dense weights and fp8 KV cache scales only (format "dense",
    its one config group the attention's activations, which vLLM skips: they are the kv_cache_scheme's) runs, every
    linear layer dense and an fp8 cache scaled by its k_scale and v_scale (it was refused: format 'dense', a group
    without int8 weights)."""
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    scales = {f"model.layers.{i}.self_attn.{kv}_scale": torch.tensor([0.25 if kv == "k" else 0.5]) for i in range(2)
              for kv in "kv"}
    save_file({**tensors, **scales}, str(tmp_path / "model.safetensors"))
    fp8_tensor = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    quantization_config = {"quant_method": "compressed-tensors", "format": "dense", "ignore": [],
                           "config_groups": {"attention": {"targets": ["LlamaAttention"],
                                                           "input_activations": fp8_tensor}},
                           "kv_cache_scheme": fp8_tensor}
    config_json = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config_json, "quantization_config": quantization_config}))
    assert EngineArgs(str(tmp_path)).create_engine_config().cache_config.cache_dtype == "fp8"
    layers = get_model(str(tmp_path), load_hf_config(str(tmp_path)), KernelChoice(torch.float32)).model.layers
    assert not any(isinstance(layer.quant_method, Int8LinearMethod) for layer in
                   (layers[0].self_attn.qkv_proj, layers[1].self_attn.o_proj, layers[1].mlp.gate_up_proj))
    assert torch.equal(layers[1].self_attn.attn.impl.kv_scales, torch.tensor([[0.25, 0.25], [0.5, 0.5]]))


def test_kv_cache_scheme_makes_auto_an_fp8_cache(tmp_path):
    """As vLLM: a checkpoint declaring an fp8 kv_cache_scheme gets an fp8 KV cache under kv_cache_dtype "auto" (its
    k_scale and v_scale are that cache's; it got the model's dtype, the scales unused); a kv_cache_dtype given wins,
    but fp8_e5m2, which vLLM refuses with such a checkpoint; per-head scales (strategy "attn_head") too; a scheme vLLM
    does not run (not 8-bit float, not per tensor or per head, not symmetric) is a config error naming the scheme."""
    scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}

    def cache_dtype(change: dict | None, **kwargs) -> str:
        """The cache's dtype for the checkpoint with the scheme changed by ``change`` (None: no scheme)."""
        path = tmp_path / str(len(list(tmp_path.iterdir())))  # a config is read once per path and process
        _save_compressed_tensors(path, ignore=[])
        if change is not None:
            _change_quantization_config(path, lambda qc: qc.update(kv_cache_scheme={**scheme, **change}))
        return EngineArgs(str(path), **kwargs).create_engine_config().cache_config.cache_dtype

    assert cache_dtype({}) == "fp8" and cache_dtype({}, kv_cache_dtype="int8") == "int8"
    assert cache_dtype(None) == "auto" and cache_dtype({"strategy": "attn_head"}) == "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e5m2' is not supported with the checkpoint's"):
        cache_dtype({}, kv_cache_dtype="fp8_e5m2")
    for change, message in (({"num_bits": 4}, "num_bits=4"), ({"type": "int"}, "type='int'"),
                            ({"strategy": "channel"}, "strategy 'channel'"), ({"symmetric": False}, "asymmetric")):
        with pytest.raises(ValueError, match=f"The checkpoint's kv_cache_scheme.*{message}"):
            cache_dtype(change)


def _logits(model, config, tokens: list[int]) -> torch.Tensor:
    return PagedBatchRunner(model, config, block_size=4).step({0: tokens}, [Chunk(0, 0, len(tokens))])[0]


@pytest.mark.parametrize("change, message", [
    (lambda qc: qc.update(format="pack-quantized"), "format 'pack-quantized'"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(strategy="tensor"), "weights must be 8-bit"),
    (lambda qc: qc["config_groups"]["group_0"]["input_activations"].update(dynamic=False), "dynamic per token"),
    # vLLM raises on a sparsity_config with targets (sparse checkpoints no longer run); it was ignored here
    (lambda qc: qc.update(sparsity_config={"format": "sparse-24-bitmask", "targets": ["Linear"],
                                           "sparsity_structure": "2:4"}),
     r"sparsity_config \(format 'sparse-24-bitmask', targets \['Linear'\]\) is not supported"),
])
def test_unsupported_compressed_tensors_scheme_is_a_config_error(tmp_path, change, message):
    _save_compressed_tensors(tmp_path, ignore=[])
    _change_quantization_config(tmp_path, change)
    with pytest.raises(ValueError, match=message):
        EngineArgs(str(tmp_path)).create_engine_config()
    _save_compressed_tensors(tmp_path / "good", ignore=[])
    with pytest.raises(ValueError, match="already quantized"):
        EngineArgs(str(tmp_path / "good"), quantization="int8").create_engine_config()


def test_quantization_may_name_the_checkpoints_own_scheme(tmp_path):
    """As vLLM: ``quantization="compressed-tensors"`` (``--quantization compressed-tensors``) runs a compressed-tensors
    checkpoint's own scheme, as leaving it unset does; a dense checkpoint has none to run."""
    _save_compressed_tensors(tmp_path / "w8a8", ignore=[])
    config = EngineArgs(str(tmp_path / "w8a8"), quantization="compressed-tensors").create_engine_config()
    assert config.model_config.hf_config.quantization_config["format"] == "int-quantized"
    parser = make_arg_parser(argparse.ArgumentParser())
    assert parser.parse_args(["--quantization", "compressed-tensors"]).quantization == "compressed-tensors"
    assert parser.parse_args(["-q", "int8"]).quantization == "int8"  # vLLM's short form of the flag
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                vocab_size=256).save_pretrained(tmp_path / "dense")
    with pytest.raises(ValueError, match="quantization='compressed-tensors' is a quantized checkpoint's own scheme"):
        EngineArgs(str(tmp_path / "dense"), quantization="compressed-tensors").create_engine_config()


@pytest.mark.parametrize("lesser", ["no_amx", "avx2", "avx2_no_vnni"])
def test_the_bodies_agree_to_the_bit(lesser):
    """The AVX512-VNNI body beside AMX tiles, and the 256-bit body (AVX-VNNI's vpdpbusd or AVX2's vpmaddubsw steps),
    compute what this CPU's best body does, bit for bit (codes, int32 sums, epilogue order)."""
    best, narrow = native_build("native", "gemm_w8a8"), native_build(lesser, "gemm_w8a8")
    gen = torch.Generator().manual_seed(7)
    weight, bias = torch.randn(200, 300, generator=gen), torch.randn(200, generator=gen)
    panels = pack_w8a8_panels(*quantize_symmetric(weight))
    x = torch.randn(37, 300, generator=gen) * torch.logspace(-3, 3, 300)  # rows with wide ranges
    x[0, [3, 90, 250]] = 1e4  # ties for the largest |x|: the first two are the outliers, the third sets the scale
    x[1, [40, 41]], x[1, [7, 299]] = -1e4, 5e3  # the largest repeated, the second at both ends
    x[2, [280, 299]], x[2, [10, 20]] = 1e4, 5e3  # the second largest twice, before the largest
    x[3], x[4] = 0.0, 1.0  # every entry a tie
    assert torch.equal(best(x, panels, bias, 200), narrow(x, panels, bias, 200))
    gated = pack_w8a8_panels(*quantize_symmetric(weight[:192]))
    assert torch.equal(native_build("native", "gemm_w8a8_silu_mul")(x, gated, None, 192, out_width=96),
                       native_build(lesser, "gemm_w8a8_silu_mul")(x, gated, None, 192, out_width=96))


def test_amx_tiles_where_the_os_allows():
    """The W8A8 products multiply on AMX tiles where the CPU has AMX-INT8 and the OS grants the tiles (as gemm_bf16
    does on AMX-BF16), and never in the build without them."""
    if native.gemm_w8a8() is None:
        pytest.skip("no W8A8 kernel here")
    granted = native.gemm_bf16() is not None and native.gemm_bf16_uses_amx()
    assert native.gemm_int8_uses_amx() == (granted and "amx_int8" in cpu_flags())
    assert not native.gemm_int8_uses_amx(("-mno-amx-tile",))


@pytest.mark.parametrize("body", BODIES)
def test_gated_panels_fuse_the_activation(body, monkeypatch):
    """A gated MLP's gate_up layer laid out for fused_silu: silu_and_mul is silu(gate) * up of the quantized
    product in one kernel, and the layer's whole output (asked for when the activation cannot be fused) is still
    [gate | up]."""
    for kernel in ("gemm_w8a8", "gemm_w8a8_silu_mul"):
        native_or_fallback(body, monkeypatch, kernel)
    layer = MergedColumnParallelLinear(96, [64, 64], bias=False, quant_config=Int8Config(), gated_silu=True)
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(128, 96, generator=gen)
    layer.weight_loader(layer.weight, weight[:64], 0)
    layer.weight_loader(layer.weight, weight[64:], 1)
    layer.quant_method.process_weights_after_loading(layer, WeightLayout(fused_silu=True))
    assert layer.quant_method.gated
    x = torch.randn(9, 96, generator=gen)
    expected = _reference(x, weight, None)
    torch.testing.assert_close(layer(x), expected, rtol=1e-6, atol=1e-5)
    gate, up = expected.chunk(2, dim=-1)
    torch.testing.assert_close(layer.silu_and_mul(x), torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["gptq", "fp8", "awq"])
def test_a_checkpoint_quantized_otherwise_is_a_config_error_naming_its_quant_method(tmp_path, method):
    """A checkpoint quantized by a method that does not run here is refused before any process, naming its own
    quantization_config (it was told that the engine argument quantization, which was not given, must be another)."""
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         vocab_size=256)
    config.quantization_config = {"quant_method": method, "bits": 4}
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"is quantized by '{method}' \\(its quantization_config's quant_method\\)"):
        EngineArgs(str(tmp_path)).create_engine_config()


def test_compressed_tensors_mixture_of_experts_is_a_config_error(tmp_path):
    from transformers import MixtralConfig

    config = MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=256, num_local_experts=4)
    config.quantization_config = {"quant_method": "compressed-tensors", "format": "int-quantized",
                                  "config_groups": {}}
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="mixture-of-experts models .* not supported"):
        EngineArgs(str(tmp_path)).create_engine_config()
