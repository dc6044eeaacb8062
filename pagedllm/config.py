"""Engine configuration, validated where it is built so a bad value fails with its name."""
from __future__ import annotations

import os
import re
import types
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from pagedllm.core.kv_cache_groups import KVCacheGroup
from pagedllm.core.sched.request_queue import SchedulingPolicy
from pagedllm.models.generation_config import diff_sampling_param
from pagedllm.reasoning import get_reasoning_parser
from pagedllm.sample.logprobs import LOGPROBS_MODES


# vLLM's kv_cache_dtype choices (what each stores: kv_cache_dtype.py), and int8.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
# When the KV cache's memory is faulted in (platforms/populate.py): by a background thread while the engine is
# idle, or before the engine takes requests (as vLLM, which zeroes its cache at start-up).
KV_CACHE_POPULATE = ("background", "startup")
# `pagedllm serve`'s max_prefill_tokens_with_decodes: a step that decodes takes at most this many prompt tokens, so
# that under load the steps that prefill are not many times longer than those that only decode (an inter-token
# latency p99 within ~3x its p50): prompts go in more, smaller chunks, spreading their work over more steps, which
# raises the p50 somewhat. docs/benchmarks.md has the measurements it was chosen by.
SERVE_MAX_PREFILL_TOKENS_WITH_DECODES = 192


# vLLM's --device: where the engine runs (platforms.resolve_platform): auto is CUDA where torch sees a GPU, else the
# CPU.
DEVICES = ("auto", "cpu", "cuda")


def check_kv_cache_dtype(cache_dtype: str) -> None:
    if cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {cache_dtype!r}")


def head_dim(hf_config) -> int:
    """Per-head size: explicit in newer configs, else hidden_size split evenly over the attention heads."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def common_window(windows: Iterable[int | None]) -> int | None:
    """The window a set of layers all keep within: the largest of theirs, or None where one has none."""
    windows = list(windows)
    return None if None in windows else max(windows)


def layer_sliding_window(hf_config, layer_index: int) -> int | None:
    """The sliding window of layer ``layer_index``'s attention (each query sees its last that many positions), or
    None for full attention, as transformers decides it: configs with ``layer_types`` (Qwen2, Qwen3, Qwen2-MoE,
    whose ``use_sliding_window`` and ``max_window_layers`` fill it) window their "sliding_attention" layers; others
    (Mistral, Mixtral, Qwen3-MoE) window every layer by ``sliding_window``. A window of 0 (Qwen2-MoE's "off") or None
    is none."""
    window = getattr(hf_config, "sliding_window", None) or None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and layer_types[layer_index] != "sliding_attention":
        return None
    return window


@dataclass
class SchedulerConfig:
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # Caps one request's share of a step's budget so a long prompt cannot starve decodes (0: no cap); not applied
    # while the request is the only one (vLLM's), as there is nothing to starve.
    long_prefill_token_threshold: int = 0
    # Prompt tokens a step may take while it also decodes (0: no cap beyond max_num_batched_tokens): bounds how
    # long a running request waits for its next token behind other requests' prefills (Sarathi-Serve's stall-free
    # batching); a step with no decodes still takes max_num_batched_tokens. A request resumed from preemption counts
    # the outputs it computes again as prompt tokens. Needs chunked prefill (without it a prompt goes whole or not at
    # all).
    max_prefill_tokens_with_decodes: int = 0
    policy: SchedulingPolicy = SchedulingPolicy.FCFS
    # vLLM's: a waiting request is admitted only when the free blocks hold its whole prompt (and, resumed, its outputs)
    # past its prefix hit, not just its first chunk; requests admitted on their first chunks would run out of blocks
    # mid-prompt and preempt each other, the chunks they computed wasted.
    scheduler_reserve_full_isl: bool = True
    # vLLM's: a running request's DELTA outputs go out every this many tokens at least (1: every token; a request may
    # ask for more, SamplingParams.stream_interval). The frontend's work per token shrinks by as much.
    stream_interval: int = 1

    def __post_init__(self) -> None:
        try:
            self.policy = SchedulingPolicy(self.policy)
        except ValueError:
            raise ValueError(f"scheduling_policy must be one of {', '.join(p.value for p in SchedulingPolicy)}, "
                             f"got {self.policy!r}") from None
        check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        check_bool("scheduler_reserve_full_isl", self.scheduler_reserve_full_isl)
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "stream_interval"):
            check_int(name, getattr(self, name), 1)
        for name in ("long_prefill_token_threshold", "max_prefill_tokens_with_decodes"):
            check_int(name, getattr(self, name), 0)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                             f"max_model_len ({self.max_model_len}) when chunked prefill is disabled")
        # vLLM's verify_max_model_len: a step holds at least a token of every running request, and a long prompt's
        # cap lies within a prompt.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be greater than or equal "
                             f"to max_num_seqs ({self.max_num_seqs}).")
        if self.long_prefill_token_threshold > self.max_model_len:
            raise ValueError(f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) cannot be greater "
                             f"than the max_model_len ({self.max_model_len}).")


@dataclass
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    # Bytes for the KV cache (int or "2GiB"-style string); None picks a default from available memory.
    kv_cache_memory: Optional[int | str] = None
    # Set once the KV cache is sized (or directly, in tests without a model).
    num_blocks: Optional[int] = None
    # The sliding window every attention layer reading the cache keeps within (the largest, where they differ), from
    # the models (EngineArgs sets it); None where some layer attends to everything. With it the KV cache manager
    # frees a request's blocks that fell out of every window (vLLM's SlidingWindowManager).
    sliding_window: Optional[int] = None
    # A hybrid model's KV cache groups (core/kv_cache_groups.py: its full-attention and sliding-window layers in groups
    # of their own, each read through a block table of its own), from the model (EngineArgs sets them); empty where
    # every layer reads through one block table (with sliding_window).
    kv_cache_groups: tuple[KVCacheGroup, ...] = ()
    # The cache's element type (vLLM's kv_cache_dtype; kv_cache_dtype.py): "auto" is the model's.
    cache_dtype: str = "auto"
    kv_cache_populate: str = "background"  # one of KV_CACHE_POPULATE
    # On a GPU: the share of its memory the engine may take, weights, activations and KV cache together (vLLM's;
    # platforms/cuda.kv_cache_memory_from_profile). The CPU's cache is sized by kv_cache_memory or its default.
    # vLLM 0.32's default (CacheConfig's), EngineArgs' and --gpu-memory-utilization's too.
    gpu_memory_utilization: float = 0.92

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        """Each KV cache group's sliding window; where there is one group, sliding_window."""
        return tuple(group.sliding_window for group in self.kv_cache_groups) or (self.sliding_window,)

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size, 1)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        if self.num_blocks is not None:
            check_int("num_kv_blocks", self.num_blocks, 1)
        if self.kv_cache_memory is not None:
            parse_memory_size(self.kv_cache_memory)  # a bad size fails here, before any process starts
        utilization = self.gpu_memory_utilization
        if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {utilization!r}")
        check_kv_cache_dtype(self.cache_dtype)
        if self.kv_cache_populate not in KV_CACHE_POPULATE:
            raise ValueError(f"kv_cache_populate must be one of {', '.join(KV_CACHE_POPULATE)}; "
                             f"got {self.kv_cache_populate!r}")


