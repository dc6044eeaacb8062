"""The flags of `pagedllm serve`: the server's own, and the engine's (EngineArgs, with its defaults)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import ssl

from pagedllm.config import (DEVICES, DISTRIBUTED_EXECUTOR_BACKENDS, KV_CACHE_DTYPES, KV_CACHE_POPULATE, MAX_LORA_RANKS,
                             SERVE_MAX_PREFILL_TOKENS_WITH_DECODES, parse_memory_size)
from pagedllm.engine.arg_utils import LOAD_FORMATS, TOKENIZER_MODES, EngineArgs
from pagedllm.layers.attention.selector import ATTENTION_BACKEND_ALIASES, ATTENTION_BACKENDS, attention_backend_name
from pagedllm.layers.quantization import QUANTIZATION_METHODS
from pagedllm.entrypoints.openai.chat_utils import CHAT_TEMPLATE_CONTENT_FORMATS
from pagedllm.entrypoints.openai.tool_calls import ToolParserManager
from pagedllm.reasoning import REASONING_PARSERS
from pagedllm.sample.logprobs import LOGPROBS_MODES
from pagedllm.models.resolve import DEFAULT_MODEL

# Every EngineArgs field but the model (the positional argument) is a --flag of the same name, so the CLI cannot
# fall behind the engine: add_engine_args must define each (tests/server/test_serve_flags.py checks it).
ENGINE_FLAGS = tuple(field.name for field in dataclasses.fields(EngineArgs) if field.name != "model")


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                        help="model alias, Hugging Face model directory or .gguf file (default: %(default)s)")
    add_config_arg(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    server.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    add_serving_args(server)
    server.add_argument("--api-key", nargs="+", default=None,
                        help="require `Authorization: Bearer <key>` on /v1/* requests, with one of these keys "
                             "(default: $PAGEDLLM_API_KEY if set, else none)")
    server.add_argument("--api-server-count", "-asc", type=int, default=None,
                        help="vLLM's count of API server processes: 1 only (default: 1)")
    server.add_argument("--shutdown-timeout", type=int, default=0,
                        help="on SIGTERM or SIGINT, seconds in-flight requests have to finish before they are "
                             "aborted (default: %(default)s, abort at once); new requests get 503 meanwhile")
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])

    add_frontend_args(parser)
    add_engine_args(parser)
    return parser


def human_readable_int(value: str) -> int:
    """vLLM's human_readable_int (--max-model-len, --max-num-batched-tokens): a plain integer, or one with a decimal
    suffix k, m, g, t (10**3 ...; "25.6k" is 25600) or a binary one K, M, G, T (2**10 ...; whole numbers only)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value.strip())
    if match is None:
        return int(value)  # a ValueError argparse reports as an invalid value of the flag
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
    if "." in number:
        raise argparse.ArgumentTypeError(f"decimals are not allowed with binary suffixes like {suffix}; did you mean "
                                         f"{number}{suffix.lower()}?")
    return int(number) << 10 * ("KMGT".index(suffix) + 1)


def human_readable_int_or_auto(value: str) -> int:
    """vLLM's --max-model-len: human_readable_int, or -1 / "auto" (-1: the longest the KV cache holds, up to the
    model's)."""
    return -1 if value.strip().lower() == "auto" else human_readable_int(value)


