"""EngineArgs: the user-facing knobs (LLM kwargs, CLI flags) and how they become an EngineConfig."""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import InitVar, dataclass
from typing import Any, Callable, Optional, Union

import torch

from pagedllm.config import (CacheConfig, EngineConfig, LoRAConfig, ModelConfig, ParallelConfig, ProfilerConfig,
                             ReasoningConfig, SchedulerConfig, SpeculativeConfig, StructuredOutputsConfig, check_bool,
                             check_capture_size_shortcuts, check_int, check_kv_cache_dtype, check_optional_dict,
                             common_window, graphs_turned_off, layer_sliding_window)
from pagedllm.core.kv_cache_groups import KVCacheGroup, kv_cache_groups
from pagedllm.layers.attention.selector import attention_backend_name
from pagedllm.layers.rope_scaling import default_max_model_len, positions_served
from pagedllm.models.generation_config import check_generation_config
from pagedllm.models.hf_config import apply_hf_overrides, load_hf_config, load_tokenizer
from pagedllm.models.loader import get_quant_config
from pagedllm.models.registry import check_model_config, get_model_architecture
from pagedllm.models.resolve import DEFAULT_MODEL, resolve_model
from pagedllm.models.weights import WEIGHT_FILES
from pagedllm.platforms import Platform, resolve_platform
from pagedllm.reasoning import get_reasoning_parser
from pagedllm.sampling_params import MAX_LOGPROBS

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}
# vLLM's tokenizer_mode values this engine serves: both load the Hugging Face tokenizer, as it always does (vLLM's
# "auto" is "hf" but for Mistral models with mistral_common installed). Its others (mistral_common's, DeepSeek's, ...)
# are refused: they would tokenize and render chats otherwise.
TOKENIZER_MODES = ("auto", "hf")
# Model types whose activations overflow float16 (vLLM's _FLOAT16_NOT_SUPPORTED_MODELS): Gemma 2 and 3.
FLOAT16_UNSTABLE_MODEL_TYPES = ("gemma2", "gemma3", "gemma3_text")
LOAD_FORMATS = tuple(WEIGHT_FILES)