# vLLM 0.32's CompilationConfig fields (compilation_config={...}, --compilation-config): taken so that vLLM code and
# command lines run here, an unknown one an error as in vLLM. CPU graphs (worker/cpu_graphs.py) stand in for CUDA
# graphs: cudagraph_mode NONE turns them off as enforce_eager does. torch.compile's settings and the capture sizes,
# which vLLM's CPU backend drops too, change nothing here.
COMPILATION_CONFIG_FIELDS = frozenset((
    "mode", "debug_dump_path", "cache_dir", "compile_cache_save_format", "backend", "custom_ops",
    "ir_enable_torch_wrap", "splitting_ops", "compile_mm_encoder", "cudagraph_mm_encoder",
    "encoder_cudagraph_token_budgets", "encoder_cudagraph_max_vision_items_per_batch",
    "encoder_cudagraph_max_frames_per_batch", "cudagraph_decoder_replay", "decoder_replay_cudagraph_capture_sizes",
    "decoder_replay_trim_threshold", "compile_sizes", "compile_ranges_endpoints", "inductor_compile_config",
    "inductor_passes", "cudagraph_mode", "cudagraph_num_of_warmups", "cudagraph_capture_sizes",
    "cudagraph_copy_inputs", "cudagraph_specialize_lora", "use_inductor_graph_partition", "pass_config",
    "max_cudagraph_capture_size", "dynamic_shapes_config", "fast_moe_cold_start"))
COMPILATION_MODES = ("NONE", "STOCK_TORCH_COMPILE", "DYNAMO_TRACE_ONCE", "VLLM_COMPILE")  # vLLM's, 0 .. 3
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


