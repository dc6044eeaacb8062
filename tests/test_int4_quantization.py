"""quantization="gguf_int4": GGUF Q4_0/Q4_1/Q4_K weights kept 4-bit.

The dense float32 path is the reference: it computes with the same dequantized weights. The native kernel
(float32, AVX-512 or AVX2) must equal the dense native GEMM bit for bit; torch's int4 kernel (the fallback) differs
from it by the bfloat16 rounding of activations, scales/zeros and the kernel's output.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize
from transformers import LlamaConfig, Phi3Config
from transformers import LlamaForCausalLM as HFLlamaForCausalLM
from transformers import Phi3ForCausalLM as HFPhi3ForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.layers.gemm_layout import DenseWeight, WeightLayout, pack_q4_panels, pack_q4kc_panels
from pagedllm.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pagedllm.layers.vocab_embedding import Q8_HEAD_MAX_ROWS, ParallelLMHead, VocabParallelEmbedding
from pagedllm.engine.arg_utils import set_quantization
from pagedllm.layers.quantization.gguf import GGUFInt4Config
from pagedllm.layers.quantization.gguf_int4 import GGUFInt4LinearMethod
from pagedllm.models.gguf_loader import (
    gguf_tensor_types,
    gguf_to_hf_name,
    gguf_weights_iterator,
    dequantize_fast,
    reverse_llama_permute,
    unpack_q4,
    unpack_q8,
)
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.hf_config import load_hf_config
from pagedllm.models.loader import get_model, get_quant_config
from pagedllm.platforms.cpu import bf16_panels_apply
from pagedllm.platforms.interface import KernelChoice
from tests.conftest import DENSE_SMOLLM_ARGS
from tests.model_fixtures import (Chunk, PagedBatchRunner, quantize_gguf, smollm_path, teacher_forced,
                                  write_tiny_gguf)
from tests.native_paths import native_build, native_or_fallback

BF16_EPS = 2.0**-8  # bfloat16 keeps 8 significant bits: rounding moves a value by at most |v| * 2^-9


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the int4 kernel is called ~120 times a step


@pytest.fixture(params=["native", "avx2", "torch"])
def kernel_path(request, monkeypatch):
    """Which kernel the layers built in the test pack for: gemm.c's (its AVX2 body too, where the CPU has AVX-512),
    or torch's int4 one."""
    native_or_fallback(request.param, monkeypatch, "gemm_q4k")
    native_or_fallback(request.param, monkeypatch, "gemm_q4kc")
    return native_or_fallback(request.param, monkeypatch, "gemm_q4")


def gguf_layer(layer_class, config, parts: dict[str, torch.Tensor], bias=None, **kwargs):
    """A linear layer named "layer" quantized by the GGUF ``config``, loaded with ``parts`` (its codes and per-block
    parameters by name) and ``bias`` through its weight loaders, and laid out."""
    out_features, in_features = parts["qweight"].shape
    layer = layer_class(in_features, out_features, bias=bias is not None, quant_config=config, prefix="layer",
                        **kwargs)
    for name, value in (*parts.items(), ("bias", bias)):
        if value is not None:
            getattr(layer, name).weight_loader(getattr(layer, name), value)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _int4_layer(layer_class, parts, bias=None, **kwargs):
    """A linear layer quantized by gguf_int4, loaded with ``(codes, scales, zeros)``."""
    config = GGUFInt4Config({"layer.weight": GGMLQuantizationType.Q4_1}, [])
    return gguf_layer(layer_class, config, dict(zip(("qweight", "scales", "zeros"), parts)), bias, **kwargs)


def _random_q4(shape: tuple[int, int], tensor_type, seed: int) -> tuple[np.ndarray, list[torch.Tensor]]:
    """GGUF blocks of a random weight, and their unpacked ``(codes, scales, zeros)``."""
    blocks = quantize_gguf(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32), tensor_type)
    return blocks, [torch.from_numpy(part) for part in unpack_q4(blocks, tensor_type)]


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("tensor_type", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
                                         GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q8_0])
