"""The device an engine runs on (vLLM's `device` / `--device`) and the platform it resolves to: auto and cpu run on
the CPU here, cuda where torch sees a GPU (faked below: the choice needs no GPU to check); anything else is a
ValueError naming the problem before the model loads or any process starts."""
import psutil
import pytest
import torch

from pagedllm import LLM
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.platforms import CpuPlatform, CudaPlatform, resolve_platform


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch sees a GPU that computes bfloat16 (only what choosing the platform asks)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)


@pytest.mark.parametrize("device", ["auto", "cpu"])
def test_auto_and_cpu_run_on_the_cpu(device):
    config = EngineArgs(device=device).create_engine_config()
    assert (config.model_config.device, config.model_config.attention_backend) == ("cpu", "TORCH_SDPA")
    assert config.parallel_config.torch_distributed_backend == "gloo"
    assert config.model_config.dtype == CpuPlatform().default_dtype()


def test_an_unknown_device_names_the_choices():
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda; got 'tpu'"):
        EngineArgs(device="tpu").create_engine_config()


def test_dtype_names_are_case_insensitive_and_a_torch_dtype_is_checked():
    """As vLLM's, dtype names are case-insensitive; a torch.dtype the layers do not compute in (a float64 engine
    failed in its process) is a ValueError naming dtype before any process starts."""
    assert EngineArgs(dtype="BFloat16").create_engine_config().model_config.dtype == torch.bfloat16
    assert EngineArgs(dtype=torch.float16).create_engine_config().model_config.dtype == torch.float16
    with pytest.raises(ValueError, match=r"dtype must be one of auto, float32, float, bfloat16, float16, half \(or "
                                         r"their torch dtypes\); got torch.float64"):
        EngineArgs(dtype=torch.float64).create_engine_config()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible here")
def test_cuda_without_a_gpu_is_a_clear_error_that_leaves_no_process():
    """Raised before the model's config is read; the engine interpreter LLM() started at once (launch.py), which
    holds nothing yet, goes with the error."""
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match=r"device='cuda', but torch sees no CUDA GPU \(torch .*\); use device='cpu'"):
        LLM(device="cuda")
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_a_visible_gpu_is_the_cuda_platform(fake_gpu, device):
    assert isinstance(resolve_platform(device), CudaPlatform)
    assert isinstance(resolve_platform("cpu"), CpuPlatform)
    config = EngineArgs(device=device).create_engine_config()
    assert (config.model_config.device, config.model_config.attention_backend) == ("cuda", "TRITON_ATTN")
    assert config.parallel_config.torch_distributed_backend == "nccl"
    assert config.model_config.dtype == torch.bfloat16


def test_auto_dtype_on_a_gpu_without_bfloat16_is_float16(fake_gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert EngineArgs(device="cuda").create_engine_config().model_config.dtype == torch.float16


def test_gemma_refuses_float16_and_its_auto_is_float32_where_the_default_is_float16(tmp_path, fake_gpu, monkeypatch):
    """As vLLM's: Gemma 2 and 3 overflow float16, so asking for it is a ValueError naming dtype, and 'auto' on a GPU
    without bfloat16 is float32 for them."""
    from transformers import Gemma2Config

    Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="dtype: the model type 'gemma2' does not support float16"):
        EngineArgs(str(tmp_path), device="cpu", dtype="half").create_engine_config()
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert EngineArgs(str(tmp_path), device="cuda").create_engine_config().model_config.dtype == torch.float32
    assert EngineArgs(device="cuda").create_engine_config().model_config.dtype == torch.float16  # others: float16


def test_auto_dtype_keeps_the_checkpoints_where_the_platform_computes_it(tmp_path, fake_gpu, caplog):
    """As vLLM's _resolve_auto_dtype: 'auto' is the dtype config.json gives where the platform computes it at full
    speed (a float16 checkpoint runs in float16 on a GPU), a float32 one takes the platform's default. On the CPU,
    whose float16 is torch's slow path, a float16 checkpoint runs in the default, with a warning saying so."""
    from transformers import LlamaConfig

    for dtype in ("float16", "float32"):
        LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                    dtype=dtype).save_pretrained(tmp_path / dtype)
    auto = lambda dtype, device: EngineArgs(str(tmp_path / dtype), device=device).create_engine_config(  # noqa: E731
        ).model_config.dtype
    assert (auto("float16", "cuda"), auto("float32", "cuda")) == (torch.float16, torch.bfloat16)
    assert auto("float16", "cpu") == auto("float32", "cpu") == CpuPlatform().default_dtype()
    assert "the checkpoint's torch.float16 does not run at full speed on cpu" in caplog.text


