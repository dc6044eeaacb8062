"""Sizing the KV cache on a GPU as vLLM does: gpu_memory_utilization of the device's memory, less the weights, the
peak of a profiling forward at the scheduler's largest step and what lives outside torch's allocator. The
arithmetic and the worker's use of it are checked here with fakes for the CUDA calls; the profiling forward itself
runs for real, on the CPU."""
import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.platforms import CudaPlatform
from pagedllm.platforms import cuda as cuda_platform
from pagedllm.platforms.cuda import MemoryProfile, kv_cache_memory_from_profile, profile_memory
from pagedllm.worker import worker as worker_module
from pagedllm.worker.worker import kv_cache_bytes_per_block, start_worker

GiB = 1 << 30


def test_the_cache_takes_what_the_share_leaves():
    profile = MemoryProfile(total=80 * GiB, weights=16 * GiB, peak_activations=4 * GiB, non_torch=GiB)
    assert kv_cache_memory_from_profile(profile, 0.9) == int(80 * GiB * 0.9) - 21 * GiB
    assert kv_cache_memory_from_profile(profile, 0.5) == 19 * GiB


def test_nothing_left_names_the_knobs():
    profile = MemoryProfile(total=24 * GiB, weights=16 * GiB, peak_activations=4 * GiB, non_torch=GiB)
    with pytest.raises(ValueError, match=r"No GPU memory left for the KV cache: gpu_memory_utilization=0.8 of 24.00 "
                                         r"GiB is 19.20 GiB, and the model takes 21.00 GiB \(weights 16.00 GiB, peak "
                                         r"activations 4.00 GiB, outside torch 1.00 GiB\); raise "
                                         r"gpu_memory_utilization, or lower max_num_batched_tokens"):
        kv_cache_memory_from_profile(profile, 0.8)


def test_profile_memory_reads_the_allocator_around_the_forward(monkeypatch):
    """Weights: allocated before the forward; activations: how far the peak rose above that; outside torch: the
    device's used memory beyond the allocator's reservation."""
    state = {"allocated": 3 * GiB, "peak": 3 * GiB}

    def forward():
        state["peak"] = 5 * GiB  # the forward allocates 2 GiB at its peak, then frees it

    fakes = {"synchronize": lambda: None, "empty_cache": lambda: None,
             "reset_peak_memory_stats": lambda: state.update(peak=state["allocated"]),
             "memory_allocated": lambda: state["allocated"], "max_memory_allocated": lambda: state["peak"],
             "memory_reserved": lambda: 6 * GiB, "mem_get_info": lambda: (70 * GiB, 80 * GiB)}
    for name, fake in fakes.items():
        monkeypatch.setattr(cuda_platform.torch.cuda, name, fake)
    assert profile_memory(forward) == MemoryProfile(total=80 * GiB, weights=3 * GiB, peak_activations=2 * GiB,
                                                    non_torch=4 * GiB)


@pytest.fixture(scope="module")
def worker():
    """The default model's worker on the CPU, which then answers as if on a GPU (its platform swapped)."""
    config = EngineArgs(dtype="float32", max_model_len=256, max_num_batched_tokens=96, max_num_seqs=5,
                        enforce_eager=True).create_engine_config()
    worker = start_worker(config)
    worker.platform = CudaPlatform()
    return worker


def test_a_gpu_worker_sizes_its_cache_from_the_profile_of_a_largest_step(worker, monkeypatch):
    steps = []
    hook = worker.model_runner.model.register_forward_pre_hook(
        lambda module, args: steps.append((args[0].shape[0], args[3].query_start_loc.tolist(), args[1].tolist())))
    profile = MemoryProfile(total=10 * GiB, weights=GiB, peak_activations=2 * GiB, non_torch=GiB // 2)

    def fake_profile_memory(forward):
        forward()
        return profile

    monkeypatch.setattr(worker_module, "profile_memory", fake_profile_memory)
    worker.config.cache_config.gpu_memory_utilization = 0.5
    try:
        num_blocks = worker.determine_num_kv_blocks()
    finally:
        hook.remove()
    assert num_blocks == (5 * GiB - 3 * GiB - GiB // 2) // kv_cache_bytes_per_block(worker.config)
    # max_num_batched_tokens over max_num_seqs prompts, each from position 0
    (num_tokens, query_start_loc, positions), = steps
    assert num_tokens == 96 and query_start_loc == [0, 20, 39, 58, 77, 96]
    assert positions[:21] == list(range(20)) + [0] and positions[-1] == 18


def test_a_gpu_cache_that_cannot_hold_one_max_model_len_request_names_the_knobs(worker, monkeypatch):
    per_block = kv_cache_bytes_per_block(worker.config)
    weights = 8 * GiB - 3 * per_block  # leaves 3 blocks (48 tokens) at utilization 0.5 of 16 GiB
    monkeypatch.setattr(worker_module, "profile_memory",
                        lambda forward: MemoryProfile(total=16 * GiB, weights=weights, peak_activations=0,
                                                      non_torch=0))
    worker.config.cache_config.gpu_memory_utilization = 0.5
    with pytest.raises(ValueError, match=r"The KV cache holds 48 tokens on this GPU, fewer than one request of "
                                         r"max_model_len \(256\); raise gpu_memory_utilization or lower max_model_len"):
        worker.determine_num_kv_blocks()


def test_kv_cache_memory_given_skips_the_profile(worker, monkeypatch):
    monkeypatch.setattr(worker_module, "profile_memory", lambda forward: pytest.fail("profiled"))
    monkeypatch.setattr(worker.config.cache_config, "kv_cache_memory", "1MiB")
    assert worker.determine_num_kv_blocks() == (1 << 20) // kv_cache_bytes_per_block(worker.config)


def test_the_default_share_is_vllms():
    """vLLM 0.32's CacheConfig default, as EngineArgs' and the resolved config's."""
    assert EngineArgs.gpu_memory_utilization == 0.92
    assert EngineArgs().create_engine_config().cache_config.gpu_memory_utilization == 0.92