def test_fast_dequantization_is_ggufs_bit_for_bit(tensor_type):
    blocks = quantize_gguf(np.random.default_rng(5).standard_normal((48, 512), dtype=np.float32), tensor_type)
    fast = dequantize_fast(blocks, tensor_type)
    assert fast.dtype == np.float32 and np.array_equal(fast, dequantize(blocks, tensor_type))


def test_q4_k_blocks_unpack_as_gguf_dequantizes_them():
    """Q4_K blocks of any bytes (six-bit scales and mins in all their bit positions, codes, fp16 d and dmin):
    codes * scale + zero per 32 is gguf's dequantization bit for bit, and the scales (d * sc) are no fp16 values."""
    rng = np.random.default_rng(11)
    blocks = rng.integers(0, 256, (16, 2, 144), dtype=np.uint8)
    blocks[..., :4] = rng.uniform(1e-3, 0.1, (16, 2, 2)).astype(np.float16).view(np.uint8)
    blocks = blocks.reshape(16, -1)
    codes, scales, zeros = unpack_q4(blocks, GGMLQuantizationType.Q4_K)
    assert codes.shape == (16, 512) and codes.max() <= 15 and scales.shape == zeros.shape == (16, 16)
    weight = codes.reshape(16, 16, 32).astype(np.float32) * scales[..., None] + zeros[..., None]
    assert np.array_equal(weight.reshape(16, 512), dequantize(blocks, GGMLQuantizationType.Q4_K))
    assert not np.array_equal(scales.astype(np.float16).astype(np.float32), scales)


@pytest.mark.parametrize("path", ["native", "avx2"])
def test_q4_k_compact_panels_are_the_dense_product(path):
    """Q4_K's d * sc and -dmin * m, from blocks of any bytes, factor per super-block, so its compact panels
    (gemm_q4kc_f32: under 0.8 of the float32 layout's bytes) give the dense product bit for bit, in both bodies;
    scales that are no such products keep the float32 layout."""
    kernel = native_build(path, "gemm_q4kc")
    rng = np.random.default_rng(12)
    blocks = rng.integers(0, 256, (80, 4, 144), dtype=np.uint8)
    blocks[..., :4] = rng.uniform(1e-3, 0.1, (80, 4, 2)).astype(np.float16).view(np.uint8)
    blocks = blocks.reshape(80, -1)
    codes, scales, zeros = (torch.from_numpy(a) for a in unpack_q4(blocks, GGMLQuantizationType.Q4_K))
    panels = pack_q4kc_panels(codes, scales, zeros)
    assert panels is not None and panels.numel() < 0.8 * pack_q4_panels(codes, scales, zeros, torch.float32).numel()
    dense = DenseWeight(torch.from_numpy(dequantize_fast(blocks, GGMLQuantizationType.Q4_K)))
    for rows in (1, 5, 9, 40):  # one row (split by half panels), one tile, tiles of half panels, a scratch panel
        x = torch.randn(rows, 1024)
        assert torch.equal(kernel(x, panels, None, 80), dense.linear(x))
    assert pack_q4kc_panels(codes, torch.rand(scales.shape, generator=torch.Generator().manual_seed(0)), zeros) is None


@pytest.mark.parametrize("tensor_type", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
                                         GGMLQuantizationType.Q4_K])