def graphs_turned_off(compilation_config, optimization_level: int = 2) -> bool:
    """Whether vLLM's ``compilation_config`` (None, a mode 0-3, or a dict of CompilationConfig fields) and
    ``optimization_level`` (0-3, vLLM's -O) ask for no graphs: cudagraph_mode NONE, which the level's defaults set at
    0 (vLLM's OPTIMIZATION_LEVEL_00) where the config leaves it. A ValueError naming the field for what vLLM refuses
    (an unknown field, mode, cudagraph_mode or level; names case-insensitive as vLLM's)."""
    if type(optimization_level) is not int or optimization_level not in range(4):  # 2.0 and True are not levels
        raise ValueError(f"optimization_level must be 0, 1, 2 or 3, got {optimization_level!r}")
    if compilation_config is None:
        mode = cudagraph_mode = None
    elif isinstance(compilation_config, dict):
        unknown = sorted(set(compilation_config) - COMPILATION_CONFIG_FIELDS)
        if unknown:
            raise ValueError(f"compilation_config has no field {', '.join(map(repr, unknown))}")
        mode, cudagraph_mode = compilation_config.get("mode"), compilation_config.get("cudagraph_mode")
    else:
        mode, cudagraph_mode = compilation_config, None
    if cudagraph_mode is None and optimization_level == 0:
        cudagraph_mode = "NONE"
    if mode is not None and not (isinstance(mode, str) and mode.upper() in COMPILATION_MODES) and not (
            isinstance(mode, int) and not isinstance(mode, bool) and 0 <= mode < len(COMPILATION_MODES)):
        raise ValueError(f"compilation_config mode must be 0-3 or one of {', '.join(COMPILATION_MODES)}; "
                         f"got {mode!r}")
    if cudagraph_mode is not None and not (isinstance(cudagraph_mode, str)
                                           and cudagraph_mode.upper() in CUDAGRAPH_MODES):
        raise ValueError(f"compilation_config cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}; got "
                         f"{cudagraph_mode!r}")
    return cudagraph_mode is not None and cudagraph_mode.upper() == "NONE"


def check_capture_size_shortcuts(compilation_config, cudagraph_capture_sizes, max_cudagraph_capture_size) -> None:
    """vLLM's EngineArgs shortcuts for two compilation_config fields: each a ValueError where the field is given too
    (vLLM's message), or where it is not positive integers (the sizes a list of them)."""
    fields = compilation_config if isinstance(compilation_config, dict) else {}
    for name, value in (("cudagraph_capture_sizes", cudagraph_capture_sizes),
                        ("max_cudagraph_capture_size", max_cudagraph_capture_size)):
        if value is None:
            continue
        if name in fields:
            raise ValueError(f"{name} and compilation_config.{name} are mutually exclusive")
        if name == "max_cudagraph_capture_size":
            check_int(name, value, 1)
        elif not isinstance(value, list) or not value:
            raise ValueError(f"{name} must be a list of positive integers, got {value!r}")
        else:
            for size in value:
                check_int(name, size, 1)


def check_optional_dict(name: str, value) -> None:
    """A ValueError naming the argument unless ``value`` is a dict or None (keyword arguments handed on, such as
    tokenization_kwargs), before it is spread into a call that would fail with a TypeError naming nothing."""
    if not isinstance(value, (dict, type(None))):
        raise ValueError(f"{name} must be a dict, got {value!r}.")


def check_bool(name: str, value) -> None:
    """A ValueError naming the field unless ``value`` is True or False: a string such as "false" is truthy, and would
    turn on what it meant to turn off."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def check_int(name: str, value, lowest: int) -> None:
    """A ValueError naming the field unless ``value`` is an integer (not a bool, not a float such as 16.0) of at
    least ``lowest``: a float or string would otherwise pass the config and fail in the engine process."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < lowest:
        raise ValueError(f"{name} must be at least {lowest}, got {value}")


_MEMORY_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2,
                 "mib": 1 << 20, "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4,
                 "tib": 1 << 40}


