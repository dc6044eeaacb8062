"""pagedllm: a high-throughput LLM inference and serving engine on the vLLM V1 architecture."""
from pagedllm.beam_search import BeamSearchOutput, BeamSearchParams
from pagedllm.entrypoints.llm import LLM
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "BeamSearchParams", "BeamSearchOutput"]
__version__ = "0.1.0"