def test_kernel_matches_dequantized_weight(tensor_type, kernel_path):
    blocks, parts = _random_q4((96, 256), tensor_type, seed=0)
    weight = torch.from_numpy(dequantize(blocks, tensor_type))
    bias = torch.randn(96)
    layer = _int4_layer(ReplicatedLinear, parts, bias)
    assert layer.qweight.dtype == torch.uint8
    if kernel_path == "torch":
        assert layer.qweight.shape == (96, 128)  # two codes a byte
    elif tensor_type == GGMLQuantizationType.Q4_K:  # two 64-column panels: a super-block's header (float32 scale and
        # zero factors), then eight 32-row blocks of uint8 scale and zero multipliers and 32 x 32 codes
        assert layer.qweight.shape == (2, 64 * 4 * 2 + 8 * (64 + 64 + 32 * 32))
        assert layer.quant_method.packed.kernel.name == "gemm_q4kc_f32"
    else:  # two 64-column panels of eight 32-row blocks: fp16 scales, float32 zeros, 32 x 32 codes
        assert layer.qweight.shape == (2, 8, 64 * 2 + 64 * 4 + 32 * 32)
        assert layer.quant_method.packed.kernel.name == "gemm_q4_f32"
    # The loader's dequantized weight, as the dense path holds it (rounded as the native kernel rounds).
    dense = DenseWeight(torch.from_numpy(dequantize_fast(blocks, tensor_type)))
    for rows in (1, 5, 6, 7, 10, 40):  # a tile (dequantized as it goes), tiles of half panels (7-10), a scratch panel
        x = torch.randn(rows, 256)
        y = layer(x)
        assert y.dtype == torch.float32 and y.shape == (rows, 96)
        assert _relative_error(y, x @ weight.T + bias) < 1e-2
        if kernel_path == "native":
            assert torch.equal(y, dense.linear(x, bias))


@pytest.mark.parametrize("tensor_type", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K])
@pytest.mark.parametrize("out_features", [160, 144])  # 3 panels, the last of 32 or 16 columns
def test_one_row_split_by_half_panels_between_threads_equals_the_dense_path(tensor_type, out_features, kernel_path):
    """A single row's GEMM splits an odd number of panels between threads by halves (gemm.c's quant_row_halves):
    whatever the thread count, so wherever a thread's run starts or ends mid-panel (a half of the last, partial panel
    may hold no column at all), every column is the dense path's, bit for bit."""
    if kernel_path == "torch":
        pytest.skip("the native kernels' split")
    blocks, parts = _random_q4((out_features, 256), tensor_type, seed=3)
    bias = torch.randn(out_features)
    layer = _int4_layer(ReplicatedLinear, parts, bias)
    dense = DenseWeight(torch.from_numpy(dequantize_fast(blocks, tensor_type)))
    x = torch.randn(1, 256)
    expected = dense.linear(x, bias)
    for threads in range(1, 7):  # 6 threads: a half of the last panel alone
        torch.set_num_threads(threads)
        assert torch.equal(layer(x), expected), threads


def test_tensor_parallel_shards_of_int4_layers_match_unsharded(kernel_path):
    """Codes, scales and zeros are loaded [out, in]-major, so the dense layers' weight loaders slice them."""
    _, w_col = _random_q4((64, 128), GGMLQuantizationType.Q4_1, seed=1)
    _, w_row = _random_q4((32, 128), GGMLQuantizationType.Q4_1, seed=2)
    x = torch.randn(3, 128)
    full_col = _int4_layer(ColumnParallelLinear, w_col)(x)
    full_row = _int4_layer(RowParallelLinear, w_row, reduce_results=False)(x)
    cols = [_int4_layer(ColumnParallelLinear, w_col, tp_size=2, tp_rank=r)(x) for r in range(2)]
    rows = [_int4_layer(RowParallelLinear, w_row, tp_size=2, tp_rank=r, reduce_results=False)(x.chunk(2, dim=-1)[r])
            for r in range(2)]
    assert torch.equal(torch.cat(cols, dim=-1), full_col)
    assert _relative_error(sum(rows), full_row) < 1e-2  # each rank's partial sum is rounded to bf16