def resolve_dtype(dtype: Union[str, torch.dtype], platform: Platform, model_type: Optional[str] = None,
                  checkpoint_dtype: Optional[torch.dtype] = None) -> torch.dtype:
    """'auto' is _auto_dtype's. Names are case-insensitive, as vLLM's; a torch.dtype must be one they name: the
    layers and kernels compute in those floats only (a float64 model failed in the engine process). A ``model_type``
    that overflows float16 (FLOAT16_UNSTABLE_MODEL_TYPES) is refused it, as vLLM's."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)} (or their torch dtypes); got {dtype}")
        resolved = dtype
    else:
        name = dtype.lower() if isinstance(dtype, str) else dtype
        if name == "auto":
            return _auto_dtype(platform, model_type, checkpoint_dtype)
        if name not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
        resolved = _DTYPES[name]
    if resolved == torch.float16 and model_type in FLOAT16_UNSTABLE_MODEL_TYPES:
        raise ValueError(f"dtype: the model type {model_type!r} does not support float16 (numerical instability); "
                         f"use bfloat16 or float32")
    return resolved


def _auto_dtype(platform: Platform, model_type: Optional[str], checkpoint_dtype: Optional[torch.dtype]) -> torch.dtype:
    """vLLM's _resolve_auto_dtype: the checkpoint's dtype (its config's) where the platform computes it
    (Platform.supported_dtypes), else the first of those, the platform's default (float32 for a model that overflows
    float16 where that is float16); a float32 checkpoint, or one whose config does not say, takes it too."""
    supported = [d for d in platform.supported_dtypes()
                 if not (d == torch.float16 and model_type in FLOAT16_UNSTABLE_MODEL_TYPES)]
    if checkpoint_dtype in supported and checkpoint_dtype != torch.float32:
        return checkpoint_dtype
    if checkpoint_dtype not in (None, torch.float32):
        logger.warning("dtype 'auto': the checkpoint's %s does not run at full speed on %s; running in %s",
                       checkpoint_dtype, platform.device_type, supported[0])
    return supported[0]


def checkpoint_dtype(hf_config) -> Optional[torch.dtype]:
    """The dtype a model's config says its weights are in (its text config's for a multimodal one), if a _DTYPES one:
    ``dtype``, or ``torch_dtype`` in the configs of transformers before 4.56 (which pyproject allows)."""
    dtype = next((value for config in (hf_config, hf_config.get_text_config()) for name in ("dtype", "torch_dtype")
                  if (value := getattr(config, name, None))), None)
    dtype = _DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    return dtype if dtype in _DTYPES.values() else None


@dataclass
class EngineArgs:
    model: str = DEFAULT_MODEL
    device: str = "auto"  # vLLM's: auto | cpu | cuda (platforms.resolve_platform)
    # vLLM's --attention-backend: one the platform offers (Platform.attention_backends); None: its default.
    attention_backend: Optional[str] = None
    # A tokenizer directory (or alias) other than the model's; None: the model's own.
    tokenizer: Optional[str] = None
    tokenizer_mode: str = "auto"  # one of TOKENIZER_MODES
    dtype: Union[str, torch.dtype] = "auto"
    max_model_len: Optional[int] = None
    # None: vLLM's default, 256 but at most max_num_batched_tokens (a step holds a token of every running request).
    max_num_seqs: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None
    block_size: int = 16
    # None: the default (on), as vLLM's None.
    enable_prefix_caching: Optional[bool] = True
    enable_chunked_prefill: Optional[bool] = True  # None: the default (on), as vLLM's None
    long_prefill_token_threshold: int = 0
    # None: the entry point's default, as vLLM's max_num_batched_tokens by usage context: the server's
    # SERVE_MAX_PREFILL_TOKENS_WITH_DECODES (latency under load), 0 (off) for LLM() and run-batch (throughput).
    max_prefill_tokens_with_decodes: Optional[int] = None
    scheduling_policy: str = "fcfs"
    # vLLM's: admit a waiting request only once its whole prompt fits the free KV blocks (SchedulerConfig's).
    scheduler_reserve_full_isl: bool = True
    # vLLM's: outputs of a running request every this many tokens (SchedulerConfig.stream_interval).
    stream_interval: int = 1
    kv_cache_memory: Optional[Union[int, str]] = None
    # vLLM's name for the same size, in bytes (its --kv-cache-memory-bytes, which the CPU backend honours too).
    kv_cache_memory_bytes: Optional[int] = None
    kv_cache_dtype: str = "auto"
    kv_cache_populate: str = "background"
    gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization
    num_kv_blocks: Optional[int] = None
    # vLLM's name for the same count (its num_gpu_blocks_override, the CPU backend's too).
    num_gpu_blocks_override: Optional[int] = None
    seed: int = 0
    # The most logprobs or prompt_logprobs one request may ask for (vLLM's default; -1: the whole vocabulary).
    max_logprobs: int = MAX_LOGPROBS
    # vLLM's logprobs_mode: raw_logprobs (the default), raw_logits, processed_logprobs or processed_logits.
    logprobs_mode: str = "raw_logprobs"
    quantization: Optional[str] = None
    # vLLM's load_format: which of an HF directory's weight files load, one of LOAD_FORMATS (a .gguf file is GGUF).
    load_format: str = "auto"
    num_cpu_threads: Optional[int] = None
    enforce_eager: bool = False
    # vLLM's compilation_config: a mode (0-3) or a dict of its CompilationConfig fields (config.graphs_turned_off).
    compilation_config: Optional[Union[int, dict]] = None
    # vLLM's optimization_level (-O0 .. -O3): 0 turns graphs off where compilation_config leaves cudagraph_mode
    # unset; torch.compile's settings, which the others add, change nothing here.
    optimization_level: int = 2
    # vLLM's shortcuts for two of its fields (config.check_capture_size_shortcuts): taken, and change nothing here.
    cudagraph_capture_sizes: Optional[list[int]] = None
    max_cudagraph_capture_size: Optional[int] = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: Optional[str] = None
    enable_expert_parallel: bool = False
    # vLLM's speculative_config: a dict such as {"method": "ngram", "num_speculative_tokens": 4}.
    speculative_config: Optional[Union[dict, SpeculativeConfig]] = None
    # vLLM's shortcuts for three of its keys (--spec-method, --spec-model, --spec-tokens; _speculative_config).
    spec_method: Optional[str] = None
    spec_model: Optional[str] = None
    spec_tokens: Optional[int] = None
    # vLLM's structured_outputs_config: a dict such as {"backend": "xgrammar", "disable_any_whitespace": false}.
    structured_outputs_config: Optional[Union[dict, StructuredOutputsConfig]] = None
    # vLLM's reasoning_parser (--reasoning-parser): one of REASONING_PARSERS, whose <think> markers a request's
    # thinking_token_budget is counted and enforced by; the server also splits chat answers' reasoning off by it.
    reasoning_parser: str = ""
    # vLLM's reasoning_config: a dict such as {"reasoning_end_str": "Time to answer.</think>"} (config.ReasoningConfig).
    reasoning_config: Optional[dict] = None
    # vLLM's profiler_config: a dict such as {"profiler": "torch", "torch_profiler_dir": "/tmp/traces"}.
    profiler_config: Optional[Union[dict, ProfilerConfig]] = None
    # Multi-LoRA serving (vLLM's names and defaults).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None
    # vLLM's generation_config: "auto", "vllm" or a directory holding generation_config.json (ModelConfig's).
    generation_config: str = "auto"
    # vLLM's override_generation_config: generation config fields over the file's, e.g. {"temperature": 0.5}.
    override_generation_config: Optional[dict] = None
    # vLLM's: True turns the engine's statistics off (metrics, RequestOutput.metrics, the stats line). LLM() sets it
    # True unless told; the server from --disable-log-stats.
    disable_log_stats: bool = False
    # vLLM's, taken so that its scripts and command lines run: pagedllm never runs code a checkpoint ships (its
    # architectures are its own, registry.py), so a model that needs remote code is refused by architecture either way.
    trust_remote_code: bool = False
    # vLLM's hf_overrides: config fields to replace ({"max_position_embeddings": 4096}), or a callable on the config.
    hf_overrides: Optional[Union[dict, Callable[[Any], Any]]] = None
    # vLLM's, taken at the values pagedllm honours (refuse_unsupported): the Hub revision and download directory
    # (pagedllm never downloads), GiB of weights offloaded to CPU memory, and async scheduling (vLLM's CPU backend
    # turns it off too).
    revision: Optional[str] = None
    download_dir: Optional[str] = None
    cpu_offload_gb: float = 0
    async_scheduling: Optional[bool] = None
    # vLLM's arguments that are no command-line flags here (the CLI's flags are the fields, which InitVars are not),
    # each kept as an attribute of its name. skip_tokenizer_init: no tokenizer (nor detokenizer): prompts must be
    # token ids, outputs have token ids and no text, and what needs text (chat, beam search, bad_words, structured
    # outputs) is refused, or ignored as vLLM's ignores it (stop strings).
    skip_tokenizer_init: InitVar[bool] = False
    # Taken at the values pagedllm honours (refuse_unsupported): tokenizer_revision (as revision), hf_token (a Hub
    # login, which nothing here uses: models are local), runner ("auto" or "generate": the models here generate),
    # mm_processor_kwargs (multi-modal processors' settings, which vLLM ignores for a text-only model, as every model
    # here is) and logits_processors (custom logits processors: none here).
    tokenizer_revision: InitVar[Optional[str]] = None
    hf_token: InitVar[Optional[Union[bool, str]]] = None
    runner: InitVar[str] = "auto"
    mm_processor_kwargs: InitVar[Optional[dict]] = None
    logits_processors: InitVar[Optional[list]] = None
    # vLLM's LLM arguments for what pagedllm has not: taken at the values that ask for none of it, else refused by
    # name (UNSUPPORTED_AT_DEFAULT).
    convert: InitVar[str] = "auto"
    allowed_local_media_path: InitVar[str] = ""
    allowed_media_domains: InitVar[Optional[list[str]]] = None
    offload_group_size: InitVar[int] = 0
    offload_num_in_group: InitVar[int] = 1
    offload_prefetch_step: InitVar[int] = 1
    offload_params: InitVar[Optional[set[str]]] = None
    pooler_config: InitVar[Optional[Any]] = None
    quantization_config: InitVar[Optional[dict]] = None
    enable_return_routed_experts: InitVar[bool] = False
    return_sampling_mask: InitVar[bool] = False
    enable_prompt_embeds: InitVar[bool] = False
    worker_extension_cls: InitVar[str] = ""
    # The two that vLLM's LLM() itself converts (a worker class cloudpickled, a KVTransferConfig from a dict).
    worker_cls: InitVar[Any] = "auto"
    kv_transfer_config: InitVar[Optional[Any]] = None
    # vLLM's: without it, its sleep() is refused; here sleep() is always there, so either value is honoured.
    enable_sleep_mode: InitVar[bool] = False
    # vLLM's: True or False, honoured either way: tensor parallelism here all-reduces with torch.distributed's own,
    # never vLLM's custom CUDA kernel.
    disable_custom_all_reduce: InitVar[bool] = False
    # vLLM's attention_config: a dict, whose "backend" is attention_backend's (one or the other, as vLLM's); its other
    # keys tune vLLM's GPU kernels, none of this engine's, and are refused (attention_backend_chosen).
    attention_config: InitVar[Optional[dict]] = None

    def __post_init__(self, *init_vars: Any) -> None:
        """Each InitVar kept as an attribute of its name (what from_engine_args' vars() hands on)."""
        vars(self).update(zip(_INIT_VARS, init_vars))

    def log_stats(self) -> bool:
        """Whether the engine keeps statistics (vLLM's log_stats: not disable_log_stats, checked)."""
        check_bool("disable_log_stats", self.disable_log_stats)
        return not self.disable_log_stats

    def _check_on_off_fields(self) -> None:
        """Every on/off field True or False (None too where it means the default): a string such as "false" is
        truthy, and would turn on what it meant to turn off; a ValueError names the field instead."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type in ("bool", "Optional[bool]") and not (value is None and field.type != "bool"):
                check_bool(field.name, value)

    def refuse_unsupported(self) -> None:
        """A ValueError naming the vLLM field set to what pagedllm cannot do, rather than a setting taken and not
        honoured: a revision or download_dir (models are local files, never downloaded), offloading weights, async
        scheduling, a runner other than generation, custom logits processors, UNSUPPORTED_AT_DEFAULT's."""
        for name in ("revision", "tokenizer_revision", "download_dir"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name}={getattr(self, name)!r}: pagedllm never downloads a model from the Hugging "
                                 "Face Hub; pass the local directory (or .gguf file) of the revision wanted as the "
                                 "model")
        offload = self.cpu_offload_gb
        if isinstance(offload, bool) or not isinstance(offload, (int, float)) or offload < 0:
            raise ValueError(f"cpu_offload_gb must be a number of GiB, at least 0, got {offload!r}")
        if offload > 0:
            raise ValueError(f"cpu_offload_gb={offload}: offloading weights to CPU memory is not supported (on the "
                             "CPU they are there already); leave it at 0")
        if self.async_scheduling:
            raise ValueError("async_scheduling=True: pagedllm has no async scheduling (vLLM's CPU backend turns it "
                             "off too); leave it unset or False")
        if self.runner not in ("auto", "generate"):
            raise ValueError(f"runner must be 'auto' or 'generate' (pagedllm's models generate; vLLM's pooling and "
                             f"draft runners are not supported), got {self.runner!r}")
        check_optional_dict("mm_processor_kwargs", self.mm_processor_kwargs)
        if self.logits_processors:
            raise ValueError(f"logits_processors={self.logits_processors!r}: custom logits processors are not "
                             "supported; leave it unset")
        for name, (accepted, what) in UNSUPPORTED_AT_DEFAULT.items():
            value = getattr(self, name)
            # True == 1: a bool is accepted only where the default is one
            if value not in accepted or (type(value) is bool) != (type(accepted[0]) is bool):
                raise ValueError(f"{name}={value!r}: pagedllm does not support {what}; leave it {accepted[0]!r}")
        check_bool("disable_custom_all_reduce", self.disable_custom_all_reduce)
        check_bool("enable_sleep_mode", self.enable_sleep_mode)

    def attention_backend_chosen(self) -> Optional[str]:
        """attention_backend, or vLLM's attention_config "backend" (None: the platform's default), each read as vLLM
        reads it (attention_backend_name: any case, "auto", vLLM's CPU_ATTN). Both at once is vLLM's ValueError;
        attention_config's other keys, vLLM's GPU kernels' settings, are refused by name."""
        backend = attention_backend_name(self.attention_backend)
        config = self.attention_config
        if config is None:
            return backend
        if not isinstance(config, dict):
            raise ValueError(f"attention_config must be a dict (JSON object), got {config!r}")
        for key in config:
            if key != "backend":
                raise ValueError(f"attention_config {key!r} is not supported: only 'backend' (vLLM's other keys tune "
                                 "its GPU kernels)")
        config_backend = attention_backend_name(config.get("backend"))
        if config_backend is None:
            return backend
        if self.attention_backend is not None:
            raise ValueError("attention_backend and attention_config.backend are mutually exclusive")
        return config_backend

    def create_engine_config(self) -> EngineConfig:
        self._check_on_off_fields()
        check_bool("skip_tokenizer_init", self.skip_tokenizer_init)
        self.refuse_unsupported()
        # Checks that need no model first: a bad speculative_config fails before the model's config loads.
        platform = resolve_platform(self.device)
        attention_backend = self.attention_backend_chosen() or platform.attention_backends[0]
        platform.check_attention_backend(attention_backend)
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.load_format not in LOAD_FORMATS:  # vLLM's others: dummy weights, other readers and stores
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {self.load_format!r}")
        if self.tokenizer_mode not in TOKENIZER_MODES:
            raise ValueError(f"tokenizer_mode must be one of {', '.join(TOKENIZER_MODES)} (the Hugging Face "
                             f"tokenizer); got {self.tokenizer_mode!r}")
        enforce_eager = self.enforce_eager or graphs_turned_off(self.compilation_config, self.optimization_level)
        check_capture_size_shortcuts(self.compilation_config, self.cudagraph_capture_sizes,
                                     self.max_cudagraph_capture_size)
        kv_cache_memory = _one_of("kv_cache_memory", self.kv_cache_memory, "kv_cache_memory_bytes",
                                  self.kv_cache_memory_bytes, "size the KV cache")
        num_kv_blocks = _one_of("num_kv_blocks", self.num_kv_blocks, "num_gpu_blocks_override",
                                self.num_gpu_blocks_override, "set the KV cache's blocks")
        speculative_config = self._speculative_config()
        if platform.device_type == "cuda":
            self._check_cuda_support(speculative_config)
        if attention_backend == "TRITON_ATTN" and self.kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}: the TRITON_ATTN attention backend keeps the "
                             "cache in the model's dtype only (kv_cache_dtype='auto')")
        check_int("block_size", self.block_size, 1)
        if attention_backend == "TRITON_ATTN" and (self.block_size < 16 or self.block_size & (self.block_size - 1)):
            # Its kernels' tiles (triton_ops/decode_attention.check_attention_args): refused here, as vLLM's backend
            # selection refuses a block size the backend does not support, rather than by the first step.
            raise ValueError(f"block_size={self.block_size}: the TRITON_ATTN attention backend takes a power of two "
                             "of at least 16")
        if isinstance(speculative_config, dict):
            speculative_config = SpeculativeConfig.from_dict(speculative_config)
        structured_outputs_config = self.structured_outputs_config
        if not isinstance(structured_outputs_config, StructuredOutputsConfig):
            structured_outputs_config = StructuredOutputsConfig.from_dict(structured_outputs_config or {})
        if self.reasoning_parser:
            get_reasoning_parser(self.reasoning_parser)  # a bad name fails before the model loads
        profiler_config = self.profiler_config
        if not isinstance(profiler_config, ProfilerConfig):
            profiler_config = ProfilerConfig.from_dict(profiler_config or {})
        path = resolve_model(self.model)
        check_generation_config(path, self.generation_config, self.override_generation_config)
        hf_config = load_hf_config(path)
        if self.hf_overrides is not None:
            hf_config = apply_hf_overrides(hf_config, self.hf_overrides)
        check_model_config(hf_config)  # what the layers do not compute fails here, before any process
        model_max_len = positions_served(hf_config)
        # -1 (vLLM's auto-fit): the model's context length, lowered by the engine to what its KV cache holds.
        auto_fit = self.max_model_len == -1
        max_model_len = default_max_model_len(hf_config) if self.max_model_len in (None, -1) else self.max_model_len
        check_int("max_model_len", max_model_len, 1)
        if max_model_len > model_max_len:
            raise ValueError(f"max_model_len ({max_model_len}) is larger than the model's "
                             f"max_position_embeddings ({model_max_len}, with its rope scaling).")
        if self.num_cpu_threads is not None:
            check_int("num_cpu_threads", self.num_cpu_threads, 1)
        chunked_prefill = True if self.enable_chunked_prefill is None else self.enable_chunked_prefill
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None:
            max_num_batched_tokens = 2048 if chunked_prefill else max_model_len
        max_num_seqs = self.max_num_seqs
        if max_num_seqs is None:
            check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
            max_num_seqs = min(256, max_num_batched_tokens)
        set_quantization(hf_config, self.quantization, path)
        parallel_config = ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size,
                                         self.data_parallel_size, self.distributed_executor_backend,
                                         pp_layer_partition=pp_layer_partition_from_env(),
                                         enable_expert_parallel=self.enable_expert_parallel)
        parallel_config.torch_distributed_backend = platform.dist_backend
        parallel_config.verify_with_model(hf_config)
        parallel_config.distributed_executor_backend = resolve_executor_backend(parallel_config)
        if parallel_config.distributed_executor_backend == "ray" and _ray_initialized():
            parallel_config.ray_address = sys.modules["ray"].get_runtime_context().gcs_address
        if speculative_config is not None and parallel_config.pipeline_parallel_size > 1:
            raise ValueError("speculative_config is not supported with pipeline_parallel_size > 1 yet")
        model_config = ModelConfig(self.model, path, hf_config,
                                   resolve_dtype(self.dtype, platform, hf_config.model_type,
                                                 checkpoint_dtype(hf_config)), max_model_len,
                                   self.seed, self.quantization, enforce_eager, self.max_logprobs,
                                   resolve_model(self.tokenizer) if self.tokenizer else None,
                                   self.generation_config, platform.device_type, attention_backend,
                                   self.override_generation_config, logprobs_mode=self.logprobs_mode,
                                   auto_fit_max_model_len=auto_fit, load_format=self.load_format,
                                   skip_tokenizer_init=self.skip_tokenizer_init)
        if speculative_config is not None and speculative_config.method == "draft_model":
            draft_tp = speculative_config.draft_tensor_parallel_size
            if draft_tp not in (None, 1, parallel_config.tensor_parallel_size):  # vLLM's _verify_and_get_draft_tp
                raise ValueError(f"speculative_config draft_tensor_parallel_size={draft_tp} cannot be other value "
                                 f"than 1 or target model tensor_parallel_size")
            if parallel_config.world_size > 1:
                raise ValueError("speculative_config method 'draft_model' is not supported with "
                                 "tensor_parallel_size > 1 yet")
            speculative_config.draft_model_config = draft_model_config(speculative_config, model_config)
        config = EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(block_size=self.block_size,
                                     enable_prefix_caching=(True if self.enable_prefix_caching is None
                                                            else self.enable_prefix_caching),
                                     kv_cache_memory=kv_cache_memory, num_blocks=num_kv_blocks,
                                     cache_dtype=resolve_kv_cache_dtype(self.kv_cache_dtype, hf_config,
                                                                        attention_backend),
                                     kv_cache_populate=self.kv_cache_populate,
                                     gpu_memory_utilization=self.gpu_memory_utilization,
                                     sliding_window=_cache_sliding_window(model_config, speculative_config),
                                     kv_cache_groups=_cache_groups(model_config)),
            scheduler_config=SchedulerConfig(
                max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens, enable_chunked_prefill=chunked_prefill,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                max_prefill_tokens_with_decodes=self.max_prefill_tokens_with_decodes or 0,
                policy=self.scheduling_policy, scheduler_reserve_full_isl=self.scheduler_reserve_full_isl,
                stream_interval=self.stream_interval),
            num_cpu_threads=self.num_cpu_threads,
            parallel_config=parallel_config,
            speculative_config=speculative_config,
            structured_outputs_config=structured_outputs_config,
            profiler_config=profiler_config,
            lora_config=(LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras) if self.enable_lora
                         else None),
        )
        # Last, once every other setting is known good: its token ids need the tokenizer, the slowest thing loaded
        # here (the frontend's start-up then finds it loaded: load_tokenizer keeps it).
        config.reasoning_config = ReasoningConfig.from_args(self.reasoning_config, self.reasoning_parser,
                                                            lambda: load_tokenizer(model_config.tokenizer))
        return config

    def _speculative_config(self) -> Optional[Union[dict, SpeculativeConfig]]:
        """speculative_config with vLLM's shortcuts in it (create_speculative_config): each sets its key, which
        speculative_config must not give too."""
        shortcuts = [(flag, key, value) for flag, key, value in (
            ("--spec-method", "method", self.spec_method), ("--spec-model", "model", self.spec_model),
            ("--spec-tokens", "num_speculative_tokens", self.spec_tokens)) if value is not None]
        if not shortcuts:
            return self.speculative_config
        if isinstance(self.speculative_config, SpeculativeConfig):
            raise ValueError(f"{shortcuts[0][0]} sets a key of a speculative_config dict, not of a SpeculativeConfig")
        if not isinstance(self.speculative_config, (dict, type(None))):
            raise ValueError(f"speculative_config must be a dict (JSON object), got {self.speculative_config!r}")
        config = dict(self.speculative_config or {})
        for flag, key, value in shortcuts:
            if key in config:
                raise ValueError(f"{flag} and --speculative-config['{key}'] are mutually exclusive")
            config[key] = value
        return config

    def _check_cuda_support(self, speculative_config) -> None:
        """A ValueError naming each setting the CUDA platform does not run yet (they run on the CPU)."""
        unsupported = {"quantization": self.quantization is not None, "enable_lora": self.enable_lora,
                       "speculative_config": speculative_config is not None,
                       "tensor_parallel_size": self.tensor_parallel_size > 1,
                       "pipeline_parallel_size": self.pipeline_parallel_size > 1,
                       "data_parallel_size": self.data_parallel_size > 1}
        names = [name for name, used in unsupported.items() if used]
        if names:
            raise ValueError(f"device 'cuda' does not run {', '.join(names)} yet (pagedllm's CUDA platform is new); "
                             "leave them at their defaults or use device='cpu'")