def _memory_size(value: str) -> str:
    """--kv-cache-memory: bytes, or a size like "2GiB" (config.parse_memory_size), checked as the flags are read."""
    try:
        parse_memory_size(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _attention_backend(value: str) -> str | None:
    """--attention-backend: a backend's name as vLLM reads it (attention_backend_name), checked as the flags are
    read."""
    name = attention_backend_name(value)
    if name is not None and name not in ATTENTION_BACKENDS:
        raise argparse.ArgumentTypeError(f"must be one of auto, {', '.join(ATTENTION_BACKENDS)}, "
                                         f"{', '.join(ATTENTION_BACKEND_ALIASES)}; got {value!r}")
    return name


def add_frontend_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's operational flags of the HTTP server: CORS, TLS, where it listens, and what it logs."""
    http = parser.add_argument_group("HTTP")
    http.add_argument("--allowed-origins", type=_json_list, default=[],
                      help="CORS: the origins allowed, as a JSON list (default: %(default)s: cross-origin browser "
                           "access is off, as in vLLM)")
    http.add_argument("--allowed-methods", type=_json_list, default=["*"],
                      help="CORS: the methods allowed, as a JSON list (default: %(default)s)")
    http.add_argument("--allowed-headers", type=_json_list, default=["*"],
                      help="CORS: the headers allowed, as a JSON list (default: %(default)s)")
    http.add_argument("--allow-credentials", action=argparse.BooleanOptionalAction, default=False,
                      help="CORS: allow credentials (cookies)")
    http.add_argument("--ssl-keyfile", default=None, help="serve HTTPS: the TLS private key file")
    http.add_argument("--ssl-certfile", default=None, help="serve HTTPS: the TLS certificate file")
    http.add_argument("--ssl-ca-certs", default=None,
                      help="HTTPS: the CA certificates file client certificates are verified against")
    http.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE),
                      choices=[int(ssl.CERT_NONE), int(ssl.CERT_OPTIONAL), int(ssl.CERT_REQUIRED)],
                      help="HTTPS: whether a client certificate is required, as the ssl module's constants: 0 "
                           "CERT_NONE (not asked for), 1 CERT_OPTIONAL (verified if sent), 2 CERT_REQUIRED "
                           "(default: %(default)s)")
    http.add_argument("--root-path", default=None,
                      help="the path prefix a reverse proxy serves this server under (FastAPI's root_path)")
    http.add_argument("--uds", default=None, help="listen on this Unix domain socket instead of --host/--port")
    http.add_argument("--disable-uvicorn-access-log", action=argparse.BooleanOptionalAction, default=False,
                      help="no log line per HTTP request")
    http.add_argument("--disable-access-log-for-endpoints", default=None,
                      help="no log line for requests to these comma-separated paths, e.g. /health,/metrics")
    http.add_argument("--enable-request-id-headers", action=argparse.BooleanOptionalAction, default=False,
                      help="every response carries an X-Request-Id header: the request's own, else a random one")
    http.add_argument("--enable-force-include-usage", action=argparse.BooleanOptionalAction, default=False,
                      help="every stream's last chunk carries its usage, as if the request's stream_options asked")
    http.add_argument("--return-tokens-as-token-ids", action=argparse.BooleanOptionalAction, default=False,
                      help="logprobs name each token \"token_id:<id>\" (a request's return_tokens_as_token_ids wins)")
    http.add_argument("--disable-fastapi-docs", action=argparse.BooleanOptionalAction, default=False,
                      help="serve no OpenAPI document (/openapi.json), Swagger UI (/docs) or ReDoc (/redoc)")
    http.add_argument("--disable-web-ui", action="store_true",
                      help="serve no web page at / (chat and live engine view) and no /engine/view")
    requests = parser.add_argument_group("requests")
    requests.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                          help="log each request's id, prompt and sampling parameters as it arrives")
    requests.add_argument("--enable-log-outputs", action=argparse.BooleanOptionalAction, default=False,
                          help="with --enable-log-requests, log each choice's text, token ids and finish reason as "
                               "its request ends")
    requests.add_argument("--max-log-len", type=int, default=None,
                          help="logged prompts keep this many characters, and token ids (default: all)")
    requests.add_argument("--response-role", default="assistant",
                          help="the role of chat completion messages (default: %(default)s)")
    requests.add_argument("--enable-server-load-tracking", action=argparse.BooleanOptionalAction, default=False,
                          help="GET /load counts the chat, completion and Responses requests in flight (else 0)")