def test_phi3_fused_gguf_layers_stay_4_bit(tmp_path, kernel_path):
    """Phi-3's GGUF holds q/k/v and gate/up fused (attn_qkv, ffn_up): those layers are quantized under their own
    names, their codes and scales cut per shard by the fused layers' loaders, and the 4-bit model computes what the
    dense one does on the same dequantized weights."""
    config = Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, pad_token_id=None)
    torch.manual_seed(0)
    path = str(tmp_path / "phi3-q4_1.gguf")
    write_tiny_gguf(HFPhi3ForCausalLM(config), path, "phi3", layer_type=GGMLQuantizationType.Q4_1)
    dense = get_model(path, load_hf_config(path), KernelChoice(torch.float32))
    quantized_config = load_hf_config(path)
    set_quantization(quantized_config, "gguf_int4", path)
    int4 = get_model(path, quantized_config, KernelChoice(torch.float32))
    for layer in (int4.model.layers[1].self_attn.qkv_proj, int4.model.layers[1].mlp.gate_up_proj):
        assert isinstance(layer.quant_method, GGUFInt4LinearMethod)
    tokens = {0: torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(1)).tolist()}
    chunk = [Chunk(0, 0, 12)]
    (expected,), (actual,) = (PagedBatchRunner(model, quantized_config).step(tokens, chunk) for model in (dense, int4))
    assert _relative_error(actual, expected) < 1e-2


@pytest.fixture(scope="module")
def smollm_reader() -> GGUFReader:
    """gguf's reader of the default model's file, parsed once for the module (its vocabulary takes seconds)."""
    return GGUFReader(smollm_path())


def test_packed_gguf_q4_1_reproduces_dequantize(kernel_path, smollm_reader):
    """A real Q4_1 tensor, llama.cpp-permuted (q_proj) or not (down_proj), packed and through the kernel."""
    path, reader = smollm_path(), smollm_reader
    assert gguf_tensor_types(path) == {gguf_to_hf_name(t.name): t.tensor_type for t in reader.tensors}
    raw = {gguf_to_hf_name(t.name): t for t in reader.tensors}
    n_head = int(reader.fields["llama.attention.head_count"].contents())
    modules = {"model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"}
    packed = {}
    for name, tensor in gguf_weights_iterator(path, modules):
        packed[name] = tensor
        if len(packed) > 40:  # layer 0 is near the front of the file
            break
    for module in sorted(modules):
        t = raw[f"{module}.weight"]
        assert t.tensor_type == GGMLQuantizationType.Q4_1
        expected = torch.from_numpy(dequantize(t.data, t.tensor_type))
        if module.endswith("q_proj"):
            expected = torch.from_numpy(reverse_llama_permute(expected.numpy(), n_head))
        codes, scales, zeros = (packed[f"{module}.{part}"] for part in ("qweight", "scales", "zeros"))
        assert f"{module}.weight" not in packed and codes.dtype == torch.uint8 and int(codes.max()) <= 15

        def unpacked(scales, zeros, offset=0):
            return (codes.float() - offset) * scales.repeat_interleave(32, 1) + zeros.repeat_interleave(32, 1)

        assert torch.equal(unpacked(scales, zeros), expected)
        weight_t = _int4_layer(ReplicatedLinear, (codes, scales, zeros))(torch.eye(expected.shape[1]))
        if kernel_path == "native":  # x = I gives W.T exactly: the weights the dense path holds
            assert torch.equal(weight_t.T, unpacked(scales, zeros)), module
            continue
        # The torch kernel takes (q - 8) * scale + zero, its scales and zeros in bfloat16: that rounding, and no
        # more, separates it from GGUF.
        torch_zeros = zeros + 8 * scales
        scales_bf16, zeros_bf16 = scales.bfloat16().float(), torch_zeros.bfloat16().float()
        bound = ((8 * scales.abs() + torch_zeros.abs()) * BF16_EPS).repeat_interleave(32, 1)
        assert ((unpacked(scales_bf16, zeros_bf16, offset=8) - expected).abs() <= bound).all(), module
        # Through the kernel: W.T, rounded once more to bfloat16 on the way out.
        assert ((weight_t.T - expected).abs() <= bound + expected.abs() * BF16_EPS).all(), module


