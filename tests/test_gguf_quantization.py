"""quantization="gguf": a GGUF's Q4_0/Q4_1/Q4_K, Q8_0 and Q6_K linear weights kept packed where a kernel takes them,
every other type dequantized at load.

The dense float32 path on the loader's dequantized weights is the reference: gemm_q8_f32 scales each code in
registers with the loader's one rounding and sums in the dense kernel's order, so a Q8_0 layer must equal the dense
native GEMM bit for bit, and so must a model of such layers (and Q4 ones, whose kernels gguf_int4's tests check).
"""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from pagedllm import LLM, SamplingParams, native
from pagedllm.engine.arg_utils import set_quantization
from pagedllm.layers.gemm_layout import DenseWeight, QuantizedWeight, WeightLayout, pack_q8_panels, pack_q8kc_panels
from pagedllm.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, ReplicatedLinear,
                                    RowParallelLinear, UnquantizedLinearMethod)
from pagedllm.layers.quantization.gguf import GGUFConfig, GGUFInt4Config
from pagedllm.layers.quantization.gguf_int4 import GGUFInt4LinearMethod
from pagedllm.layers.quantization.gguf_iq4 import GGUFIQ4LinearMethod
from pagedllm.layers.quantization.gguf_mixed import GGUFMixedLinearMethod
from pagedllm.layers.quantization.gguf_q8 import (GGUFQ2KLinearMethod, GGUFQ5KLinearMethod, GGUFQ6KLinearMethod,
                                                  GGUFQ8LinearMethod)
from pagedllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.models.gguf_loader import (dequantize_fast, unpack_iq4, unpack_q2_k, unpack_q3_k, unpack_q4, unpack_q5_k,
                                         unpack_q6_k, unpack_q8)
from pagedllm.models.hf_config import load_hf_config
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.loader import get_model, get_quant_config
from pagedllm.native.gemms import BF16_MODEL
from pagedllm.native.graph import CpuGraph
from pagedllm.platforms.interface import KernelChoice
from tests.conftest import DENSE_SMOLLM_ARGS
from tests.model_fixtures import Chunk, PagedBatchRunner, quantize_gguf, quantize_q6_k, smollm_path, write_tiny_gguf
from tests.native_paths import native_or_fallback
from tests.test_int4_quantization import gguf_layer

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # many small model steps

needs_q8_kernel = pytest.mark.skipif(native.gemm_q8() is None,
                                     reason="no gemm_q8_f32 here (needs a C compiler and AVX-512 or AVX2)")


@pytest.fixture(params=["native", "no_vbmi", "avx2"])
def q8_kernel(request, monkeypatch):
    """gemm_q8_f32 (and the other quantized GEMMs but Q4's) as built for this CPU, without AVX512-VBMI where the CPU
    has it (the packed K-quants' other AVX-512 body), and its AVX2 body where the CPU has AVX-512."""
    for kernel in ("gemm_q6k", "gemm_q6kc", "gemm_q3kc", "gemm_q5k", "gemm_q5kc", "gemm_q2k", "gemm_q2kc",
                   "gemm_iq4nl", "gemm_iq4xs"):
        native_or_fallback(request.param, monkeypatch, kernel)
    return native_or_fallback(request.param, monkeypatch, "gemm_q8")


def _q8_weight(shape: tuple[int, int], seed: int) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """GGUF Q8_0 blocks of a random weight, and their unpacked codes and scales."""
    blocks = quantize(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32), T.Q8_0)
    codes, scales = (torch.from_numpy(part) for part in unpack_q8(blocks))
    return blocks, codes, scales


def _q8_layer(layer_class, codes, scales, bias=None, **kwargs):
    """A linear layer quantized by quantization="gguf" as a Q8_0 checkpoint tensor, loaded with its codes and
    scales."""
    config = GGUFConfig({"layer.weight": T.Q8_0}, [])
    layer = gguf_layer(layer_class, config, {"qweight": codes, "scales": scales}, bias, **kwargs)
    assert isinstance(layer.quant_method, GGUFQ8LinearMethod)
    return layer


@needs_q8_kernel
@pytest.mark.parametrize("with_bias", [False, True])
def test_q8_layer_equals_the_dense_path_bit_for_bit(with_bias, q8_kernel):
    blocks, codes, scales = _q8_weight((96, 128), seed=0)
    bias = torch.randn(96) if with_bias else None
    layer = _q8_layer(ReplicatedLinear, codes, scales, bias)
    dense = DenseWeight(torch.from_numpy(dequantize_fast(blocks, T.Q8_0)))  # what the dense path holds
    weight = torch.from_numpy(dequantize(blocks, T.Q8_0))
    for rows in (1, 2, 5, 6, 7, 10, 40, 128):  # tiles (AVX2: by vector pairs), of half panels (7-10), a scratch panel
        x = torch.randn(rows, 128)
        y = layer(x)
        assert y.dtype == torch.float32 and y.shape == (rows, 96)
        assert torch.equal(y, dense.linear(x, bias))
        torch.testing.assert_close(y, torch.addmm(bias, x, weight.T) if with_bias else x @ weight.T)