def test_checkpoint_dtype_reads_the_torch_dtype_of_older_transformers_configs():
    """transformers before 4.56 (pyproject allows 4.45) name a config's dtype ``torch_dtype``; a multimodal config
    may give it on its text config only."""
    from types import SimpleNamespace

    from pagedllm.engine.arg_utils import checkpoint_dtype

    def config(text_config=None, **fields):
        namespace = SimpleNamespace(**fields)
        namespace.get_text_config = lambda: text_config or namespace
        return namespace

    assert checkpoint_dtype(config(torch_dtype="float16")) == torch.float16
    assert checkpoint_dtype(config(dtype=torch.bfloat16, torch_dtype="float16")) == torch.bfloat16
    assert checkpoint_dtype(config(text_config=config(torch_dtype=torch.float16))) == torch.float16
    assert checkpoint_dtype(config(torch_dtype="int8")) is None and checkpoint_dtype(config()) is None


@pytest.mark.parametrize("kwargs, names", [
    ({"quantization": "gguf_int4"}, "quantization"),
    ({"enable_lora": True, "tensor_parallel_size": 2}, "enable_lora, tensor_parallel_size"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative_config"),
])
def test_what_cuda_does_not_run_yet_is_named(fake_gpu, kwargs, names):
    with pytest.raises(ValueError, match=f"device 'cuda' does not run {names} yet"):
        EngineArgs(device="cuda", **kwargs).create_engine_config()


@pytest.mark.parametrize("device, backend, message", [
    ("cpu", "FLASH_ATTN", "attention_backend must be one of TORCH_SDPA, TRITON_ATTN on cpu; got 'FLASH_ATTN'"),
    ("cuda", "TORCH_SDPA", "attention_backend must be one of TRITON_ATTN on cuda; got 'TORCH_SDPA'"),
])
def test_an_attention_backend_the_platform_lacks_names_its_choices(fake_gpu, device, backend, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(device=device, attention_backend=backend).create_engine_config()


@pytest.mark.parametrize("device, backend, expected", [
    ("cpu", "auto", "TORCH_SDPA"), ("cpu", "AUTO", "TORCH_SDPA"), ("cpu", "cpu_attn", "TORCH_SDPA"),
    ("cpu", "CPU_ATTN", "TORCH_SDPA"), ("cpu", "torch_sdpa", "TORCH_SDPA"), ("cuda", "Auto", "TRITON_ATTN"),
    ("cuda", "triton_attn", "TRITON_ATTN"),
])
def test_vllms_attention_backend_names_are_taken(fake_gpu, device, backend, expected):
    """As vLLM's AttentionConfig reads them: in any case, "auto" the platform's default, its CPU backend's name
    (CPU_ATTN) this engine's; in attention_config's "backend" too."""
    for kwargs in ({"attention_backend": backend}, {"attention_config": {"backend": backend}}):
        config = EngineArgs(device=device, **kwargs).create_engine_config()
        assert config.model_config.attention_backend == expected


def test_triton_attention_on_the_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"runs Triton's interpreter only \(set TRITON_INTERPRET=1 before the process "
                                         r"starts\)"):
        EngineArgs(attention_backend="TRITON_ATTN").create_engine_config()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8': the TRITON_ATTN attention backend keeps the cache in "
                                         "the model's dtype only"):
        EngineArgs(attention_backend="TRITON_ATTN", kv_cache_dtype="fp8").create_engine_config()


@pytest.mark.parametrize("block_size", [8, 24])
def test_triton_attention_refuses_a_block_size_its_kernels_do_not_take(monkeypatch, block_size):
    """A power of two of at least 16 (a tile of its kernels): any other is refused with the config, as vLLM's backend
    selection refuses it, where it used to fail the first request's step."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match=f"block_size={block_size}: the TRITON_ATTN attention backend takes a power "
                                         "of two of at least 16"):
        EngineArgs(attention_backend="TRITON_ATTN", block_size=block_size).create_engine_config()
    config = EngineArgs(attention_backend="TRITON_ATTN", block_size=32).create_engine_config()
    assert config.cache_config.block_size == 32
