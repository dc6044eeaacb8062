"""CPU graphs (native/graph.py): replay recomputes a captured forward for new inputs in the static buffers, and
capture refuses a forward whose kernels read what a torch op computed (replay would not recompute it). Replays
run in C (native/graph_replay.c) where it knows the calling convention, else call by call from Python: both
give the eager results."""
import platform
import shutil
import sys

import pytest
import torch

from pagedllm import native
from pagedllm.native import fused
from pagedllm.native.graph import CpuGraph, GraphPool, GraphReplayError

pytestmark = pytest.mark.skipif(shutil.which("cc") is None or native.fused_ops() is None,
                                reason="needs a C compiler for the native kernels")


def _norm_then_gate(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    normed, _ = fused.add_rms_norm(x, residual, weight, 1e-5)
    return fused.silu_and_mul(normed.view(-1, 2, 16).reshape(-1, 32))  # views only between the kernels


def test_replay_recomputes_for_new_inputs_in_place():
    x, residual, weight = torch.randn(3, 32), torch.randn(3, 32), torch.rand(32)
    graph = CpuGraph()
    first = graph.capture(lambda: _norm_then_gate(x, residual, weight))
    assert graph.failure is None and len(graph.calls) == 2
    assert torch.equal(first, _norm_then_gate(x, residual, weight))
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        x.copy_(torch.randn(3, 32, generator=generator))
        residual.copy_(torch.randn(3, 32, generator=generator))
        replayed = graph.replay()
        assert replayed is first  # the graph's output buffer
        assert torch.equal(replayed, _norm_then_gate(x, residual, weight))


@pytest.mark.parametrize("inference_mode", [False, True])  # the model runner captures in inference mode
@pytest.mark.parametrize("torch_op", [
    lambda t: t * 2,
    lambda t: t.double().to(torch.float32),  # `to` declares it may alias its input; here it copies
    lambda t: t.t().contiguous().t().contiguous(),
])
def test_a_torch_op_feeding_a_kernel_refuses_the_capture(inference_mode, torch_op):
    x = torch.randn(3, 32)
    graph = CpuGraph()
    with torch.inference_mode(inference_mode):
        out = graph.capture(lambda: fused.silu_and_mul(torch_op(fused.silu_and_mul(x))))
    assert graph.failure is not None and "torch op" in graph.failure
    assert not graph.calls
    assert torch.equal(out, fused.silu_and_mul(torch_op(fused.silu_and_mul(x))))  # the step itself is right


def test_a_torch_computed_output_or_no_kernel_refuses_the_capture():
    x = torch.randn(3, 32)
    graph = CpuGraph()
    graph.capture(lambda: fused.silu_and_mul(x) + 1)
    assert "computed the output" in graph.failure
    graph = CpuGraph()
    graph.capture(lambda: x * 2)
    assert graph.failure == "no native kernel ran"


@pytest.fixture(params=["native replay", "python replay"])
def replay_in(request, monkeypatch):
    """Graphs captured here replay through graph_replay.c, or (its library taken away) call by call in Python."""
    if request.param == "python replay":
        monkeypatch.setattr(native, "graph_replay", lambda: None)
    return request.param


def test_replays_run_in_c_where_the_calling_convention_is_known(replay_in):
    x = torch.randn(3, 32)
    graph = CpuGraph()
    graph.capture(lambda: fused.silu_and_mul(x))
    known = sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64")
    assert (graph.packed_calls is not None) == (known and replay_in == "native replay")


def test_replay_passes_float_and_stack_arguments(replay_in):
    """paged_decode_f32 takes 19 integer-class arguments (13 beyond x86-64's six registers; the last ones the
    addresses of the per-KV-head k_scale and v_scale) and two floats (the scale and the soft cap), all here far from
    their defaults: a replay after new queries and K/V equals the kernel called directly."""
    heads, kv_heads, head_size, block_size = 4, 2, 64, 4
    q = torch.randn(3, heads, head_size)
    k_cache, v_cache = (torch.randn(8 * block_size, kv_heads, head_size) for _ in range(2))  # 8 blocks of slots
    block_table = torch.tensor([[0, 1, 2], [3, 4, 0], [5, 6, 7]], dtype=torch.int32)
    seq_lens = torch.tensor([9, 6, 12], dtype=torch.int32)
    decode = native.paged_decode()
    kv_scales = torch.tensor([[0.7, 1.3], [1.9, 0.4]])  # k_scale and v_scale of each KV head, alive across replays

    def step() -> torch.Tensor:
        out, lse = torch.empty(3, heads, head_size), torch.empty(3, heads)
        decode(q, k_cache, v_cache, block_table, seq_lens, out, lse, start_pos=0, block_size=block_size, scale=0.3,
               sliding_window=7, logits_soft_cap=2.5, kv_scales=kv_scales)
        return out

    graph = CpuGraph()
    graph.capture(step)
    assert graph.failure is None
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        for t in (q, k_cache, v_cache):
            t.copy_(torch.randn(t.shape, generator=generator))
        assert torch.equal(graph.replay(), step())


def test_a_kernel_failing_on_replay_raises(replay_in):
    ids, weight = torch.tensor([1, 2]), torch.randn(5, 8)
    graph = CpuGraph()
    graph.capture(lambda: fused.embedding(ids, weight))
    ids[1] = 7  # past the 5 rows
    with pytest.raises(GraphReplayError, match=r"embedding_f32 failed on replay \(status -1\)"):
        graph.replay()


def test_a_capture_without_its_kernels_computes_nothing_and_its_replays_compute_the_step(replay_in):
    """run_kernels=False (the start-up's graphs of decode steps): the calls are recorded, not made, so the output
    buffer holds nothing of the forward's until the first replay, which makes them all and verifies the graph."""
    x, residual, weight = torch.randn(3, 32), torch.randn(3, 32), torch.rand(32)
    residual_before = residual.clone()
    graph = CpuGraph()
    out = graph.capture(lambda: _norm_then_gate(x, residual, weight), run_kernels=False)
    assert graph.failure is None and len(graph.calls) == 2 and not graph.verified
    assert torch.equal(residual, residual_before)  # add_rms_norm, which adds x into it, did not run
    expected = _norm_then_gate(x.clone(), residual.clone(), weight)
    assert graph.replay() is out and torch.equal(out, expected) and graph.verified


def test_a_capture_without_its_kernels_takes_their_status_as_success_until_replayed(replay_in):
    ids, weight = torch.tensor([1, 7]), torch.randn(5, 8)  # 7: past the 5 rows, which the kernel refuses
    graph = CpuGraph()
    graph.capture(lambda: fused.embedding(ids, weight), run_kernels=False)
    assert graph.failure is None
    with pytest.raises(GraphReplayError, match=r"embedding_f32 failed on replay \(status -1\)"):
        graph.replay()
    assert not graph.verified


def test_graphs_sharing_a_pool_replay_in_turn_over_the_same_memory():
    pool = GraphPool()
    inputs = {n: (torch.randn(n, 32), torch.randn(n, 32), torch.rand(32)) for n in (1, 5)}
    graphs = {n: CpuGraph(pool) for n in inputs}
    for n, graph in graphs.items():
        graph.capture(lambda: _norm_then_gate(*inputs[n]))
        assert graph.failure is None
    (chunk,) = pool._chunks  # one chunk holds both graphs' activations
    for graph in graphs.values():
        assert chunk.data_ptr() <= graph.output.data_ptr() < chunk.data_ptr() + chunk.numel() // 2
    for step in range(4):
        n = (1, 5)[step % 2]
        inputs[n][0].normal_()
        assert torch.equal(graphs[n].replay(), _norm_then_gate(*inputs[n]))


def test_a_capture_reuses_the_memory_of_activations_the_forward_dropped():
    """A chain of 12 layers, each allocating two 1 MB activations and dropping its input's: the graph's pool
    holds what is live at once (a few MB), not all 24 MB, and the replays equal the eager forward."""
    rows, width = 1024, 256
    x, first_residual, weight = torch.randn(rows, width), torch.randn(rows, width), torch.rand(width)

    def layers() -> torch.Tensor:
        hidden, residual = x, first_residual
        for _ in range(12):
            hidden, residual = fused.add_rms_norm(hidden, residual, weight, 1e-5)
        return hidden

    pool = GraphPool()
    graph = CpuGraph(pool)
    graph.capture(layers)
    assert graph.failure is None and len(graph.calls) == 12
    assert sum(chunk.numel() for chunk in pool._chunks) <= 6 * rows * width * 4
    for seed in range(2):
        x.copy_(torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)))
        assert torch.equal(graph.replay(), layers())


def test_a_capture_does_not_import_torch_dynamo():
    """Capturing runs the forward under a TorchDispatchMode; torch wraps a mode's __torch_dispatch__ in a dynamo
    guard unless the mode opts out, and the guard's first call imports torch._dynamo: seconds in every engine
    process's first decode step. In a fresh interpreter, as an engine process is."""
    import subprocess
    import sys

    script = ("import sys, torch\n"
              "from pagedllm.native import fused\n"
              "from pagedllm.native.graph import CpuGraph\n"
              "x, graph = torch.randn(3, 32), CpuGraph()\n"
              "graph.capture(lambda: fused.silu_and_mul(x))\n"
              "assert graph.failure is None, graph.failure\n"
              "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