def validate_parsed_serve_args(args: argparse.Namespace) -> None:
    """The checks of `pagedllm serve`'s flags that need no model, made before the engine starts (so a mistake costs
    no model load, and no server starts half-configured): each ValueError names its flag. The TLS files must exist
    and be readable, a key needs its certificate, and client-certificate settings need HTTPS (without it they
    would be silently ignored)."""
    if args.enable_log_outputs and not args.enable_log_requests:
        raise ValueError("--enable-log-outputs needs --enable-log-requests")  # vLLM's
    if args.api_server_count not in (None, 1):
        raise ValueError(f"--api-server-count {args.api_server_count}: pagedllm serves from one API server process "
                         "(which serves every data-parallel engine); give 1 or leave it out")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be 0 or more seconds, got {args.shutdown_timeout}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0-65535, got {args.port}")
    if args.ssl_keyfile and not args.ssl_certfile:
        raise ValueError("--ssl-keyfile needs --ssl-certfile")
    if (args.ssl_ca_certs or args.ssl_cert_reqs != ssl.CERT_NONE) and not args.ssl_certfile:
        raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need HTTPS (--ssl-certfile)")
    for flag in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(args, flag)
        if path is not None:
            try:
                with open(path, "rb"):
                    pass
            except OSError as e:
                raise ValueError(f"--{flag.replace('_', '-')} {path}: {e.strerror}") from None
    validate_serving_args(args)


def validate_serving_args(args: argparse.Namespace) -> None:
    """The checks `serve` and `run-batch` share, made before the model loads. The --tool-parser-plugin file is
    imported here, in the process that serves, so --tool-call-parser may name a format it registers."""
    engine_args_from(args).refuse_unsupported()
    if args.tool_parser_plugin:
        ToolParserManager.import_tool_parser(args.tool_parser_plugin)
    if args.tool_call_parser is not None and args.tool_call_parser not in ToolParserManager.list_registered():
        raise ValueError(f"--tool-call-parser {args.tool_call_parser}: no such format (choose from "
                         f"{', '.join(ToolParserManager.list_registered())})")
    if (args.lora_modules or getattr(args, "allow_runtime_lora_updating", False)) and not args.enable_lora:
        raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")


