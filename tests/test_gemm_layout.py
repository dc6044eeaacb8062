"""DenseWeight: the weight laid out for its CPU GEMMs (native panels, else input-major) multiplies like F.linear,
at every row count the engine produces and on the odd shapes at the kernel's edges."""

import pytest
import torch
import torch.nn.functional as F

from pagedllm import native
from pagedllm.layers import gemm_layout
from pagedllm.layers.gemm_layout import DenseWeight
from tests.native_paths import native_or_fallback


@pytest.fixture(params=["native", "avx2", "mkl"])
def kernel(request, monkeypatch):
    """"native": the packed-panel kernel where this CPU has it; "avx2": its AVX2 body; "mkl": the input-major
    fallback."""
    return native_or_fallback(request.param, monkeypatch, "gemm")


@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 64, 301])
@pytest.mark.parametrize("out_features,in_features", [(1, 1), (63, 17), (64, 64), (65, 130), (200, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(kernel, rows, out_features, in_features, with_bias):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    x = torch.randn(rows, in_features, generator=gen)
    dense = DenseWeight(weight)
    assert (dense.panels is not None) == (kernel != "mkl") == (dense.data is None)  # one copy of the weight
    assert torch.equal(dense.unpacked(), weight)
    # Sums of in_features products in another order: float32 rounding grows with the length.
    torch.testing.assert_close(dense.linear(x, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-6 * in_features)


def test_leading_dims_and_strided_rows(kernel):
    weight = torch.randn(70, 40)
    dense = DenseWeight(weight)
    x = torch.randn(3, 5, 40)
    torch.testing.assert_close(dense.linear(x), F.linear(x, weight))
    wide = torch.randn(9, 100)[:, 10:50]  # rows 100 floats apart
    torch.testing.assert_close(dense.linear(wide), F.linear(wide, weight))
    columns = torch.randn(40, 9).t()  # not row-contiguous
    torch.testing.assert_close(dense.linear(columns), F.linear(columns, weight))


def test_many_rows_use_every_thread_block(kernel):
    """Row counts past the kernel's 192-row blocks and panels past the 8-items-per-thread split."""
    weight, x = torch.randn(1000, 96), torch.randn(777, 96)
    dense = DenseWeight(weight)
    torch.testing.assert_close(dense.linear(x), F.linear(x, weight), rtol=1e-5, atol=1e-4)


def test_one_row_split_by_half_panels_between_threads_is_the_same_at_every_thread_count(kernel):
    """A single row splits an odd number of panels between threads by halves (gemm.c's dense_row_halves): each
    column's sum is the same whatever the thread count (6: a half of the last, partial panel alone), and F.linear's
    up to the order of its sums."""
    weight, bias, x = torch.randn(144, 96), torch.randn(144), torch.randn(1, 96)  # 3 panels, the last of 16 columns
    dense = DenseWeight(weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = dense.linear(x, bias)
        for n in range(2, 7):
            torch.set_num_threads(n)
            assert torch.equal(dense.linear(x, bias), one), n
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(one, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


def test_every_batch_size_multiplies_on_the_panels_their_only_copy(kernel, monkeypatch):
    """Prefill-sized batches too: no input-major copy is kept for MKL beside the panels (float32 weights once)."""
    dense = DenseWeight(torch.randn(70, 40))
    calls = []
    monkeypatch.setattr(native, "gemm", lambda: (lambda x, *args: calls.append(x.shape[0])))
    for rows in (1, 129, 2048):
        dense.linear(torch.randn(rows, 40))
    assert calls == ([1, 129, 2048] if kernel != "mkl" else [])


def test_other_dtypes_keep_their_layout():
    weight = torch.randn(8, 4, dtype=torch.bfloat16)
    dense = DenseWeight(weight)
    assert dense.panels is None and dense.data is weight
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    assert torch.equal(dense.linear(x), F.linear(x, weight))


def test_panel_width_matches_the_kernel():
    source = (gemm_layout.__file__.rsplit("/layers/", 1)[0] + "/native/gemm.h")
    with open(source) as f:
        assert f"#define NR {gemm_layout.PANEL} " in f.read()