@pytest.mark.parametrize("tp_size", [1, 2])
def test_q8_embedding_rows_and_lm_head_equal_the_dequantized_weight(tp_size):
    """A Q8_0 embedding keeps codes and scales: lookups and the LM head equal the dense weight's exactly."""
    blocks = quantize(np.random.default_rng(3).standard_normal((200, 64), dtype=np.float32), GGMLQuantizationType.Q8_0)
    codes, scales = (torch.from_numpy(part) for part in unpack_q8(blocks))
    weight = torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q8_0))
    ids = torch.tensor([0, 7, 199, 100, 7])
    hidden = torch.randn(5, 64)
    logits = []
    config = GGUFInt4Config({"embedding.weight": GGMLQuantizationType.Q8_0}, [])
    for rank in range(tp_size):
        embedding = VocabParallelEmbedding(200, 64, tp_size=tp_size, tp_rank=rank, quant_config=config,
                                           prefix="embedding")
        assert embedding.q8 and embedding.qweight.dtype == torch.int8
        embedding.qweight.weight_loader(embedding.qweight, codes)
        embedding.scales.weight_loader(embedding.scales, scales)
        embedding.prepare_projection()
        shard = slice(embedding.vocab_start_index, embedding.vocab_end_index)
        dense = DenseWeight(weight[shard].contiguous())
        assert torch.equal(embedding.project(hidden)[:, : shard.stop - shard.start], dense.linear(hidden))
        logits.append(embedding.project(hidden))
        if tp_size == 1:
            assert torch.equal(embedding(ids), weight[ids])
    assert torch.allclose(torch.cat(logits, dim=-1)[:, :200], hidden @ weight.T, atol=1e-4)


@pytest.mark.skipif(not bf16_panels_apply(), reason="no bf16 weight panels on this CPU")
@pytest.mark.parametrize("tied", [True, False])
def test_q8_lm_head_under_bf16_panels_reads_codes_for_a_few_rows_and_panels_for_more(tied):
    """A bf16-panel model's Q8_0 LM head: up to Q8_HEAD_MAX_ROWS rows multiply by the codes (the dequantized weight
    to float32 accuracy), more rows by the bf16 panels (bf16 rounding of weight and rows); lookups are unchanged,
    and an untied head keeps no codes beside its panels."""
    blocks = quantize(np.random.default_rng(5).standard_normal((300, 64), dtype=np.float32), GGMLQuantizationType.Q8_0)
    codes, scales = (torch.from_numpy(part) for part in unpack_q8(blocks))
    weight = torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q8_0))
    config = GGUFInt4Config({"embedding.weight": GGMLQuantizationType.Q8_0}, [])
    embedding = (VocabParallelEmbedding if tied else ParallelLMHead)(300, 64, quant_config=config, prefix="embedding")
    embedding.qweight.weight_loader(embedding.qweight, codes)
    embedding.scales.weight_loader(embedding.scales, scales)
    embedding.prepare_projection(WeightLayout(bf16_panels=True))
    assert tied == hasattr(embedding, "qweight")
    few, many = torch.randn(Q8_HEAD_MAX_ROWS, 64), torch.randn(Q8_HEAD_MAX_ROWS + 1, 64)
    assert torch.allclose(embedding.project(few), few @ weight.T, atol=1e-4)
    rounded = many.bfloat16().float() @ weight.bfloat16().float().T
    assert torch.allclose(embedding.project(many), rounded, atol=1e-3)
    assert not torch.allclose(embedding.project(many), many @ weight.T, atol=1e-4)  # the panels' rounding shows
    if tied:
        assert torch.equal(embedding(torch.tensor([0, 299])), weight[[0, 299]])