def parse_memory_size(value: int | str) -> int:
    """Bytes from an int or a string such as "2GiB", "512MiB", "1.5GB"."""
    if isinstance(value, int):
        size = value
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not match or match.group(2).lower() not in _MEMORY_UNITS:
            raise ValueError(f"kv_cache_memory must be a byte count or a size like '2GiB', got {value!r}")
        size = int(float(match.group(1)) * _MEMORY_UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError(f"kv_cache_memory must be positive, got {value!r}")
    return size


class HFConfigValues(types.SimpleNamespace):
    """A transformers config's values without its class: what the engine and worker processes get as
    ``ModelConfig.hf_config`` (ModelConfig pickles it so). Unpickling transformers' own class would import
    transformers there, which is most of a process's start-up, for values the engine only reads as attributes
    (``getattr`` with a default for the optional ones), which this copy answers alike: every attribute the config
    holds, its class's ``model_type``, and the aliases of its ``attribute_map``."""

    @classmethod
    def of(cls, hf_config) -> "HFConfigValues":
        if isinstance(hf_config, cls):
            return hf_config
        values = dict(vars(hf_config))
        values["model_type"] = getattr(hf_config, "model_type", None)
        for alias, name in getattr(type(hf_config), "attribute_map", {}).items():
            values.setdefault(alias, values.get(name))
        return cls(**values)


@dataclass
class ModelConfig:
    """The model: where it lives, its HF config, its dtype (also its KV cache's; the activations' dtype is the
    engine's platforms/cpu.KernelChoice), and the context length we serve."""

    model: str
    path: str
    hf_config: object
    dtype: object  # torch.dtype
    max_model_len: int
    seed: int = 0
    # Weight quantization ("gguf": GGUF Q4_0/Q4_1, Q8_0, Q2_K-Q6_K, IQ4_NL/XS weights kept packed where a kernel takes
    # them; "gguf_int4": the Q4_0/Q4_1/Q4_K ones only; "int8": W8A8, any checkpoint); None computes with dense weights.
    quantization: Optional[str] = None
    # Run every step eagerly: no CPU graphs for decode steps (worker/cpu_graphs.py), as vLLM's flag turns off
    # CUDA graphs.
    enforce_eager: bool = False
    # The most logprobs (and prompt_logprobs) a request may ask for, vLLM's max_logprobs (-1: the vocabulary).
    max_logprobs: int = 20
    # The tokenizer's directory: the model's own (path) unless vLLM's tokenizer argument names another.
    tokenizer: Optional[str] = None
    # Where default sampling parameters come from (vLLM's --generation-config): "auto" (the model directory's
    # generation_config.json), "vllm" (none: the engine's own defaults) or a directory holding that file.
    generation_config: str = "auto"
    # The platform's device type ("cpu" or "cuda", resolved from EngineArgs.device) and the attention backend its
    # layers run (AttentionBackend.get_name(), one the platform offers).
    device: str = "cpu"
    attention_backend: str = "TORCH_SDPA"
    # vLLM's override_generation_config: generation config fields over the file's (alone with "vllm").
    override_generation_config: Optional[dict] = None
    # What logprobs report (vLLM's logprobs_mode, sample/logprobs.LogprobsMode): the raw logits' log-softmax by default.
    logprobs_mode: str = "raw_logprobs"
    # vLLM's max_model_len -1: once the KV cache is sized, the engine lowers max_model_len to the longest request
    # the cache holds (EngineCore, fit_max_model_len), where that is shorter than the model's.
    auto_fit_max_model_len: bool = False
    # vLLM's load_format: which of an HF directory's weight files load (models/weights.WEIGHT_FILES).
    load_format: str = "auto"
    # vLLM's skip_tokenizer_init: no tokenizer is loaded; prompts are token ids, outputs have no text.
    skip_tokenizer_init: bool = False

    def __post_init__(self) -> None:
        """seed is an integer, max_logprobs one of at least -1 and logprobs_mode one of vLLM's (vLLM's ModelConfig
        fields): else the seed would fail in the engine process (torch.manual_seed) and a bad max_logprobs would refuse
        every request for logprobs."""
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        check_int("max_logprobs", self.max_logprobs, -1)
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if self.tokenizer is None:
            self.tokenizer = self.path

    def __getstate__(self) -> dict:
        return {**vars(self), "hf_config": HFConfigValues.of(self.hf_config)}

    def get_diff_sampling_param(self) -> dict:
        """The sampling parameters the generation config sets (SamplingParams names); a request's own values win
        over them, and they win over SamplingParams' defaults."""
        return diff_sampling_param(self.path, self.generation_config, self.override_generation_config)

    @property
    def sliding_window(self) -> int | None:
        """The largest of the layers' sliding windows when every layer has one, else None (some layer reads the
        whole history)."""
        return common_window(layer_sliding_window(self.hf_config, i) for i in range(self.num_layers))

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.hf_config, "num_key_value_heads", None) or self.hf_config.num_attention_heads

    @property
    def head_dim(self) -> int:
        return head_dim(self.hf_config)

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def runner_type(self) -> str:
        """vLLM's: the runner the model runs under. Every model here generates: EngineArgs refuses vLLM's pooling
        runner and its conversions to one (runner, convert)."""
        return "generate"