# EngineArgs' InitVars, in the order __post_init__ is given them (their declaration's).
_INIT_VARS = tuple(name for name, annotation in EngineArgs.__annotations__.items() if annotation.startswith("InitVar"))
# vLLM's arguments for what pagedllm has not: the values that ask for none of it (vLLM's default first), and what.
UNSUPPORTED_AT_DEFAULT = {
    "convert": (("auto", "none"), "converting a model to a pooling one"),
    "allowed_local_media_path": (("",), "media in prompts (its models take text only)"),
    "allowed_media_domains": ((None,), "media in prompts (its models take text only)"),
    "offload_group_size": ((0,), "offloading weights"), "offload_num_in_group": ((1,), "offloading weights"),
    "offload_prefetch_step": ((1,), "offloading weights"), "offload_params": ((None, set()), "offloading weights"),
    "pooler_config": ((None,), "pooling models"),
    "quantization_config": ((None,), "online quantization schemes (quantization names a method)"),
    "enable_return_routed_experts": ((False,), "returning routed experts"),
    "return_sampling_mask": ((False,), "returning sampling masks"),
    "enable_prompt_embeds": ((False,), "prompt embeddings (prompts are text or token ids)"),
    "worker_extension_cls": (("",), "worker extensions (collective_rpc takes a function instead)"),
    "worker_cls": (("auto",), "worker classes of its own (collective_rpc takes a function instead)"),
    "kv_transfer_config": ((None,), "KV transfer connectors (disaggregated prefill, KV cache offloading)")}


