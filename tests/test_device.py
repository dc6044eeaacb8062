"""The device an engine runs on (vLLM's `device` / `--device`): auto and cpu run on the CPU; anything else is a
ValueError naming the problem before the model loads or any process starts."""
import psutil
import pytest
import torch

from pagedllm import LLM
from pagedllm.engine.arg_utils import EngineArgs


@pytest.mark.parametrize("device", ["auto", "cpu"])
def test_auto_and_cpu_run_on_the_cpu(device):
    assert EngineArgs(device=device).create_engine_config().model_config.max_model_len > 0


def test_an_unknown_device_names_the_choices():
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda; got 'tpu'"):
        EngineArgs(device="tpu").create_engine_config()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible here")
def test_cuda_without_a_gpu_is_a_clear_error_before_any_process_starts():
    children = len(psutil.Process().children(recursive=True))
    with pytest.raises(ValueError, match=r"device='cuda', but torch sees no CUDA GPU \(torch .*\); use device='cpu'"):
        LLM(device="cuda")
    assert len(psutil.Process().children(recursive=True)) == children