DISTRIBUTED_EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass
class ParallelConfig:
    """How one engine's model is split over ranks (tensor x pipeline), and how many engines share the load (data
    parallel). Global rank = pp_rank * tensor_parallel_size + tp_rank, as vLLM lays its groups out."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    # uni | mp | ray; None picks one (uni for one rank, ray inside an initialised Ray cluster, else mp).
    distributed_executor_backend: Optional[str] = None
    # Layers per pipeline stage, one entry per stage; None splits evenly (the last stages take the remainder).
    pp_layer_partition: Optional[list[int]] = None
    # The Ray cluster the ray executor joins (set from the caller's, when it had joined one).
    ray_address: Optional[str] = None
    # Which of the data-parallel engines this one is (set per engine process by the frontend).
    data_parallel_rank: int = 0
    # torch.distributed backend: the platform's (gloo on the CPU, nccl on CUDA).
    torch_distributed_backend: str = "gloo"
    # Mixture-of-experts layers split whole experts over the TP ranks instead of every expert's intermediate size.
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}"
                             f", got {backend!r}")
        if backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one rank; tensor_parallel_size x "
                             f"pipeline_parallel_size is {self.world_size} (use 'mp' or 'ray')")

    @property
    def world_size(self) -> int:
        """Ranks of one engine (each data-parallel engine has its own)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def verify_with_model(self, hf_config) -> None:
        """A split the model cannot take fails here, naming the field and the model's numbers."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        heads = hf_config.num_attention_heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        layers = hf_config.num_hidden_layers
        if heads % tp:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide the model's number of attention heads "
                             f"({heads})")
        if kv_heads % tp and tp % kv_heads:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide the model's number of KV heads ({kv_heads}) "
                             f"or be a multiple of it")
        if pp > layers:
            raise ValueError(f"pipeline_parallel_size ({pp}) is larger than the model's number of layers "
                             f"({layers})")
        intermediate = getattr(hf_config, "intermediate_size", 0)
        if intermediate % tp:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide the model's intermediate_size "
                             f"({intermediate})")
        self._verify_experts(hf_config)
        if self.pp_layer_partition is not None:
            partition = self.pp_layer_partition
            if len(partition) != pp or sum(partition) != layers or min(partition) < 1:
                raise ValueError(f"pp_layer_partition {partition} must give each of the {pp} pipeline stages at "
                                 f"least one layer and sum to the model's {layers} layers")

    def _verify_experts(self, hf_config) -> None:
        """A mixture of experts splits over the TP ranks by experts (expert parallel) or by each expert's
        intermediate size; either must divide evenly."""
        tp = self.tensor_parallel_size
        num_experts = getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None) or 0
        shared = getattr(hf_config, "shared_expert_intermediate_size", 0) or 0  # a dense MLP, split as one
        if shared % tp:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide the model's shared_expert_intermediate_size "
                             f"({shared})")
        if self.enable_expert_parallel:
            if not num_experts:
                raise ValueError("enable_expert_parallel needs a mixture-of-experts model; this one has no experts")
            if num_experts % tp:
                raise ValueError(f"tensor_parallel_size ({tp}) must divide the model's number of experts "
                                 f"({num_experts}) with enable_expert_parallel")
            return
        expert_intermediate = getattr(hf_config, "moe_intermediate_size", 0) if num_experts else 0
        if expert_intermediate % tp:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide the model's moe_intermediate_size "
                             f"({expert_intermediate}), or set enable_expert_parallel")

    def stage_layers(self, pp_rank: int, num_layers: int) -> tuple[int, int]:
        """The [start, end) layers of pipeline stage ``pp_rank``."""
        sizes = self.pp_layer_partition
        if sizes is None:
            pp = self.pipeline_parallel_size
            base, extra = divmod(num_layers, pp)
            sizes = [base + (1 if stage >= pp - extra else 0) for stage in range(pp)]
        start = sum(sizes[:pp_rank])
        return start, start + sizes[pp_rank]


SPECULATIVE_METHODS = ("ngram", "draft_model", "suffix")
_NGRAM_NAMES = ("ngram", "[ngram]")  # vLLM's model names meaning method ngram
# vLLM's other speculative_config keys, with their defaults: what they ask for is taken at the default (greedy drafts
# and standard rejection sampling are what happens here; None leaves the target's setting), refused otherwise.
_VLLM_DEFAULT_ONLY_KEYS = {
    "draft_sample_method": "greedy", "rejection_sample_method": "standard", "revision": None, "code_revision": None,
    "moe_backend": None, "attention_backend": None, "kv_cache_dtype": None, "draft_load_config": None,
    "index_share_for_mtp_iteration": None, "disable_padded_drafter_batch": False, "disable_eagle_block_drop": False,
    "use_local_argmax_reduction": False, "use_heterogeneous_vocab": False, "parallel_drafting": False,
    "num_speculative_tokens_per_batch_size": None, "synthetic_acceptance_rates": None,
    "synthetic_acceptance_length": None, "enable_adaptive_verification": False, "dspark_draft_topk": None}


def _config_dict(name: str, values) -> dict:
    """The keys and values of a setting given as a dict (``LLM(name={...})``, ``--name '<json>'``), each key's dashes
    as underscores (vLLM's, as a --config file may spell them); a ValueError unless it is a dict."""
    if not isinstance(values, dict):
        raise ValueError(f"{name} must be a dict, got {type(values).__name__}")
    return {key.replace("-", "_") if isinstance(key, str) else key: value for key, value in values.items()}


def _refuse_unknown_keys(name: str, values: dict, known: set[str]) -> None:
    unknown = sorted(set(values) - known, key=str)
    if unknown:
        raise ValueError(f"{name} has unknown keys {unknown}; known: {sorted(known)}")


def _check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"speculative_config {name} must be a positive integer, got {value!r}")


MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's MaxLoRARanks: the values max_lora_rank may take


