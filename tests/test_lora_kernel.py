"""Multi-LoRA's compute for one layer (lora/layers.LinearLoRA), through lora.c and through its torch path, against
x·A·B computed slice by slice from the adapters' own A and B: rows of an adapter get their slot's product, rows of
no adapter (and of a slot whose adapter leaves the layer alone) are left bit for bit as they were; and a CPU graph
that captured the kernel replays it for another mapping of rows to slots."""
import shutil

import pytest
import torch

from pagedllm import native
from pagedllm.lora.layers import LinearLoRA
from pagedllm.lora.lora_model import LoRALayerWeights
from pagedllm.lora.punica import PunicaWrapper
from pagedllm.native.graph import CpuGraph

pytestmark = pytest.mark.skipif(shutil.which("cc") is None or native.lora() is None,
                                reason="needs a C compiler for the native kernels")


class _ColumnLayer:
    """What LinearLoRA reads of a column-parallel base layer: its input size and output slices."""

    tp_rank = 0

    def __init__(self, in_features: int, slice_sizes: list[int]):
        self.input_size = in_features
        self.slices = [(sum(slice_sizes[:i]), size, 0) for i, size in enumerate(slice_sizes)]

    def output_shards(self):
        return self.slices


def _adapters(in_features, slice_sizes, ranks, seed=0) -> list[LoRALayerWeights | None]:
    """One per slot: None (the adapter leaves the layer alone) or random A, B for some of the slices."""
    generator = torch.Generator().manual_seed(seed)
    adapters = []
    for slot, rank in enumerate(ranks):
        if rank is None:
            adapters.append(None)
            continue
        adapters.append(LoRALayerWeights([
            None if len(slice_sizes) > 1 and (slot + i) % 3 == 2
            else (torch.randn(rank, in_features, generator=generator) / in_features ** 0.5,
                  torch.randn(size, rank, generator=generator))
            for i, size in enumerate(slice_sizes)]))
    return adapters


def _expected(y, x, token_slots, adapters, slice_sizes, dtype=torch.float32):
    """In float64 from the weights as the slots hold them (rounded to ``dtype``)."""
    y = y.clone()
    for row, slot in enumerate(token_slots.tolist()):
        if slot < 0 or adapters[slot] is None:
            continue
        offset = 0
        for size, pair in zip(slice_sizes, adapters[slot].slices):
            if pair is not None:
                a, b = pair
                a, b = a.to(dtype).double(), b.to(dtype).double()
                y[row, offset:offset + size] += (x[row].double() @ a.T @ b.T).float()
            offset += size
    return y


CASES = [  # in, slices, max_loras, max_rank, each slot's adapter rank (None: leaves the layer alone), rows
    (64, [96, 32, 32], 4, 16, [16, 8, None, 4], 1),
    (64, [96, 32, 32], 4, 16, [16, 8, None, 4], 37),
    (48, [200, 200], 3, 8, [8, 3, 8], 300),
    (100, [70], 2, 24, [24, 5], 64),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # the slots': a bf16 model's are bf16
@pytest.mark.parametrize("native_path", [True, False])
@pytest.mark.parametrize("in_features,slice_sizes,max_loras,max_rank,ranks,rows", CASES)
def test_each_row_gets_its_slots_product(monkeypatch, native_path, dtype, in_features, slice_sizes, max_loras,
                                         max_rank, ranks, rows):
    if not native_path:
        monkeypatch.setattr("pagedllm.lora.layers.lora_add", lambda *args: False)
    adapters = _adapters(in_features, slice_sizes, ranks)
    punica = PunicaWrapper()
    lora = LinearLoRA(_ColumnLayer(in_features, slice_sizes), max_loras, max_rank, punica, dtype)
    for slot, adapter in enumerate(adapters):
        lora.set_slot(slot, adapter)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=generator)
    y = torch.randn(rows, sum(slice_sizes), generator=generator)
    token_slots = torch.randint(-1, max_loras, (rows,), generator=generator)
    if rows == 1:
        token_slots[0] = 0
    punica.update(token_slots)
    expected = _expected(y, x, token_slots, adapters, slice_sizes, dtype)
    lora.add_to(y, x)
    untouched = [r for r, s in enumerate(token_slots.tolist()) if s < 0 or adapters[s] is None]
    assert torch.equal(y[untouched], expected[untouched])
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4)


def test_a_graph_replays_the_kernel_for_new_slots():
    in_features, slice_sizes, rows = 64, [96, 32, 32], 12
    adapters = _adapters(in_features, slice_sizes, [16, 8, 4])
    punica = PunicaWrapper()
    lora = LinearLoRA(_ColumnLayer(in_features, slice_sizes), 3, 16, punica)
    for slot, adapter in enumerate(adapters):
        lora.set_slot(slot, adapter)
    static_slots = torch.zeros(rows, dtype=torch.int64)
    punica.update(static_slots)
    x, y = torch.randn(rows, in_features), torch.zeros(rows, sum(slice_sizes))
    graph = CpuGraph()
    graph.capture(lambda: (lora.add_to(y, x), y)[1])
    assert graph.failure is None and len(graph.calls) == 1
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        static_slots.copy_(torch.randint(-1, 3, (rows,), generator=generator))
        x.copy_(torch.randn(rows, in_features, generator=generator))
        y.zero_()
        graph.replay()
        expected = _expected(torch.zeros_like(y), x, static_slots, adapters, slice_sizes)
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4)


def test_a_slot_past_max_loras_is_an_error():
    punica = PunicaWrapper()
    lora = LinearLoRA(_ColumnLayer(16, [16]), 2, 8, punica)
    punica.update(torch.tensor([0, 2]))
    with pytest.raises(IndexError, match="max_loras"):
        lora.add_to(torch.zeros(2, 16), torch.zeros(2, 16))