@needs_q8_kernel
def test_one_row_of_int8_codes_split_by_half_panels_between_threads_equals_the_dense_path(q8_kernel):
    """Q8_0 codes through a single row's split of an odd number of panels by halves (test_int4_quantization's test
    for nibbles): any thread count gives the dense path's columns, bit for bit."""
    blocks, codes, scales = _q8_weight((160, 128), seed=4)  # 3 panels, the last of 32 columns
    layer = _q8_layer(ReplicatedLinear, codes, scales)
    x = torch.randn(1, 128)
    expected = DenseWeight(torch.from_numpy(dequantize_fast(blocks, T.Q8_0))).linear(x)
    for threads in range(2, 7):
        torch.set_num_threads(threads)
        assert torch.equal(layer(x), expected), threads


# per type kept packed besides Q4_0/Q4_1/Q4_K/Q8_0: its unpacking, method, kernel and panel shape for 96 x 512
# (the K-quants' factored panels: a header of 2 super-blocks' 64 float32 scale factors (and zero factors), then per
# block 64 multipliers (and 64 more; Q2_K's two 4-bit ones in one byte each) and the block's codes bit-packed: rows
# of 32 bytes of nibbles (Q6_K, Q5_K) then rows of their 2 (Q6_K, Q2_K) or 1 (Q5_K) bits above; Q3_K's 3-bit codes
# in rows of 24 bytes alone)
PACKED_TYPES = {T.Q6_K: (unpack_q6_k, GGUFQ6KLinearMethod, "gemm_q6kc_f32", (2, 2 * 256 + 32 * (64 + 16 * 48))),
              T.Q5_K: (unpack_q5_k, GGUFQ5KLinearMethod, "gemm_q5kc_f32", (2, 2 * 512 + 16 * (128 + 32 * 40))),
              T.IQ4_XS: (lambda b: unpack_iq4(b, T.IQ4_XS), GGUFIQ4LinearMethod, "gemm_iq4xs_f32", (2, 16, 1280)),
              T.IQ4_NL: (lambda b: unpack_iq4(b, T.IQ4_NL), GGUFIQ4LinearMethod, "gemm_iq4nl_f32", (2, 16, 1152)),
              T.Q3_K: (unpack_q3_k, GGUFQ6KLinearMethod, "gemm_q3kc_f32", (2, 2 * 256 + 32 * (64 + 16 * 24))),
              T.Q2_K: (unpack_q2_k, GGUFQ2KLinearMethod, "gemm_q2kc_f32", (2, 2 * 512 + 32 * (64 + 16 * 16)))}
# where the fp16 scales of a block of each type gguf-py cannot quantize sit, for _random_blocks
FP16_AT = {T.IQ4_XS: (0,), T.IQ4_NL: (0,), T.Q3_K: (108,), T.Q2_K: (80, 82)}