@dataclass
class AsyncEngineArgs(EngineArgs):
    """vLLM's arguments of an AsyncLLM: EngineArgs', and whether it logs each request added and aborted."""

    enable_log_requests: bool = False


def _one_of(name: str, value: Any, alias: str, alias_value: Optional[int], what: str) -> Any:
    """A setting given under pagedllm's ``name`` or vLLM's ``alias`` (a positive integer); both at once is a
    ValueError naming them."""
    if alias_value is None:
        return value
    check_int(alias, alias_value, 1)
    if value is not None:
        raise ValueError(f"{name} and {alias} (vLLM's name) both {what}: give one of them")
    return alias_value


def _cache_sliding_window(model_config: ModelConfig, spec: SpeculativeConfig | None) -> int | None:
    """The window all layers reading the request's blocks keep within: the target's, and a draft model's (which
    reads through the same block table), or None where either has a layer without one."""
    models = [model_config] + ([spec.draft_model_config] if spec is not None and spec.draft_model_config else [])
    return common_window(model.sliding_window for model in models)


def _cache_groups(model_config: ModelConfig) -> tuple[KVCacheGroup, ...]:
    """A hybrid model's KV cache groups (core/kv_cache_groups.py), or none (one block table for every layer). A
    draft model reads through the first group's table, of full-attention layers: every block of the history."""
    groups = kv_cache_groups([layer_sliding_window(model_config.hf_config, i) for i in range(model_config.num_layers)])
    return groups if len(groups) > 1 else ()


