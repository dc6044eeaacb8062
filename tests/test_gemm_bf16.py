"""gemm_bf16.c through DenseWeight: float32 rows times bf16 weight panels equal F.linear on the bf16-rounded
operands (float32 sums in another order), at the row counts and odd shapes the engine produces, on both bodies:
AMX tiles where the CPU has them, and vdpbf16ps (built with -mno-amx-tile) on any AVX512-BF16 CPU. Skipped where
the CPU has no bf16 arithmetic."""

import pytest
import torch
import torch.nn.functional as F

from pagedllm import native
from pagedllm.layers import gemm_layout
from pagedllm.layers.gemm_layout import DenseWeight, WeightLayout, pack_bf16_panels, unpack_bf16_panels

BODIES = {"amx": (), "vdpbf16ps": ("-mno-amx-tile",)}


@pytest.fixture(params=list(BODIES))
def body(request, monkeypatch):
    flags = BODIES[request.param]
    kernel = native.gemm_bf16(flags)
    if kernel is None:
        pytest.skip("no AVX512-BF16 on this CPU (or no compiler)")
    if native.gemm_bf16_uses_amx(flags) != (request.param == "amx"):
        pytest.skip(f"no {request.param} body here")
    monkeypatch.setattr(native, "gemm_bf16", lambda: kernel)
    gated = native.gemm_bf16_silu_mul(flags)
    monkeypatch.setattr(native, "gemm_bf16_silu_mul", lambda: gated)
    return request.param


def _bf16_weight(weight: torch.Tensor, gated: bool = False) -> DenseWeight:
    return DenseWeight(weight, gated=gated, layout=WeightLayout(bf16_panels=True))


def _rounded(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


@pytest.mark.parametrize("rows", [0, 1, 7, 9, 16, 17, 33, 64, 300])
@pytest.mark.parametrize("out_features,in_features", [(1, 1), (31, 17), (32, 32), (33, 65), (200, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear_on_rounded_operands(body, rows, out_features, in_features, with_bias):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    x = torch.randn(rows, in_features, generator=gen)
    dense = _bf16_weight(weight)
    assert dense.data is None and dense.panels.dtype == torch.bfloat16
    assert torch.equal(dense.unpacked(), weight.to(torch.bfloat16))
    expected = F.linear(_rounded(x), _rounded(weight), bias)
    torch.testing.assert_close(dense.linear(x, bias), expected, rtol=1e-5, atol=1e-6 * in_features)


def test_rows_past_a_chunk_and_strided_inputs(body):
    """More rows than one chunk of the kernel's x scratch (512 KB of bf16 rows), leading dims, strided rows."""
    weight = torch.randn(100, 1536)
    dense = _bf16_weight(weight)
    x = torch.randn(2, 250, 1536)
    torch.testing.assert_close(dense.linear(x), F.linear(_rounded(x), _rounded(weight)), rtol=1e-5, atol=2e-3)
    wide = torch.randn(9, 2000)[:, 100:1636]
    torch.testing.assert_close(dense.linear(wide), F.linear(_rounded(wide), _rounded(weight)), rtol=1e-5, atol=2e-3)


@pytest.mark.parametrize("rows", [1, 9, 64, 300])
@pytest.mark.parametrize("half,in_features", [(1, 1), (7, 33), (16, 32), (20, 17), (1536, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gated_panels_give_silu_of_gate_times_up(body, rows, half, in_features, with_bias):
    """A [gate | up] weight laid out gated: silu_and_mul equals the activation of F.linear on the rounded operands
    (the projection never written), linear and unpacked still give the plain projection and weight."""
    gen = torch.Generator().manual_seed(rows * 1000 + half)
    weight = torch.randn(2 * half, in_features, generator=gen)
    bias = torch.randn(2 * half, generator=gen) if with_bias else None
    x = torch.randn(rows, in_features, generator=gen)
    dense = _bf16_weight(weight, gated=True)
    assert dense.gated and dense.panels.dtype == torch.bfloat16
    assert torch.equal(dense.unpacked(), weight.to(torch.bfloat16))
    gate, up = F.linear(_rounded(x), _rounded(weight), bias).chunk(2, dim=-1)
    activated = dense.silu_and_mul(x, bias)
    assert activated.shape == (rows, half)
    torch.testing.assert_close(activated, F.silu(gate) * up, rtol=1e-4, atol=1e-5 * in_features)
    torch.testing.assert_close(dense.linear(x, bias), F.linear(x, _rounded(weight), bias), rtol=1e-5,
                               atol=1e-5 * in_features)


def test_a_layout_decides_only_for_the_weights_it_lays_out():
    """Two layouts in use at once (two engines in one process): each weight gets its own layout's panels."""
    if native.gemm_bf16() is None:
        pytest.skip("no AVX512-BF16 on this CPU (or no compiler): no layout lays out bf16 panels here")
    bf16, float32 = WeightLayout(bf16_panels=True), WeightLayout(bf16_panels=False)
    weights = [DenseWeight(torch.randn(64, 32), layout=layout) for layout in (bf16, float32, bf16, None)]
    assert [w.panels.dtype for w in weights] == [torch.bfloat16, torch.float32, torch.bfloat16, torch.float32]


def test_panel_sizes_match_the_kernel():
    source = gemm_layout.__file__.rsplit("/layers/", 1)[0] + "/native/gemm_bf16.c"
    with open(source) as f:
        text = f.read()
    assert f"#define PANEL_COLS {gemm_layout.BF16_PANEL}\n" in text
    assert f"#define KBLOCK {gemm_layout.BF16_PANEL} " in text


@pytest.mark.parametrize("gated", [False, True])
def test_panels_of_a_strided_weight_are_those_of_its_contiguous_copy(gated):
    """pack_bf16_panels copies a row-major bf16 view of the weight's pairs along K: a transposed or column-sliced
    weight is laid out as its contiguous copy would be, and unpacks to its rounded values."""
    wide = torch.randn(96, 100)
    for weight in (torch.randn(64, 96).t(), torch.randn(70, 64).t(), wide[:, 4:68], wide[:64, :64]):
        panels = pack_bf16_panels(weight, gated)
        assert torch.equal(panels, pack_bf16_panels(weight.contiguous(), gated))
        assert torch.equal(unpack_bf16_panels(panels, *weight.shape, gated), weight.to(torch.bfloat16))