def add_serving_args(group) -> None:
    """What the serving classes take (init_app_state), shared by `serve` and `run-batch`."""
    group.add_argument("--served-model-name", nargs="+", default=None,
                       help="the name(s) requests use for the model (default: the model argument)")
    group.add_argument("--chat-template", default=None,
                       help="a Jinja chat template, or a file holding one, instead of the model's")
    group.add_argument("--chat-template-content-format", choices=CHAT_TEMPLATE_CONTENT_FORMATS, default="auto",
                       help="how a message's content reaches the chat template: string (the text of its parts) or "
                            "openai (the list of its parts, {\"type\": \"text\", \"text\": ...}); auto: openai for "
                            "templates that loop over a message's content (default: auto)")
    group.add_argument("--tool-call-parser", default=None,
                       help="the format tool calls take in free text, for tool_choice 'auto': hermes (Qwen and "
                            "others), llama3_json / llama4_json (Llama 3.x, 4), pythonic / llama4_pythonic, mistral, "
                            "or one --tool-parser-plugin registers (default: detected from the chat template)")
    group.add_argument("--tool-parser-plugin", default="",
                       help="a Python file to import first, which registers tool-call formats of its own with "
                            "pagedllm.entrypoints.openai.tool_calls.ToolParserManager.register_module (vLLM's)")
    group.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=False,
                       help="vLLM's switch for tool_choice 'auto', taken for its command lines: here 'auto' is on "
                            "wherever the format is known (--tool-call-parser, or the chat template's)")
    group.add_argument("--exclude-tools-when-tool-choice-none", action=argparse.BooleanOptionalAction, default=False,
                       help="a chat request with tool_choice 'none' renders its prompt without its tools (vLLM's); by "
                            "default the chat template gets them all the same")
    group.add_argument("--default-chat-template-kwargs", type=_json_object, default=None,
                       help='chat template variables for every chat request, as JSON, e.g. \'{"enable_thinking": '
                            'false}\'; a request\'s chat_template_kwargs win (default: none)')
    group.add_argument("--enable-prompt-tokens-details", action=argparse.BooleanOptionalAction, default=False,
                       help="usage tells how many prompt tokens the prefix cache held (prompt_tokens_details."
                            "cached_tokens, when there were any; the Responses API's usage always does)")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The EngineArgs flags, shared by `serve`, `run-batch` and `bench`."""
    engine = parser.add_argument_group("engine")
    engine.add_argument("--device", choices=DEVICES, default=EngineArgs.device,
                        help="where the engine runs: auto (a CUDA GPU where torch sees one, else the CPU), cpu, "
                             "cuda (default: %(default)s)")
    engine.add_argument("--attention-backend", type=_attention_backend, default=EngineArgs.attention_backend,
                        help="the attention kernels, in any case: TORCH_SDPA (the CPU's, vLLM's CPU_ATTN: native "
                             "kernels, torch SDPA elsewhere), TRITON_ATTN (CUDA's; on the CPU only under "
                             "TRITON_INTERPRET=1, for testing), auto (default: the platform's)")
    engine.add_argument("--dtype", default=EngineArgs.dtype,
                        choices=["auto", "float32", "float", "bfloat16", "float16", "half"])
    engine.add_argument("--max-model-len", type=human_readable_int_or_auto, default=EngineArgs.max_model_len,
                        help="context length, e.g. 2048, 4k (4000) or 4K (4096); -1 or auto: the longest the KV "
                             "cache holds, up to the model's (default: the model's)")
    engine.add_argument("--tokenizer", default=EngineArgs.tokenizer,
                        help="a tokenizer directory (or model alias) other than the model's")
    engine.add_argument("--tokenizer-mode", choices=TOKENIZER_MODES, default=EngineArgs.tokenizer_mode,
                        help="vLLM's: auto and hf load the Hugging Face tokenizer (vLLM's other modes are not "
                             "supported) (default: %(default)s)")
    engine.add_argument("--max-logprobs", type=int, default=EngineArgs.max_logprobs,
                        help="the most logprobs or prompt_logprobs a request may ask for; -1: the vocabulary "
                             "(default: %(default)s)")
    engine.add_argument("--logprobs-mode", default=EngineArgs.logprobs_mode, choices=LOGPROBS_MODES,
                        help="what logprobs report: raw_* the model's logits, processed_* those each token was "
                             "sampled from (after penalties, temperature, top-k, ...); *_logprobs their log-softmax, "
                             "*_logits the logits (default: %(default)s)")
    engine.add_argument("--max-num-seqs", type=int, default=EngineArgs.max_num_seqs)
    engine.add_argument("--max-num-batched-tokens", type=human_readable_int,
                        default=EngineArgs.max_num_batched_tokens, help="tokens a step may take, e.g. 8192 or 8K")
    engine.add_argument("--block-size", type=int, default=EngineArgs.block_size)
    engine.add_argument("--num-kv-blocks", type=int, default=EngineArgs.num_kv_blocks,
                        help="KV cache blocks, instead of sizing the cache by --kv-cache-memory")
    engine.add_argument("--num-gpu-blocks-override", type=int, default=EngineArgs.num_gpu_blocks_override,
                        help="vLLM's flag for the same count")
    engine.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                        default=EngineArgs.enable_chunked_prefill,
                        help="split long prompts over steps, batched with decodes (default: %(default)s)")
    engine.add_argument("--long-prefill-token-threshold", type=int, default=EngineArgs.long_prefill_token_threshold,
                        help="a prompt longer than this prefills at most this many tokens a step, unless it is the "
                             "only request (0: no limit)")
    engine.add_argument("--max-prefill-tokens-with-decodes", type=int,
                        default=EngineArgs.max_prefill_tokens_with_decodes,
                        help="prompt tokens a step that also decodes may take, bounding inter-token latency under "
                             "load (0: up to --max-num-batched-tokens; default: "
                             f"{SERVE_MAX_PREFILL_TOKENS_WITH_DECODES} for serve, 0 for run-batch)")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=EngineArgs.enable_prefix_caching)
    engine.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=EngineArgs.scheduling_policy)
    engine.add_argument("--scheduler-reserve-full-isl", action=argparse.BooleanOptionalAction,
                        default=EngineArgs.scheduler_reserve_full_isl,
                        help="admit a waiting request only once the free KV cache holds its whole prompt, not just "
                             "its first chunk (default: %(default)s)")
    engine.add_argument("--stream-interval", type=int, default=EngineArgs.stream_interval,
                        help="a running request's outputs (a stream's chunks) every this many tokens, its first "
                             "token at once: fewer, larger chunks, less frontend work per token (default: "
                             "%(default)s)")
    engine.add_argument("--kv-cache-memory", type=_memory_size, default=EngineArgs.kv_cache_memory,
                        help='KV cache size in bytes or like "2GiB" (default: 10%% of available RAM, at most 4 GiB)')
    engine.add_argument("--kv-cache-memory-bytes", type=human_readable_int, default=EngineArgs.kv_cache_memory_bytes,
                        help="vLLM's flag for the same size: bytes, or with vLLM's suffixes (4G = 4 GiB, 4g = 4e9)")
    engine.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=EngineArgs.kv_cache_dtype,
                        help="the KV cache's elements: auto (the model's dtype), fp8 (= fp8_e4m3) and fp8_e5m2 (one "
                             "byte, scale 1), int8 (one byte, a scale per token and head)")
    engine.add_argument("--gpu-memory-utilization", type=float, default=EngineArgs.gpu_memory_utilization,
                        help="on a GPU, the share of its memory the engine takes: weights, activations and the KV "
                             "cache (default: %(default)s)")
    engine.add_argument("--kv-cache-populate", choices=KV_CACHE_POPULATE, default=EngineArgs.kv_cache_populate,
                        help="fault the KV cache's memory in by a background thread while the engine is idle, or "
                             "before it takes requests (steady latency from the first request where first touches "
                             "are slow, as in VMs; start-up takes longer) (default: %(default)s)")
    engine.add_argument("--seed", type=int, default=EngineArgs.seed)
    engine.add_argument("--load-format", choices=LOAD_FORMATS, default=EngineArgs.load_format,
                        help="which of a model directory's weight files load: auto (= hf) its *.safetensors, else its "
                             "*.bin, else its *.pt; safetensors or pt those only (default: %(default)s)")
    engine.add_argument("--quantization", "-q", choices=list(QUANTIZATION_METHODS), default=EngineArgs.quantization,
                        help="gguf: keep a GGUF file's Q4_0/Q4_1, Q8_0, Q2_K-Q6_K, IQ4_NL/XS linear weights "
                             "packed where a kernel takes them (other types dequantized at load); gguf_int4: the "
                             "Q4_0/Q4_1/Q4_K ones only; int8: W8A8, the linear layers' weights int8 per channel and "
                             "activations int8 per token, each token's two largest entries kept float; "
                             "compressed-tensors: a compressed-tensors checkpoint's own W8A8, which it runs unnamed "
                             "too (default: dense)")
    engine.add_argument("--num-cpu-threads", type=int, default=EngineArgs.num_cpu_threads,
                        help="torch threads of the engine process (default: one per core)")
    engine.add_argument("--disable-log-stats", action=argparse.BooleanOptionalAction,
                        default=EngineArgs.disable_log_stats,
                        help="no statistics: neither the periodic log line of throughput, queues, KV cache and "
                             "speculative decoding (every PAGEDLLM_LOG_STATS_INTERVAL seconds, default 10, in which "
                             "requests ran) nor the pagedllm: metrics (default: %(default)s; bench: true)")
    engine.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=EngineArgs.enforce_eager,
                        help="run decode steps eagerly, without replaying CPU graphs")
    engine.add_argument("--compilation-config", "-cc", type=_compilation_config, default=EngineArgs.compilation_config,
                        help='vLLM\'s compilation config: a mode (0-3) or JSON; \'{"cudagraph_mode": "NONE"}\' turns '
                             "off CPU graphs, its other fields change nothing here")
    engine.add_argument("--optimization-level", "-O", type=int, choices=range(4),
                        default=EngineArgs.optimization_level,
                        help="vLLM's -O0 .. -O3: -O0 runs eagerly, without CPU graphs, unless --compilation-config "
                             "sets cudagraph_mode; the others change nothing here (default: %(default)s)")
    engine.add_argument("--cudagraph-capture-sizes", type=int, nargs="+", default=EngineArgs.cudagraph_capture_sizes,
                        help="vLLM's shortcut for compilation_config's field: taken, changes nothing here")
    engine.add_argument("--max-cudagraph-capture-size", type=int, default=EngineArgs.max_cudagraph_capture_size,
                        help="vLLM's shortcut for compilation_config's field: taken, changes nothing here")
    engine.add_argument("--generation-config", default=EngineArgs.generation_config,
                        help="default sampling parameters (temperature, top_p, top_k, min_p, repetition_penalty, "
                             "max_new_tokens as max_tokens): auto reads the model directory's generation_config.json, "
                             "vllm ignores it, or a directory holding one (default: %(default)s)")
    engine.add_argument("--trust-remote-code", action=argparse.BooleanOptionalAction,
                        default=EngineArgs.trust_remote_code,
                        help="vLLM's, taken for its command lines: pagedllm runs no code a checkpoint ships")
    engine.add_argument("--override-generation-config", type=_json_object,
                        default=EngineArgs.override_generation_config,
                        help='default sampling parameters over the generation config\'s, as JSON in its names, '
                             'e.g. \'{"temperature": 0.5, "max_new_tokens": 256}\'')
    engine.add_argument("--hf-overrides", type=_json_object, default=EngineArgs.hf_overrides,
                        help='the model config\'s fields to replace, as JSON, e.g. \'{"max_position_embeddings": '
                             '4096}\' (a sub-config\'s within it, as a nested object)')
    engine.add_argument("--revision", default=EngineArgs.revision,
                        help="vLLM's Hub revision: refused, as pagedllm never downloads (pass the revision's files)")
    engine.add_argument("--download-dir", default=EngineArgs.download_dir,
                        help="vLLM's Hub download directory: refused, as pagedllm never downloads")
    engine.add_argument("--cpu-offload-gb", type=float, default=EngineArgs.cpu_offload_gb,
                        help="vLLM's weight offloading: 0 only (default: %(default)s)")
    engine.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=EngineArgs.async_scheduling,
                        help="vLLM's: off only (--no-async-scheduling), as vLLM's CPU backend runs")
    engine.add_argument("--speculative-config", "-sc", type=_json_object, default=EngineArgs.speculative_config,
                        help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    engine.add_argument("--spec-method", default=EngineArgs.spec_method,
                        help="vLLM's shortcut for --speculative-config's method")
    engine.add_argument("--spec-model", default=EngineArgs.spec_model,
                        help="vLLM's shortcut for --speculative-config's model")
    engine.add_argument("--spec-tokens", type=int, default=EngineArgs.spec_tokens,
                        help="vLLM's shortcut for --speculative-config's num_speculative_tokens")
    engine.add_argument("--structured-outputs-config", type=_json_object,
                        default=EngineArgs.structured_outputs_config,
                        help='vLLM\'s structured output settings as JSON, e.g. \'{"backend": "xgrammar", '
                             '"disable_any_whitespace": false}\' (backend auto or xgrammar; disable_any_whitespace: '
                             'the default of requests that do not set it, true here)')
    engine.add_argument("--reasoning-parser", choices=list(REASONING_PARSERS), default=EngineArgs.reasoning_parser,
                        help="a thinking model's <think> markers: requests' thinking_token_budget is enforced by them, "
                             "and the server splits each chat answer's reasoning off its content, into the message's "
                             "reasoning field")
    engine.add_argument("--reasoning-config", type=_json_object, default=EngineArgs.reasoning_config,
                        help='vLLM\'s reasoning settings as JSON: reasoning_parser, reasoning_start_str and '
                             'reasoning_end_str (what a spent thinking_token_budget forces), e.g. '
                             '\'{"reasoning_end_str": "Time to answer.</think>"}\' (default: those of '
                             '--reasoning-parser)')
    engine.add_argument("--profiler-config", type=_json_object, default=EngineArgs.profiler_config,
                        help='vLLM\'s profiler settings as JSON, e.g. \'{"profiler": "torch", "torch_profiler_dir": '
                             '"/tmp/traces"}\': what start_profile() and stop_profile() trace the workers with')
    lora = parser.add_argument_group("LoRA adapters")
    lora.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=EngineArgs.enable_lora,
                      help="serve LoRA adapters of the model, batched with base-model requests")
    lora.add_argument("--lora-modules", type=_lora_module, nargs="+", default=None,
                      help="adapters served from the start: name=path or JSON {\"name\": ..., \"path\": ...}; a "
                           "request selects one by its name as \"model\"")
    lora.add_argument("--max-loras", type=int, default=EngineArgs.max_loras,
                      help="adapters in one step (default: %(default)s)")
    lora.add_argument("--max-lora-rank", type=int, choices=MAX_LORA_RANKS, default=EngineArgs.max_lora_rank,
                      help="the largest adapter rank served (default: %(default)s)")
    lora.add_argument("--max-cpu-loras", type=int, default=EngineArgs.max_cpu_loras,
                      help="adapters kept loaded (default: --max-loras)")
    lora.add_argument("--allow-runtime-lora-updating", action="store_true",
                      help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (else they answer 404)")
    parallel = parser.add_argument_group("parallelism")
    parallel.add_argument("--tensor-parallel-size", "-tp", type=int, default=EngineArgs.tensor_parallel_size,
                          help="ranks that split each layer's heads and MLP (default: %(default)s)")
    parallel.add_argument("--pipeline-parallel-size", "-pp", type=int, default=EngineArgs.pipeline_parallel_size,
                          help="ranks that split the layers into stages (default: %(default)s)")
    parallel.add_argument("--data-parallel-size", "-dp", type=int, default=EngineArgs.data_parallel_size,
                          help="engines, each with its own scheduler and KV cache (default: %(default)s)")
    parallel.add_argument("--enable-expert-parallel", "-ep", action=argparse.BooleanOptionalAction,
                          default=EngineArgs.enable_expert_parallel,
                          help="mixture-of-experts layers split their experts over the tensor-parallel ranks (each "
                               "holds whole experts) rather than each expert's intermediate dimension")
    parallel.add_argument("--distributed-executor-backend", choices=list(DISTRIBUTED_EXECUTOR_BACKENDS),
                          default=EngineArgs.distributed_executor_backend,
                          help="how ranks run: uni (one, in the engine process), mp (a process each), ray (Ray "
                               "actors); default: uni for one rank, ray inside a Ray cluster, else mp")


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    """vLLM's ``--config FILE`` (read by entrypoints/cli.py with config_file_defaults), for `serve` and
    `run-batch`."""
    parser.add_argument("--config", default=None,
                        help="a YAML file of flags (keys are the flags' names, e.g. max-model-len: 2048); flags on the "
                             "command line win")


def config_file_defaults(parser: argparse.ArgumentParser, path: str) -> dict:
    """vLLM's ``--config FILE``: the YAML file's flags as ``parser`` defaults (so any flag given on the command line
    wins), by dest, each converted as argparse converts its flag's text; a required flag the file gives is no longer
    required on the command line. An on/off flag's --no- spelling as a key turns it off when true and is ignored when
    false (vLLM's load_config_file adds --no-x for ``no-x: true``, nothing for ``no-x: false``). An unknown key, or a
    value that does not fit its flag, is a parser error naming it."""
    import yaml

    try:
        with open(path) as f:
            values = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        parser.error(f"--config {path}: {e}")
    if not isinstance(values, dict):
        parser.error(f"--config {path}: expected a mapping of flag names to values")
    actions = {option.lstrip("-"): action for action in parser._actions for option in action.option_strings}
    actions["model"] = next(action for action in parser._actions if action.dest == "model")
    defaults = {}
    for key, value in values.items():
        name = str(key).replace("_", "-")
        action = actions.get(name)
        if action is None or action.dest in ("help", "config"):
            parser.error(f"--config {path}: unknown flag {key!r}")
        try:
            value = _config_value(action, value)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
            parser.error(f"--config {path}: {key}: {e}")
        if isinstance(action, argparse.BooleanOptionalAction) and name.startswith("no-"):
            if not value:  # the --no- spelling, false: no flag
                continue
            value = False
        defaults[action.dest] = value
        action.required = False
    return defaults


def _config_value(action: argparse.Action, value):
    """A YAML value as ``action`` would have parsed its flag's text: booleans for on/off flags, each item of a
    list for flags taking several, mappings as the JSON text their flag takes."""
    if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return value

    def convert(item):
        text = item if isinstance(item, str) else json.dumps(item) if isinstance(item, (dict, list)) else str(item)
        converted = action.type(text) if action.type else text
        if action.choices is not None and converted not in action.choices:
            raise ValueError(f"{converted!r} is not one of {', '.join(map(str, action.choices))}")
        return converted

    if action.nargs in ("+", "*"):
        return [convert(item) for item in (value if isinstance(value, list) else [value])]
    return None if value is None else convert(value)


def _lora_module(text: str) -> dict:
    """One --lora-modules entry: name=path, or vLLM's JSON form {"name": ..., "path": ..., "base_model_name": ...}."""
    if text.lstrip().startswith("{"):
        module = _json_object(text)
        if not isinstance(module.get("name"), str) or not isinstance(module.get("path"), str):
            raise argparse.ArgumentTypeError(f"a JSON LoRA module needs string 'name' and 'path', got {text!r}")
        return {"name": module["name"], "path": module["path"], "base_model_name": module.get("base_model_name")}
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path or a JSON object, got {text!r}")
    return {"name": name, "path": path, "base_model_name": None}


def _json_list(text: str) -> list:
    """A flag's JSON list value (vLLM's CORS flags), e.g. '["https://example.com"]'."""
    return _json(text, list, "a JSON list")


def _json_object(text: str) -> dict:
    return _json(text, dict, "a JSON object")


def _compilation_config(text: str) -> int | dict:
    """vLLM's --compilation-config value: a mode such as 3, or a JSON object of CompilationConfig fields."""
    return int(text) if text.strip().isdigit() else _json_object(text)


def _json(text: str, kind: type, name: str):
    """A flag's JSON value of type ``kind``; anything else is a usage error naming what was wrong."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, kind):
        raise argparse.ArgumentTypeError(f"expected {name}, got {text!r}")
    return value


def engine_kwargs_from(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in ENGINE_FLAGS}


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    return EngineArgs(model=args.model, **engine_kwargs_from(args))


def serve_engine_args(args: argparse.Namespace) -> EngineArgs:
    """The engine arguments of `pagedllm serve`: what the flags say, with the server's own defaults where they left
    a field to the entry point (as vLLM's defaults by usage context)."""
    engine_args = engine_args_from(args)
    if engine_args.max_prefill_tokens_with_decodes is None:
        engine_args.max_prefill_tokens_with_decodes = SERVE_MAX_PREFILL_TOKENS_WITH_DECODES
    return engine_args