def draft_model_config(spec: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
    """The draft model's config, checked against the target's: it must share the target's vocabulary (its drafts
    are the target's token ids) and hold its context, the target's unless speculative_config max_model_len caps it
    (vLLM's checks: at most the draft's positions and the target's max_model_len). Same dtype and settings as the
    target, but enforce_eager where speculative_config sets it."""
    # What the target's model is checked for, the draft's is too (else it fails in the engine process), and the
    # error names the draft: a missing draft must not read as a missing target model.
    try:
        path = resolve_model(spec.model)
        hf_config = load_hf_config(path)
        check_model_config(hf_config)
    except (ValueError, OSError) as e:
        raise ValueError(f"speculative_config model {spec.model!r}: {e}") from None
    if hf_config.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config model {spec.model!r} has a vocabulary of {hf_config.vocab_size} "
                         f"tokens; the target model's has {target.vocab_size}: they must be the same")
    draft_max_len = positions_served(hf_config)
    if spec.max_model_len is not None and spec.max_model_len > target.max_model_len:
        raise ValueError(f"speculative_config max_model_len ({spec.max_model_len}) cannot be larger than the target's "
                         f"max_model_len ({target.max_model_len})")
    max_model_len = spec.max_model_len or target.max_model_len
    if draft_max_len < max_model_len:
        what = "speculative_config max_model_len" if spec.max_model_len else "the target's max_model_len"
        raise ValueError(f"speculative_config model {spec.model!r} holds {draft_max_len} positions "
                         f"(max_position_embeddings), fewer than {what} ({max_model_len})")
    set_quantization(hf_config, spec.quantization, path)
    enforce_eager = target.enforce_eager if spec.enforce_eager is None else spec.enforce_eager
    return ModelConfig(spec.model, path, hf_config, target.dtype, max_model_len, target.seed,
                       spec.quantization, enforce_eager, device=target.device,
                       attention_backend=target.attention_backend, load_format=target.load_format)


