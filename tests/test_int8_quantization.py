"""quantization="int8" (W8A8): the native kernel computes exactly the quantized product (per-token activation codes
times per-channel weight codes, summed in int32, scaled once), torch's int8 path agrees with it, and the quantized
SmolLM2 stays close to the dense one, teacher-forced (tests/e2e/test_cpu_graphs.py: its decode steps replay CPU
graphs)."""

import pytest
import torch

from pagedllm import LLM, SamplingParams, native
from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.layers.quantization.int8 import Int8Config, pack_w8a8_panels, quantize_symmetric
from tests.model_fixtures import teacher_forced
from tests.native_paths import native_or_fallback


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The W8A8 product in exact integer arithmetic (float64 holds these sums exactly), then the kernel's epilogue."""
    x_codes, x_scales = quantize_symmetric(x)
    w_codes, w_scales = quantize_symmetric(weight)
    acc = (x_codes.double() @ w_codes.double().T).float()
    y = acc * x_scales[:, None] * w_scales[None, :]
    return y if bias is None else y + bias


@pytest.mark.parametrize("rows, out_features, in_features", [
    (1, 64, 64), (3, 40, 60), (5, 17, 7), (17, 1536, 576), (130, 576, 1536), (0, 16, 16)])
def test_native_kernel_is_the_quantized_product(rows, out_features, in_features):
    kernel = native.gemm_w8a8()
    if kernel is None:
        pytest.skip("no AVX512-VNNI int8 kernel here")
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


@pytest.mark.parametrize("path", ["native", "torch"])
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
    assert layer.weight.dtype == (torch.uint8 if path == "native" else torch.int8)
    assert y.shape == (2, 7, 48)
    torch.testing.assert_close(y.reshape(14, 48), _reference(x.reshape(14, 96), weight, bias), rtol=1e-5, atol=1e-4)


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "To make a cup of tea, first"]
NUM_TOKENS = 32
LLM_ARGS = dict(dtype="float32", max_model_len=512, kv_cache_memory="64MiB")


def test_int8_model_stays_close_to_dense():
    """Teacher-forced on the dense model's greedy continuations: the W8A8 model's top token agrees at most
    positions and its log-probs are near (not equal: the products are quantized)."""
    with pytest.MonkeyPatch.context() as patcher:
        patcher.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
        dense, int8 = LLM(**LLM_ARGS), LLM(quantization="int8", **LLM_ARGS)
    greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    expected = [o.prompt_token_ids + list(o.outputs[0].token_ids)
                for o in dense.generate(PROMPTS, greedy, use_tqdm=False)]
    ranks, deltas = teacher_forced(int8, dense, expected, NUM_TOKENS)
    agreement = sum(rank == 1 for rank in ranks) / len(ranks)
    print(f"int8 vs dense float32: teacher-forced agreement {agreement:.3f}, max |logprob diff| {max(deltas):.2e}")
    assert agreement >= 0.85
    assert 0 < max(deltas) < 2.0