def test_q8_embedding_looks_up_rows_in_the_model_dtype():
    """float32 lookups may take the native gather; a bf16 model still gets bf16 rows."""
    blocks = quantize(np.random.default_rng(4).standard_normal((50, 64), dtype=np.float32), GGMLQuantizationType.Q8_0)
    codes, scales = (torch.from_numpy(part) for part in unpack_q8(blocks))
    weight = torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q8_0))
    config = GGUFInt4Config({"embedding.weight": GGMLQuantizationType.Q8_0}, [])
    for dtype in (torch.float32, torch.bfloat16):
        embedding = VocabParallelEmbedding(50, 64, params_dtype=dtype, quant_config=config, prefix="embedding")
        embedding.qweight.weight_loader(embedding.qweight, codes)
        embedding.scales.weight_loader(embedding.scales, scales)
        rows = embedding(torch.tensor([3, 49, 0]))
        assert rows.dtype == dtype and torch.equal(rows, weight[[3, 49, 0]].to(dtype))


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "To make a cup of tea, first"]
NUM_TOKENS = 32


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patcher:
        patcher.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
        yield patcher


LLM_ARGS = DENSE_SMOLLM_ARGS


@pytest.fixture(scope="module")
def dense(dense_smollm):
    return dense_smollm


@pytest.fixture(scope="module", params=["native", "torch"])
def int4(request, monkeypatch_module):
    """The 4-bit model on either kernel (chosen when the weights are packed, at load)."""
    with pytest.MonkeyPatch.context() as patcher:
        return native_or_fallback(request.param, patcher, "gemm_q4"), LLM(quantization="gguf_int4", **LLM_ARGS)


def test_greedy_tokens_agree_with_dense(dense, int4):
    """On the native kernel the 4-bit model is the dense one: same tokens, log-probs equal but for the order of
    sums in batches the dense path sends to MKL. On torch's kernel, free-running, a near-tie flipped by bf16
    rounding sends the rest of a sequence elsewhere, so the strict measure is teacher-forced: int4's top token
    at each position of the dense continuation."""
    path, int4 = int4
    greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    expected = [o.prompt_token_ids + list(o.outputs[0].token_ids)
                for o in dense.generate(PROMPTS, greedy, use_tqdm=False)]
    ours = [list(o.outputs[0].token_ids) for o in int4.generate(PROMPTS, greedy, use_tqdm=False)]
    prefix_match = [next((i for i, (a, b) in enumerate(zip(e[-NUM_TOKENS:], o)) if a != b), NUM_TOKENS)
                    for e, o in zip(expected, ours)]
    assert all(n >= 1 for n in prefix_match)  # the first token of every prompt matches

    ranks, deltas = teacher_forced(int4, dense, expected, NUM_TOKENS)
    agreement = sum(rank == 1 for rank in ranks) / len(ranks)
    print(f"gguf_int4 ({path} kernel) vs dense float32: teacher-forced agreement {agreement:.3f}, greedy prefix "
          f"agreement {sum(prefix_match) / (NUM_TOKENS * len(PROMPTS)):.3f} ({prefix_match}), "
          f"max |logprob diff| {max(deltas):.2e}")
    if path == "native":
        assert prefix_match == [NUM_TOKENS] * len(PROMPTS)
        assert max(deltas) < 1e-3
    else:
        assert agreement >= 0.9
        assert 0 < max(deltas) < 1.0  # a different computation (not the dense weights), and a close one


def test_chat_still_answers_paris(int4):
    out = int4[1].chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text


def test_bad_quantization_is_a_value_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match="quantization must be None or one of gguf, gguf_int4, int8, "
                                         "compressed-tensors; got 'awq'"):
        LLM(quantization="awq")
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="quantization='gguf_int4' needs a .gguf model.*not a .gguf file"):
        LLM(str(tmp_path), quantization="gguf_int4")
    unquantized = str(tmp_path / "f32.gguf")
    write_tiny_gguf(HFLlamaForCausalLM(config), unquantized, "llama")
    with pytest.raises(ValueError, match="quantization='gguf_int4' needs Q4_0/Q4_1/Q4_K layer weights.*F32"):
        get_quant_config("gguf_int4", unquantized, LlamaForCausalLM)