def set_quantization(hf_config, quantization: Optional[str], path: str) -> None:
    """Records ``quantization`` (if any) in ``hf_config``, where get_model reads it as from a checkpoint that ships a
    quantization_config; a value that does not fit the model fails here, naming `quantization`, not in the engine
    process. A quantized checkpoint runs its own scheme, which ``quantization`` may name (as vLLM lets
    ``--quantization compressed-tensors`` name a compressed-tensors checkpoint's) but not replace."""
    checkpoint_config = getattr(hf_config, "quantization_config", None)
    if checkpoint_config:
        method = checkpoint_config.get("quant_method")
        if quantization not in (None, method):
            raise ValueError(f"quantization={quantization!r}: the checkpoint is already quantized ({method!r}); "
                             f"leave quantization unset or give {method!r}")
        # a checkpoint's own scheme we cannot run fails here, before any process starts
        get_quant_config(method, path, get_model_architecture(hf_config), checkpoint_config)
        if checkpoint_config.get("kv_cache_scheme"):
            check_kv_cache_scheme(checkpoint_config["kv_cache_scheme"])
    elif quantization is not None:
        get_quant_config(quantization, path, get_model_architecture(hf_config))
        hf_config.quantization_config = {"quant_method": quantization}


def check_kv_cache_scheme(scheme: dict) -> None:
    """A compressed-tensors checkpoint's kv_cache_scheme, as vLLM's validate_kv_cache_scheme takes it: an fp8 KV cache
    (8-bit float), symmetric, a layer's k_scale and v_scale per tensor (strategy "tensor") or per KV head
    ("attn_head"); anything else is a config error naming it."""
    if scheme.get("type") != "float" or scheme.get("num_bits") != 8:
        raise ValueError(f"The checkpoint's kv_cache_scheme (num_bits={scheme.get('num_bits')!r}, type="
                         f"{scheme.get('type')!r}) is not supported: only num_bits=8, type='float' (an fp8 KV cache)")
    if scheme.get("strategy") not in ("tensor", "attn_head"):
        raise ValueError(f"The checkpoint's kv_cache_scheme strategy {scheme.get('strategy')!r} is not supported: "
                         "only 'tensor' (one k_scale and v_scale a layer) and 'attn_head' (one a KV head)")
    if not scheme.get("symmetric"):
        raise ValueError("The checkpoint's kv_cache_scheme is asymmetric: only symmetric scales are supported")