@dataclass
class LoRAConfig:
    """Multi-LoRA serving, as vLLM's ``enable_lora`` and its limits: at most ``max_loras`` adapters in one step
    (each has a slot in every LoRA'd layer), of rank up to ``max_lora_rank`` (one of MAX_LORA_RANKS); the worker
    keeps up to ``max_cpu_loras`` adapters loaded (default: max_loras)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None

    def __post_init__(self) -> None:
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_lora_rank not in MAX_LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {', '.join(map(str, MAX_LORA_RANKS))}, got "
                             f"{self.max_lora_rank}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")


@dataclass
class SpeculativeConfig:
    """Speculative decoding, as vLLM's ``speculative_config``: each step a proposer drafts up to
    ``num_speculative_tokens`` tokens per request, and one forward of the target model verifies them all.

    - ``ngram`` (prompt lookup) proposes what followed the longest of the request's last ``prompt_lookup_min`` ..
      ``prompt_lookup_max`` tokens found earlier in its own tokens; either bound alone sets both, neither gives 5
      and 5, as vLLM. vLLM's older spellings name it too: ``model: "ngram"`` (or ``"[ngram]"``) without
      ``method``, and ``method: "[ngram]"``.
    - ``draft_model``: ``model`` (a path, an alias, or the target's own GGUF file with ``quantization:
      "gguf_int4"``) proposes greedily, one token after another, with its own paged KV cache. Giving ``model``
      without ``method`` means this one, as in vLLM; giving neither is an error, as in vLLM (which then has a
      draft model without a model), not some default method.
    - ``suffix`` (suffix decoding): suffix trees over the request's own tokens and over recent requests' outputs
      propose up to ``suffix_decoding_max_tree_depth`` tokens, as many as ``suffix_decoding_max_spec_factor``
      times the length of the match that finds them, each at least ``suffix_decoding_min_token_prob`` likely by
      the trees' counts; ``num_speculative_tokens`` defaults to the tree depth.

    ``max_model_len`` (vLLM's): no request drafts past this many tokens; a draft model computes only positions below
    it, so it may hold fewer than the target's (EngineArgs checks it against both, as vLLM). ``enforce_eager``
    (vLLM's): the draft model's own, None the target's.

    ``draft_model_config`` (the draft's ModelConfig) is filled in by EngineArgs once the draft is checked against
    the target."""

    method: Optional[str] = None
    num_speculative_tokens: Optional[int] = None
    prompt_lookup_min: Optional[int] = None
    prompt_lookup_max: Optional[int] = None
    model: Optional[str] = None
    quantization: Optional[str] = None
    # vLLM's: the draft model's tensor parallel size, 1 or the target's (EngineArgs checks it; the draft runs on one
    # rank here, so 1). The other methods have no draft model and ignore it, as vLLM does.
    draft_tensor_parallel_size: Optional[int] = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    max_model_len: Optional[int] = None
    enforce_eager: Optional[bool] = None
    draft_model_config: Optional[ModelConfig] = None

    def __post_init__(self) -> None:
        # vLLM's SpeculativeConfig.__post_init__: the method follows from the model where not given.
        if self.method is None:
            if self.model is None:
                raise ValueError("speculative_config needs a method, or a model (method 'draft_model')")
            self.method = "ngram" if self.model in _NGRAM_NAMES else "draft_model"
        if self.method in _NGRAM_NAMES:
            self.method = "ngram"
            if self.model in _NGRAM_NAMES:  # vLLM's model of the ngram method: no model
                self.model = None
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(SPECULATIVE_METHODS)}, got "
                             f"{self.method!r}")
        if self.method == "suffix":
            self._check_suffix_parameters()
            if self.num_speculative_tokens is None:
                self.num_speculative_tokens = self.suffix_decoding_max_tree_depth
        if self.num_speculative_tokens is None:
            raise ValueError("speculative_config needs num_speculative_tokens")
        # vLLM's fields take only positive integers whatever the method, also where the method ignores them.
        for name in ("num_speculative_tokens", "draft_tensor_parallel_size", "prompt_lookup_min", "prompt_lookup_max",
                     "max_model_len"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        if self.enforce_eager is not None:
            check_bool("speculative_config enforce_eager", self.enforce_eager)
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config model must be a string (a path or an alias), got {self.model!r}")
        if self.method == "draft_model" and self.model is None:
            raise ValueError("speculative_config method 'draft_model' needs model (a path, an alias or a .gguf file)")
        if self.method != "draft_model" and (self.model is not None or self.quantization is not None):
            raise ValueError(f"speculative_config model and quantization are for method 'draft_model', not "
                             f"{self.method!r}")
        if self.method == "ngram":
            self._resolve_lookup_bounds()

    def _resolve_lookup_bounds(self) -> None:
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    def _check_suffix_parameters(self) -> None:
        _check_positive_int("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth)
        # 0 cached requests is vLLM's "no global tree" (own tokens still draft); a factor of 0 drafts nothing.
        cached = self.suffix_decoding_max_cached_requests
        if isinstance(cached, bool) or not isinstance(cached, int) or cached < 0:
            raise ValueError(f"speculative_config suffix_decoding_max_cached_requests must be a non-negative "
                             f"integer, got {cached!r}")
        factor = self.suffix_decoding_max_spec_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 0:
            raise ValueError(f"speculative_config suffix_decoding_max_spec_factor must be a non-negative number, "
                             f"got {factor!r}")
        prob = self.suffix_decoding_min_token_prob
        if isinstance(prob, bool) or not isinstance(prob, (int, float)) or not 0 <= prob <= 1:
            raise ValueError(f"speculative_config suffix_decoding_min_token_prob must be in [0, 1], got {prob!r}")

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a request needs past its step's tokens for the proposer's own writes: a draft model computes
        the token sampled after the step and each draft but its last, all in the request's blocks."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    @classmethod
    def from_dict(cls, values: dict) -> "SpeculativeConfig":
        """``LLM(speculative_config={...})`` / ``--speculative-config '<json>'``: unknown keys are errors; a key's
        dashes are underscores (vLLM's create_speculative_config), as a --config file may spell them."""
        values = _config_dict("speculative_config", values)
        if "tensor_parallel_size" in values:  # vLLM's own error for it
            raise ValueError("'tensor_parallel_size' is not a valid argument in the speculative_config. Please pass "
                             "'draft_tensor_parallel_size' instead.")
        for key, default in _VLLM_DEFAULT_ONLY_KEYS.items():
            if key in values and values.pop(key) != default:
                raise ValueError(f"speculative_config {key} (vLLM's) is not supported here; leave it out or "
                                 f"{default!r}")
        _refuse_unknown_keys("speculative_config", values, set(cls.__dataclass_fields__) - {"draft_model_config"})
        return cls(**values)


STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar")  # vLLM's names of the one backend here


@dataclass
class StructuredOutputsConfig:
    """vLLM's structured_outputs_config (--structured-outputs-config): ``backend`` "auto" or "xgrammar", both the
    xgrammar backend here; ``disable_any_whitespace``, what a request that does not set it gets (True: compact JSON,
    where vLLM's default is False; see StructuredOutputsParams). vLLM's other fields ask for what this engine does
    not do, and are refused unless left at their defaults: its other backends, disable_additional_properties (its
    guidance backend's), the reasoning parser (the server's --reasoning-parser here) and enable_in_reasoning."""

    backend: str = "auto"
    disable_any_whitespace: bool = True
    disable_additional_properties: bool = False
    reasoning_parser: str = ""
    reasoning_parser_plugin: str = ""
    enable_in_reasoning: bool = False

    def __post_init__(self) -> None:
        if self.backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(f"structured_outputs_config backend must be one of "
                             f"{', '.join(STRUCTURED_OUTPUTS_BACKENDS)} (xgrammar is the one backend here), got "
                             f"{self.backend!r}")
        check_bool("structured_outputs_config disable_any_whitespace", self.disable_any_whitespace)
        unsupported = {"disable_additional_properties": "vLLM's guidance backend's option",
                       "reasoning_parser": "give the server --reasoning-parser",
                       "reasoning_parser_plugin": "reasoning parser plugins are not loaded here",
                       "enable_in_reasoning": "a grammar applies once the reasoning has ended"}
        for name, why in unsupported.items():
            if getattr(self, name) != self.__dataclass_fields__[name].default:
                raise ValueError(f"structured_outputs_config {name}={getattr(self, name)!r} is not supported ({why})")

    @classmethod
    def from_dict(cls, values: dict) -> "StructuredOutputsConfig":
        """``LLM(structured_outputs_config={...})`` / ``--structured-outputs-config '<json>'``: unknown keys are
        errors; a key's dashes are underscores."""
        values = _config_dict("structured_outputs_config", values)
        _refuse_unknown_keys("structured_outputs_config", values, set(cls.__dataclass_fields__))
        return cls(**values)


@dataclass(frozen=True)
class ReasoningConfig:
    """vLLM's reasoning_config (--reasoning-config, a JSON object of reasoning_parser, reasoning_start_str and
    reasoning_end_str; --reasoning-parser names its parser): the token ids a request's thinking_token_budget counts
    and forces by (sample/thinking_budget.py), as the model's tokenizer encodes the strings (one token each in a
    thinking model's vocabulary, several elsewhere). The reasoning starts at the start string and ends at the
    parser's end string (vLLM's natural end); the end string is what a spent budget forces, the parser's unless
    reasoning_end_str says otherwise (a phrase before it, say)."""

    reasoning_parser: str
    reasoning_start_token_ids: tuple[int, ...]
    reasoning_end_token_ids: tuple[int, ...]
    natural_reasoning_end_token_ids: tuple[int, ...]

    @classmethod
    def from_args(cls, values: Optional[dict], reasoning_parser: str, load_tokenizer: Callable[[], Any]
                  ) -> Optional["ReasoningConfig"]:
        """vLLM's _set_default_reasoning_config_args and initialize_token_ids: --reasoning-parser's name over the
        dict's; the parser's strings where the dict gives none. None where neither is given, or where no start or
        end string is known (vLLM's config not enabled, which refuses every budget)."""
        if values is None and not reasoning_parser:
            return None
        values = _config_dict("reasoning_config", values if values is not None else {})
        _refuse_unknown_keys("reasoning_config", values, {"reasoning_parser", "reasoning_start_str",
                                                          "reasoning_end_str"})
        for key, value in values.items():
            if not isinstance(value, str):
                raise ValueError(f"reasoning_config {key} must be a string, got {value!r}")
        name = reasoning_parser or values.get("reasoning_parser", "")
        start, end = values.get("reasoning_start_str", ""), values.get("reasoning_end_str", "")
        natural = end
        if name:
            parser = get_reasoning_parser(name)
            start, end = start or parser.reasoning_start_str, end or parser.reasoning_end_str
            natural = parser.reasoning_end_str
        if not start or not end:
            return None
        tokenizer = load_tokenizer()
        ids = [tuple(tokenizer.encode(text, add_special_tokens=False)) for text in (start, end, natural)]
        if not all(ids):
            raise ValueError(f"ReasoningConfig: failed to tokenize reasoning strings: reasoning_start_str='{start}', "
                             f"reasoning_end_str='{end}'. Ensure the strings are valid tokens in the model's "
                             "vocabulary.")
        return cls(name, *ids)


@dataclass
class ProfilerConfig:
    """vLLM's profiler_config (--profiler-config): ``profiler`` "torch" lets start_profile() / stop_profile() trace
    every worker with torch's profiler, one trace per rank written to ``torch_profiler_dir`` when profiling stops;
    None (the default) leaves profiling off. vLLM's "cuda" and "proton" profilers and its other fields are not
    offered here (an unknown key is an error)."""

    profiler: Optional[str] = None
    torch_profiler_dir: str = ""
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False

    def __post_init__(self) -> None:
        if self.profiler not in (None, "torch"):
            raise ValueError(f"profiler_config profiler must be 'torch' (or None: off), got {self.profiler!r}")
        for name in ("torch_profiler_with_stack", "torch_profiler_with_flops", "torch_profiler_use_gzip",
                     "torch_profiler_record_shapes", "torch_profiler_with_memory"):
            check_bool(f"profiler_config {name}", getattr(self, name))
        if self.torch_profiler_dir and self.profiler != "torch":  # vLLM's checks
            raise ValueError("profiler_config torch_profiler_dir is only applicable when profiler is 'torch'")
        if self.profiler == "torch" and not self.torch_profiler_dir:
            raise ValueError("profiler_config torch_profiler_dir must be set when profiler is 'torch'")
        if self.torch_profiler_dir:
            self.torch_profiler_dir = os.path.abspath(os.path.expanduser(self.torch_profiler_dir))

    @classmethod
    def from_dict(cls, values: dict) -> "ProfilerConfig":
        """``LLM(profiler_config={...})`` / ``--profiler-config '<json>'``: unknown keys are errors; a key's dashes
        are underscores."""
        values = _config_dict("profiler_config", values)
        _refuse_unknown_keys("profiler_config", values, set(cls.__dataclass_fields__))
        return cls(**values)


def check_profile_prefix(prefix: Optional[str]) -> None:
    """start_profile()'s ``profile_prefix``, as vLLM's validate_profile_prefix: it begins the traces' file names."""
    if prefix is not None and not (isinstance(prefix, str) and 1 <= len(prefix) <= 128 and prefix.isascii()
                                   and prefix[0].isalnum() and all(c.isalnum() or c in "._-" for c in prefix[1:])):
        raise ValueError("profile_prefix must be 1-128 ASCII characters, start with a letter or number, and contain "
                         f"only letters, numbers, '.', '_', or '-', got {prefix!r}")


def check_profile_iterations(delay_iterations: Optional[int], max_iterations: Optional[int]) -> None:
    """start_profile()'s vLLM per-session bounds, taken at what this profiler does: None or 0 (no delay, no limit:
    the trace runs from start_profile to stop_profile). A count of steps, which it does not keep, is a ValueError
    naming it, as a negative one is vLLM's."""
    for name, value in (("delay_iterations", delay_iterations), ("max_iterations", max_iterations)):
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be greater than or equal to 0, got {value!r}")
        if value:
            raise ValueError(f"{name}={value}: the profiler traces from start_profile to stop_profile only; leave "
                             f"{name} unset (or 0)")


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    # torch threads of the worker; None keeps torch's default (one per core).
    num_cpu_threads: Optional[int] = None
    speculative_config: Optional[SpeculativeConfig] = None
    lora_config: Optional[LoRAConfig] = None  # None: LoRA not enabled
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    # None: no reasoning config (vLLM's None, or not enabled), and a thinking_token_budget is refused.
    reasoning_config: Optional[ReasoningConfig] = None
    profiler_config: ProfilerConfig = field(default_factory=ProfilerConfig)

    @property
    def max_step_slots(self) -> int:
        """The KV slots one step can give a request, as the scheduler bounds a request's blocks by them: the step's
        token budget and a draft model's lookahead slots past it."""
        spec = self.speculative_config
        return self.scheduler_config.max_num_batched_tokens + (spec.num_lookahead_tokens if spec is not None else 0)