def _random_blocks(rows: int, cols: int, tensor_type: T, seed: int) -> np.ndarray:
    """GGUF blocks of ``tensor_type`` of any bytes but sane fp16 scales (the types gguf-py cannot quantize:
    FP16_AT), else a quantized random weight."""
    if tensor_type not in FP16_AT:
        return quantize_gguf(np.random.default_rng(seed).standard_normal((rows, cols), dtype=np.float32), tensor_type)
    block, size = GGML_QUANT_SIZES[tensor_type]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in FP16_AT[tensor_type]:
        blocks[..., at:at + 2] = rng.uniform(1e-3, 0.05, (rows, cols // block, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


@needs_q8_kernel
@pytest.mark.parametrize("tensor_type", sorted(PACKED_TYPES, key=lambda t: t.name), ids=lambda t: t.name)
def test_k_quant_and_iq4_layers_equal_the_dense_path_bit_for_bit(q8_kernel, tensor_type):
    """Q6_K (Q3_K) as int8 codes q - 32 (q - 4) with a scale per 16 inputs, Q5_K (Q2_K) as codes q with a scale
    d * sc and zero -dmin * m per 32 (16), the codes bit-packed and the scales and zeros factored per super-block
    (0.83 (0.45), 0.72 / 0.41 bytes a weight), IQ4_XS and IQ4_NL as 4-bit indices into
    their 16 values with a float32 (fp16) scale per 32 (0.63 / 0.56 bytes): one rounding per weight, the loader's,
    so gguf's dequantization and the dense GEMM's results exactly."""
    unpack, method, kernel, shape = PACKED_TYPES[tensor_type]
    blocks = _random_blocks(96, 512, tensor_type, seed=2)
    parts = [torch.from_numpy(part) for part in unpack(blocks)]
    assert parts[0].dtype == method.code_dtype
    layer = gguf_layer(ReplicatedLinear, GGUFConfig({"layer.weight": tensor_type}, []),
                       dict(zip(("qweight", "scales", "zeros"), parts)))
    assert isinstance(layer.quant_method, method)
    assert layer.quant_method.packed.kernel.name == kernel and layer.qweight.shape == shape
    dense = DenseWeight(torch.from_numpy(dequantize_fast(blocks, tensor_type)))
    weight = torch.from_numpy(dequantize(blocks, tensor_type))
    assert torch.equal(torch.from_numpy(dequantize_fast(blocks, tensor_type)), weight)
    for rows in (1, 2, 5, 6, 7, 10, 40):  # tiles (AVX2: by vector pairs), of half panels (7-10), a scratch panel
        x = torch.randn(rows, 512)
        y = layer(x)
        assert torch.equal(y, dense.linear(x))
        torch.testing.assert_close(y, x @ weight.T, rtol=1e-4, atol=1e-3)  # torch's own order of sums


@pytest.mark.skipif(not native.gemm_bf16_uses_amx() or native.dequant_bf16() is None,
                    reason="no AMX tiles here: quantized layers keep their own kernels at every row count")
@pytest.mark.parametrize("tensor_type", [T.Q4_1, T.Q4_K, T.Q6_K, T.Q3_K, T.Q8_0], ids=lambda t: t.name)
def test_a_bfloat16_models_long_steps_multiply_quantized_layers_on_bf16_panels(tensor_type):
    """In a bfloat16 model on AMX a step of BF16_MIN_ROWS rows or more dequantizes a quantized layer's weight into
    the model's bf16 scratch as gemm_bf16's panels and multiplies there: bit for bit the dense bf16 layer on the
    dequantized weight (what the same model without quantization computes); fewer rows keep the quantized kernel,
    the float32 product. The scratch, shared by the model's layers, holds the largest of them."""
    from pagedllm.layers.gemm_layout import BF16_MIN_ROWS, WeightLayout, pack_bf16_panels
    unpack = {T.Q4_1: lambda b: unpack_q4(b, T.Q4_1), T.Q4_K: lambda b: unpack_q4(b, T.Q4_K), T.Q6_K: unpack_q6_k,
              T.Q3_K: unpack_q3_k, T.Q8_0: unpack_q8}[tensor_type]
    layout = WeightLayout(bf16_panels=True)
    weights = []
    for n, k in ((96, 512), (200, 256)):  # the second has more panels, fewer inputs, and a partial panel
        blocks = _random_blocks(n, k, tensor_type, seed=n)
        parts = [torch.from_numpy(part) for part in unpack(blocks)]
        make = QuantizedWeight.q4 if tensor_type in (T.Q4_1, T.Q4_K) else QuantizedWeight.q8
        weights.append((make(*parts, layout=layout), torch.from_numpy(dequantize_fast(blocks, tensor_type))))
    assert all(w.bf16_layout is layout for w, _ in weights)
    for weight, dense in weights:
        bf16 = pack_bf16_panels(dense)
        for rows in (BF16_MIN_ROWS, 70):
            x = torch.randn(rows, dense.shape[1])
            assert torch.equal(weight.linear(x), native.gemm_bf16()(x, bf16, None, dense.shape[0]))
        x = torch.randn(BF16_MIN_ROWS - 1, dense.shape[1])
        assert torch.equal(weight.linear(x), DenseWeight(dense).linear(x))


@pytest.mark.skipif(native.gemm_q4() is None or native.gemm_q4().for_bf16_model() is None,
                    reason="no block sums here (gemm_quant.h's tile_quant_sums: AVX512-VBMI)")
@pytest.mark.parametrize("tensor_type", [T.Q4_0, T.Q4_1, T.Q4_K, T.Q8_0, T.Q6_K, T.Q5_K, T.Q3_K, T.Q2_K, T.IQ4_NL,
                                         T.IQ4_XS], ids=lambda t: t.name)
@pytest.mark.parametrize("out_features", [160, 144])  # 3 panels, the last of 32 or 16 columns
def test_a_bfloat16_models_decode_rows_take_block_sums(tensor_type, out_features):
    """In a bfloat16 model (a layout with bf16 panels) the product of up to 4 rows (decode steps' batches) is
    s * sum(x * code) + zero * sum(x) per block (gemm_quant.h's tile_quant_sums; Q8_0's LM heads too): the product of
    the rows and the dequantized weight to float32 rounding, whatever the thread count splits of the panels' halves,
    but not the dense kernel's bits, which a float32 model and more rows keep."""
    blocks = _random_blocks(out_features, 512, tensor_type, seed=4)
    four_bit = tensor_type in (T.Q4_0, T.Q4_1, T.Q4_K)
    unpack = {T.Q8_0: unpack_q8, T.Q6_K: unpack_q6_k, T.Q5_K: unpack_q5_k, T.Q3_K: unpack_q3_k, T.Q2_K: unpack_q2_k,
              T.IQ4_NL: lambda b: unpack_iq4(b, T.IQ4_NL), T.IQ4_XS: lambda b: unpack_iq4(b, T.IQ4_XS)}.get(tensor_type)
    codes, scales, *zeros = (torch.from_numpy(part) for part in (unpack_q4(blocks, tensor_type) if four_bit
                                                                 else unpack(blocks)))

    def make(layout: WeightLayout | None) -> QuantizedWeight:
        if four_bit:
            return QuantizedWeight.q4(codes, scales, zeros[0], layout)
        if tensor_type in (T.IQ4_NL, T.IQ4_XS):
            return QuantizedWeight.iq4(codes, scales, layout)
        return QuantizedWeight.q8(codes, scales, layout, *zeros)

    layer, float32_model = make(WeightLayout(bf16_panels=True)), make(None)
    assert layer.kernel.format_args[0] & BF16_MODEL and not float32_model.kernel.format_args[0] & BF16_MODEL
    weight = torch.from_numpy(dequantize_fast(blocks, tensor_type))
    bias = torch.randn(out_features)
    for rows, thread_counts in ((1, range(1, 7)), (2, (1, 3)), (4, (2,)), (5, (2,))):  # 6 threads: a half panel alone
        x = torch.randn(rows, 512) * 3
        expected = x.double() @ weight.double().T + bias.double()
        scale = x.double().abs() @ weight.double().abs().T + bias.double().abs()  # what rounding errors are relative to
        dense = DenseWeight(weight).linear(x, bias)
        for threads in thread_counts:
            torch.set_num_threads(threads)
            y = layer.linear(x, bias)
            assert torch.equal(float32_model.linear(x, bias), dense)
            if rows > 4:  # more rows: the dense kernel's bits
                assert torch.equal(y, dense)
                continue
            assert ((y - expected).abs() / scale).max() < 1e-5, (rows, threads)
            assert not torch.equal(y, dense)


@needs_q8_kernel
def test_codes_past_their_bits_keep_the_int8_layout(q8_kernel):
    """The compact panels hold Q6_K's codes in 6 bits (q - 32 + 32): a code outside [-32, 31], which no Q6_K block
    has, cannot be packed, and such a weight keeps the int8-code layout (gemm_q6k_f32), still the dense product."""
    codes, scales = (torch.from_numpy(part) for part in unpack_q6_k(_random_blocks(64, 256, T.Q6_K, seed=3)))
    assert pack_q8kc_panels(codes, scales) is not None
    codes[5, 7] = 32
    assert pack_q8kc_panels(codes, scales) is None
    weight = QuantizedWeight.q8(codes, scales)
    assert weight.kernel.name == "gemm_q6k_f32"
    x = torch.randn(3, 256)
    dense = (codes.float().reshape(64, 16, 16) * scales[..., None]).reshape(64, 256)
    assert torch.equal(weight.linear(x), DenseWeight(dense).linear(x))


def test_q5_k_blocks_unpack_as_gguf_dequantizes_them():
    """Q5_K blocks of any bytes: code * scale + zero per 32 is gguf's dequantization bit for bit."""
    rng = np.random.default_rng(14)
    blocks = rng.integers(0, 256, (8, 2, 176), dtype=np.uint8)
    blocks[..., :4] = rng.uniform(1e-3, 0.1, (8, 2, 2)).astype(np.float16).view(np.uint8)
    blocks = blocks.reshape(8, -1)
    codes, scales, zeros = unpack_q5_k(blocks)
    assert codes.min() >= 0 and codes.max() == 31 and scales.shape == zeros.shape == (8, 16)
    weight = (codes.reshape(8, 16, 32).astype(np.float32) * scales[..., None] + zeros[..., None]).reshape(8, -1)
    assert np.array_equal(weight, dequantize(blocks, T.Q5_K))
    assert np.array_equal(dequantize_fast(blocks, T.Q5_K), weight)


def test_q6_k_blocks_unpack_as_gguf_dequantizes_them():
    """Q6_K blocks of any bytes: code * scale per 16 is gguf's dequantization bit for bit."""
    rng = np.random.default_rng(13)
    blocks = rng.integers(0, 256, (8, 3, 210), dtype=np.uint8)
    blocks[..., 208:] = rng.uniform(1e-3, 0.05, (8, 3, 1)).astype(np.float16).view(np.uint8)
    blocks = blocks.reshape(8, -1)
    codes, scales = unpack_q6_k(blocks)
    assert codes.min() >= -32 and codes.max() <= 31 and scales.shape == (8, 48)
    weight = (codes.reshape(8, 48, 16).astype(np.float32) * scales[..., None]).reshape(8, -1)
    assert np.array_equal(weight, dequantize(blocks, T.Q6_K))
    assert np.array_equal(dequantize_fast(blocks, T.Q6_K), weight)


@needs_q8_kernel
def test_q8_layer_holds_the_q8_0_bytes_only():
    """The layer keeps the file's codes and fp16 scales in the kernel's panels, ~1.06 bytes a weight, and no
    float copy of the weight."""
    _, codes, scales = _q8_weight((80, 256), seed=1)
    layer = _q8_layer(ReplicatedLinear, codes, scales)
    assert [name for name, _ in layer.named_parameters()] == ["qweight"]
    assert layer.qweight.dtype == torch.uint8 and torch.equal(layer.qweight, pack_q8_panels(codes, scales))
    # Two 64-column panels (the second half padding) of eight blocks: 64 fp16 scales and 32 x 64 int8 codes each.
    assert layer.qweight.shape == (2, 8, 64 * 2 + 32 * 64)
    assert layer.qweight.numel() == 2 * 64 * 256 * 34 // 32


@needs_q8_kernel
def test_tensor_parallel_shards_of_q8_layers_match_unsharded():
    """Codes and scales load [out, in]-major, so the dense layers' weight loaders cut whole blocks per rank."""
    _, c_col, s_col = _q8_weight((128, 128), seed=2)
    _, c_row, s_row = _q8_weight((48, 128), seed=3)
    x = torch.randn(3, 128)
    full_col = _q8_layer(ColumnParallelLinear, c_col, s_col)(x)
    full_row = _q8_layer(RowParallelLinear, c_row, s_row, reduce_results=False)(x)
    cols = [_q8_layer(ColumnParallelLinear, c_col, s_col, tp_size=2, tp_rank=r)(x) for r in range(2)]
    rows = [_q8_layer(RowParallelLinear, c_row, s_row, tp_size=2, tp_rank=r, reduce_results=False)(
        x.chunk(2, dim=-1)[r]) for r in range(2)]
    assert torch.equal(torch.cat(cols, dim=-1), full_col)
    torch.testing.assert_close(sum(rows), full_row)  # the same sums, added in another order


@needs_q8_kernel
@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_fused_layer_of_two_kinds_keeps_each_and_equals_the_dense_layer(tp_size):
    """gate_up_proj of a Q4_K gate and a Q6_K up, with a bias, on each of tp_size ranks: every rank's shards hold
    their own kind's panels, written into one output, equal to the dense layer's rows of that rank bit for bit."""
    gen = np.random.default_rng(4)
    blocks = {"gate": quantize_gguf(gen.standard_normal((128, 256), dtype=np.float32), T.Q4_K),
              "up": quantize_gguf(gen.standard_normal((128, 256), dtype=np.float32), T.Q6_K)}
    parts = {"gate": unpack_q4(blocks["gate"], T.Q4_K), "up": unpack_q6_k(blocks["up"])}
    weight = torch.from_numpy(np.concatenate([dequantize_fast(blocks["gate"], T.Q4_K),
                                              dequantize_fast(blocks["up"], T.Q6_K)]))
    bias, x = torch.randn(256), torch.randn(5, 256)
    config = GGUFConfig({"layer.gate_proj.weight": T.Q4_K, "layer.up_proj.weight": T.Q6_K},
                        [(".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)])
    for rank in range(tp_size):
        layer = MergedColumnParallelLinear(256, [128, 128], bias=True, quant_config=config,
                                           prefix="layer.gate_up_proj", tp_size=tp_size, tp_rank=rank)
        assert isinstance(layer.quant_method, GGUFMixedLinearMethod)
        for shard, (name, unpacked) in enumerate(parts.items()):
            for param_name, value in zip(("qweight", "scales", "zeros"), unpacked):
                param = getattr(layer, param_name)
                param.weight_loader(param, torch.from_numpy(value), shard)
        layer.bias.weight_loader(layer.bias, bias)
        layer.quant_method.process_weights_after_loading(layer)
        assert [w.kernel.name for _, _, w, _ in layer.quant_method.shards] == ["gemm_q4kc_f32", "gemm_q6kc_f32"]
        half = 128 // tp_size
        rows = torch.cat([torch.arange(rank * half, (rank + 1) * half), 128 + torch.arange(rank * half,
                                                                                           (rank + 1) * half)])
        dense = DenseWeight(weight[rows].contiguous())
        assert torch.equal(layer(x), dense.linear(x, bias[rows].contiguous()))
    # its kernels write the output: a CPU graph of the layer replays (decode steps of such models replay graphs)
    graph, static = CpuGraph(), x.clone()
    graph.capture(lambda: layer(static))
    assert graph.failure is None
    static.copy_(torch.randn(5, 256))
    assert torch.equal(graph.replay(), layer(static))


@needs_q8_kernel
def test_q6_k_lm_heads_and_embeddings_keep_their_codes():
    """Q4_K_M files hold the LM head (output.weight, or a tied model's token_embd) in Q6_K: it keeps its codes (int8
    q - 32, a float32 scale per 16); its logits and (tied) its looked-up rows equal the dense weight's exactly."""
    blocks = quantize_q6_k(np.random.default_rng(6).standard_normal((200, 256), dtype=np.float32))
    codes, scales = (torch.from_numpy(part) for part in unpack_q6_k(blocks))
    config = GGUFConfig({"lm_head.weight": T.Q6_K, "model.embed_tokens.weight": T.Q6_K}, [])
    head = ParallelLMHead(200, 256, quant_config=config, prefix="lm_head")
    assert head.q8 and head.scales.shape == (200, 16)
    head.qweight.weight_loader(head.qweight, codes)
    head.scales.weight_loader(head.scales, scales)
    head.prepare_projection()
    hidden = torch.randn(3, 256)
    dense = DenseWeight(torch.from_numpy(dequantize_fast(blocks, T.Q6_K)))
    assert torch.equal(head.project(hidden), dense.linear(hidden))
    assert not hasattr(head, "qweight")  # the panels only
    tied = VocabParallelEmbedding(200, 256, quant_config=config, prefix="model.embed_tokens", embed_scale=1.5)
    tied.qweight.weight_loader(tied.qweight, codes)
    tied.scales.weight_loader(tied.scales, scales)
    tied.prepare_projection()
    assert torch.equal(tied.project(hidden), dense.linear(hidden))
    ids = torch.tensor([0, 5, 199, 5])
    weight = torch.from_numpy(dequantize_fast(blocks, T.Q6_K))
    assert torch.equal(tied(ids), weight[ids] * torch.tensor(1.5))


def test_q8_layers_are_dequantized_where_the_kernel_does_not_apply(monkeypatch):
    """Without gemm_q8_f32 (neither AVX-512 nor AVX2), or for activations it does not take, a Q8_0 layer is left to the dense
    path, which the loader fills with the dequantized weight; Q4 layers keep gguf_int4's kernels. gguf_int4 leaves
    Q8_0 layers dense everywhere."""
    config = GGUFConfig({"q8.weight": T.Q8_0, "q4.weight": T.Q4_1}, [])

    def method(quant_config, prefix, dtype=torch.float32):
        return ReplicatedLinear(64, 32, bias=False, params_dtype=dtype, quant_config=quant_config,
                                prefix=prefix).quant_method

    assert isinstance(method(GGUFInt4Config(config.tensor_types, []), "q8"), UnquantizedLinearMethod)
    assert isinstance(method(config, "q8", torch.bfloat16), UnquantizedLinearMethod)
    assert isinstance(method(config, "q4", torch.bfloat16), GGUFInt4LinearMethod)
    monkeypatch.setattr(native, "gemm_q8", lambda: None)
    assert isinstance(method(config, "q8"), UnquantizedLinearMethod)
    assert isinstance(method(config, "q4"), GGUFInt4LinearMethod)


def _tiny_llama(tmp_path, layer_type, name: str, hidden_size: int = 64) -> str:
    config = LlamaConfig(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    torch.manual_seed(0)
    path = str(tmp_path / f"{name}.gguf")
    write_tiny_gguf(HFLlamaForCausalLM(config), path, "llama", layer_type=layer_type)
    return path


def _load(path: str, quantization: str | None):
    config = load_hf_config(path)
    if quantization is not None:
        set_quantization(config, quantization, path)
    return get_model(path, config, KernelChoice(torch.float32)), config


def _greedy(model, config, prompts: list[list[int]], num_tokens: int) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy continuations of the prompts, batched as the engine batches them (one prefill step, then decode
    steps), and the logits of every step."""
    runner = PagedBatchRunner(model, config)
    tokens = {i: list(p) for i, p in enumerate(prompts)}
    chunks = [Chunk(i, 0, len(p)) for i, p in enumerate(prompts)]
    all_logits = []
    for _ in range(num_tokens):
        logits = [step[-1] for step in runner.step(tokens, chunks)]
        all_logits += logits
        for i, row in enumerate(logits):
            tokens[i].append(int(row.argmax()))
        chunks = [Chunk(i, len(tokens[i]) - 1, 1) for i in tokens]
    return [tokens[i][len(p):] for i, p in enumerate(prompts)], torch.stack(all_logits)


PROMPTS = [[1, 17, 200, 33, 5], [9, 9, 100, 250, 3, 4, 71, 12, 0, 45], [42]]


@needs_q8_kernel
def test_q8_0_model_gives_the_dense_models_greedy_tokens(tmp_path):
    """A tiny Llama whose decoder weights are all Q8_0: with quantization="gguf" every linear layer holds Q8_0
    panels, and its logits, so its greedy tokens, are the dense model's exactly."""
    path = _tiny_llama(tmp_path, T.Q8_0, "llama-q8_0")
    dense, config = _load(path, None)
    q8, _ = _load(path, "gguf")
    for layer in q8.model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(linear.quant_method, GGUFQ8LinearMethod) and linear.qweight.dtype == torch.uint8
            assert not hasattr(linear, "weight")
    (dense_tokens, dense_logits), (q8_tokens, q8_logits) = (_greedy(m, config, PROMPTS, 12) for m in (dense, q8))
    assert q8_tokens == dense_tokens
    assert torch.equal(q8_logits, dense_logits)


# Per checkpoint module: q/k Q8_0 with a Q4_0 v (a fused qkv_proj of two kernels' types: each shard in its own), o_proj
# Q8_0, gate/up Q4_1 (gate_up_proj on the Q4 kernel), down_proj F16 (no packed kernel: dense).
MIXED = {"q_proj": T.Q8_0, "k_proj": T.Q8_0, "v_proj": T.Q4_0, "o_proj": T.Q8_0, "gate_proj": T.Q4_1,
         "up_proj": T.Q4_1, "down_proj": T.F16}


@needs_q8_kernel
def test_mixed_types_each_layer_packed_by_its_kernel_or_dequantized(tmp_path):
    path = _tiny_llama(tmp_path, lambda name: MIXED[name.rsplit(".", 1)[-1]], "llama-mixed")
    dense, config = _load(path, None)
    mixed, _ = _load(path, "gguf")
    expected = {"self_attn.qkv_proj": GGUFMixedLinearMethod, "self_attn.o_proj": GGUFQ8LinearMethod,
                "mlp.gate_up_proj": GGUFInt4LinearMethod, "mlp.down_proj": UnquantizedLinearMethod}
    for layer in mixed.model.layers:
        for name, method in expected.items():
            assert type(layer.get_submodule(name).quant_method) is method, name
    summary = get_quant_config("gguf", path, LlamaForCausalLM).summary(mixed)
    assert summary == ("linear layers kept packed: Q4_0+Q8_0 x2, Q4_1 x2, Q8_0 x2; dequantized at load: F16 x2; "
                       "embeddings and LM heads kept packed: none")
    (dense_tokens, dense_logits), (mixed_tokens, mixed_logits) = (_greedy(m, config, PROMPTS, 8)
                                                                  for m in (dense, mixed))
    assert mixed_tokens == dense_tokens and torch.equal(mixed_logits, dense_logits)
    int4, _ = _load(path, "gguf_int4")  # the Q4 layers only: a qkv_proj with Q8_0 parts is dense there
    assert type(int4.model.layers[0].self_attn.o_proj.quant_method) is UnquantizedLinearMethod
    assert type(int4.model.layers[0].self_attn.qkv_proj.quant_method) is UnquantizedLinearMethod
    assert type(int4.model.layers[0].mlp.gate_up_proj.quant_method) is GGUFInt4LinearMethod


@pytest.mark.skipif(native.gemm_q4k() is None, reason="no gemm_q4k_f32 here (needs a C compiler and AVX-512 or AVX2)")
@pytest.mark.parametrize("base, kernel", [(T.Q4_K, "gemm_q4kc_f32"), (T.Q5_K, "gemm_q5kc_f32")])
def test_q4_k_m_and_q5_k_m_layers_stay_packed_and_give_the_dense_models_logits(tmp_path, base, kernel):
    """A tiny Llama as a Q4_K_M (Q5_K_M) file has it (the types of most GGUF files people pull): Q4_K (Q5_K) layers,
    down_proj and one v_proj in Q6_K; and one o_proj in F16. The Q4_K (Q5_K) layers keep their codes with their
    scales factored per super-block (gemm_q4kc_f32, gemm_q5kc_f32), the Q6_K ones 6-bit codes bit-packed with factored
    scales (gemm_q6kc_f32), the fused qkv_proj with the Q6_K v each part in its own, the F16 one is
    dequantized; the logits, so the greedy tokens, are the dense model's on the same dequantized weights exactly."""
    types = {"down_proj": T.Q6_K, "layers.0.self_attn.v_proj": T.Q6_K, "layers.1.self_attn.o_proj": T.F16}
    path = _tiny_llama(tmp_path, lambda name: next((t for key, t in types.items() if name.endswith(key)), base),
                       f"llama-{base.name.lower()}_m", 256)
    dense, config = _load(path, None)
    q4_k, _ = _load(path, "gguf")
    first, second = q4_k.model.layers
    for linear in (first.self_attn.o_proj, first.mlp.gate_up_proj, second.self_attn.qkv_proj, second.mlp.gate_up_proj):
        assert linear.quant_method.packed.kernel.name == kernel
    for layer in (first, second):
        assert layer.mlp.down_proj.quant_method.packed.kernel.name == "gemm_q6kc_f32"
    # layer 0's qkv_proj: q and k of the base type, a Q6_K v, each shard in its own kind's panels
    shards = first.self_attn.qkv_proj.quant_method.shards
    assert [(size, weight.kernel.name) for _, size, weight, _ in shards] == [
        (256, kernel), (128, kernel), (128, "gemm_q6kc_f32")]
    assert type(second.self_attn.o_proj.quant_method) is UnquantizedLinearMethod
    summary = get_quant_config("gguf", path, LlamaForCausalLM).summary(q4_k)
    assert summary.startswith(f"linear layers kept packed: {base.name} x4, {base.name}+Q6_K x1, Q6_K x2; "
                              "dequantized at load: F16 x1")
    (dense_tokens, dense_logits), (q4_k_tokens, q4_k_logits) = (_greedy(m, config, PROMPTS, 8)
                                                                for m in (dense, q4_k))
    assert q4_k_tokens == dense_tokens and torch.equal(q4_k_logits, dense_logits)


def test_gguf_on_a_non_gguf_model_is_a_value_error_naming_it(tmp_path):
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="quantization='gguf' needs a .gguf model; .* is not a .gguf file"):
        LLM(str(tmp_path), quantization="gguf")


def test_gguf_on_a_gguf_without_packed_types_loads_dense(tmp_path):
    """vLLM's gguf takes any GGUF: with no type a kernel keeps, every layer is dequantized, and the summary says so."""
    path = _tiny_llama(tmp_path, None, "llama-f32")
    model, _ = _load(path, "gguf")
    assert all(type(m.quant_method) is UnquantizedLinearMethod for m in model.modules() if hasattr(m, "quant_method"))
    assert get_quant_config("gguf", path, LlamaForCausalLM).summary(model) == (
        "linear layers kept packed: none; dequantized at load: F32 x8; embeddings and LM heads kept packed: none")


def test_default_model_keeps_q4_1_layers_and_the_q8_0_embedding():
    """SmolLM2-135M's GGUF: Q4_1 layers on the Q4 kernels, its Q8_0 embedding (also the tied LM head) kept Q8_0."""
    model, _ = _load(smollm_path(), "gguf")
    linear = [m for m in model.modules() if hasattr(m, "quant_method")]
    assert len(linear) == 30 * 4 and all(type(m.quant_method) is GGUFInt4LinearMethod for m in linear)
    assert model.model.embed_tokens.q8 and model.model.embed_tokens.qweight.dtype == torch.int8


@pytest.fixture(scope="module")
def engines(dense_smollm):
    with pytest.MonkeyPatch.context() as patcher:
        patcher.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
        yield dense_smollm, LLM(quantization="gguf", **DENSE_SMOLLM_ARGS)


def test_default_model_through_the_engine(engines):
    """On the native kernels the gguf model is the dense one: the same greedy tokens."""
    dense, gguf = engines
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    expected, ours = ([list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
                      for llm in (dense, gguf))
    if native.gemm_q4() is not None:
        assert ours == expected
    else:  # torch's int4 kernel rounds to bf16: only the first tokens must agree
        assert [o[0] for o in ours] == [e[0] for e in expected]