def resolve_kv_cache_dtype(kv_cache_dtype: str, hf_config, attention_backend: str) -> str:
    """The cache's dtype for ``kv_cache_dtype``, as vLLM resolves it: a checkpoint that declares a kv_cache_scheme (its
    k_scale and v_scale are an fp8 cache's) makes "auto" "fp8", where the attention backend has an fp8 cache
    (TRITON_ATTN has none: its cache stays the model's dtype, the scales unused); a choice given wins, but
    fp8_e5m2, which vLLM refuses with such a checkpoint (its scales are e4m3's)."""
    if not (getattr(hf_config, "quantization_config", None) or {}).get("kv_cache_scheme"):
        return kv_cache_dtype
    if kv_cache_dtype == "fp8_e5m2":
        raise ValueError("kv_cache_dtype='fp8_e5m2' is not supported with the checkpoint's kv_cache_scheme (fp8 "
                         "e4m3 scales): leave it 'auto' or give 'fp8'")
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    if attention_backend == "TRITON_ATTN":
        logger.warning("The checkpoint's kv_cache_scheme (an fp8 KV cache) is not applied: the TRITON_ATTN attention "
                       "backend keeps the cache in the model's dtype")
        return kv_cache_dtype
    return "fp8"


def pp_layer_partition_from_env() -> Optional[list[int]]:
    """PAGEDLLM_PP_LAYER_PARTITION="10,20": layers per pipeline stage (vLLM's VLLM_PP_LAYER_PARTITION)."""
    value = os.environ.get("PAGEDLLM_PP_LAYER_PARTITION")
    if not value:
        return None
    try:
        return [int(part) for part in value.split(",")]
    except ValueError:
        raise ValueError(f"PAGEDLLM_PP_LAYER_PARTITION must be comma-separated layer counts, got {value!r}") from None


def resolve_executor_backend(parallel_config: ParallelConfig) -> str:
    """uni for one rank, ray inside an initialised Ray cluster, else mp; asking for ray needs Ray installed."""
    backend = parallel_config.distributed_executor_backend
    if backend == "ray" or backend is None and parallel_config.world_size > 1 and _ray_initialized():
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ValueError("distributed_executor_backend='ray' needs Ray: pip install 'pagedllm[ray]'") from None
        return "ray"
    if backend is None:
        return "uni" if parallel_config.world_size == 1 else "mp"
    return backend


def _ray_initialized() -> bool:
    ray = sys.modules.get("ray")  # a cluster the caller joined; never import Ray just to ask
    return ray is not None and ray.is_initialized()
