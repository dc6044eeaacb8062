"""The OpenAI-compatible API server: FastAPI routes over one AsyncLLM, served by uvicorn.

`pagedllm serve` runs run_server(): the engine process starts first (the model loads), then uvicorn listens.
On SIGINT/SIGTERM uvicorn stops accepting connections and waits for open ones; in-flight requests get
--shutdown-timeout seconds to finish (default 0), then the rest end with finish_reason "abort" and the engine
process stops, so that wait is bounded and nothing is left behind (see shutdown.py).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import socket
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Optional
from urllib.parse import urlsplit

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response, StreamingResponse
from prometheus_client import (CONTENT_TYPE_LATEST, GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR,
                               CollectorRegistry, generate_latest)
from pydantic import BaseModel
from starlette.datastructures import Headers, MutableHeaders

import pagedllm
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.logger import RequestLogger
from pagedllm.entrypoints.openai.auth import AuthenticationMiddleware
from pagedllm.entrypoints.openai.chat_utils import load_chat_template
from pagedllm.entrypoints.openai.cli_args import serve_engine_args
from pagedllm.entrypoints.openai.errors import OpenAIError, register_exception_handlers
from pagedllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                  LoadLoRAAdapterRequest, StreamOptions, TokenizeRequest,
                                                  UnloadLoRAAdapterRequest, random_uuid)
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedllm.entrypoints.openai.shutdown import (RejectWhileShuttingDown, exit_when_engine_dies,
                                                  keep_alive_on_engine_death, on_exit_signal)
from pagedllm.entrypoints.openai.utils import with_cancellation
from pagedllm.entrypoints.openai.web_ui import mount_web_ui
from pagedllm.envs import env_flag
from pagedllm.gc_utils import freeze_gc_heap
from pagedllm.metrics.logger_factories import aggregate
from pagedllm.metrics.loggers import LoggingStatLogger, log_stats_interval
from pagedllm.metrics.prometheus import PrometheusStatLogger

logger = logging.getLogger("pagedllm.entrypoints.openai.api_server")

router = APIRouter()
# Run-time adapter loading, served only with --allow-runtime-lora-updating (as vLLM with its environment switch):
# without it these paths are 404s.
lora_router = APIRouter()
# vLLM's development endpoints that pagedllm has, served only with PAGEDLLM_SERVER_DEV_MODE=1 (vLLM's
# VLLM_SERVER_DEV_MODE): they act on the whole engine, so a public server must not offer them.
dev_router = APIRouter()


def server_dev_mode() -> bool:
    """PAGEDLLM_SERVER_DEV_MODE, read as vLLM reads VLLM_SERVER_DEV_MODE."""
    return env_flag("PAGEDLLM_SERVER_DEV_MODE", False)


def _as_served(request: Any, raw_request: Request) -> Any:
    """``request`` as the server takes it: the X-Request-Id header, when sent, as its request_id (vLLM's precedence
    over the body's), --return-tokens-as-token-ids where the request leaves return_tokens_as_token_ids out, and,
    under --enable-force-include-usage, a stream's usage asked for, continuous_usage_stats included (vLLM's
    should_include_usage forces both)."""
    header = raw_request.headers.get("X-Request-Id")
    if header is not None:
        request.request_id = header
    if request.return_tokens_as_token_ids is None:
        request.return_tokens_as_token_ids = raw_request.app.state.return_tokens_as_token_ids
    if raw_request.app.state.force_include_usage and request.stream:
        request.stream_options = StreamOptions(include_usage=True, continuous_usage_stats=True)
    return request


def _respond(result: Any) -> Response:
    if isinstance(result, BaseModel):
        return Response(result.model_dump_json(), media_type="application/json")
    return StreamingResponse(result, media_type="text/event-stream")


@router.get("/health")
async def health(raw_request: Request) -> Response:
    """200 while the engine process is alive; 503 once it has died."""
    await raw_request.app.state.engine_client.check_health()
    return Response(status_code=200)


@router.get("/ping")
@router.post("/ping")
async def ping(raw_request: Request) -> Response:
    """/health under the name SageMaker's health check asks for (GET or POST), which vLLM serves too."""
    return await health(raw_request)


@router.get("/version")
async def version() -> dict:
    return {"version": pagedllm.__version__}


@router.get("/load")
async def server_load(raw_request: Request) -> dict:
    """vLLM's: the requests in flight on the generation routes, with --enable-server-load-tracking (else 0)."""
    return {"server_load": raw_request.app.state.server_load_metrics}


@router.get("/metrics")
async def metrics(raw_request: Request) -> Response:
    return Response(generate_latest(raw_request.app.state.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def show_available_models(raw_request: Request) -> Response:
    return _respond(raw_request.app.state.openai_serving_models.show_available_models())


@router.post("/tokenize")
async def tokenize(request: TokenizeRequest, raw_request: Request) -> Response:
    return _respond(raw_request.app.state.openai_serving_tokenization.create_tokenize(request))


@router.post("/detokenize")
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> Response:
    return _respond(raw_request.app.state.openai_serving_tokenization.create_detokenize(request))


@router.post("/v1/chat/completions")
@with_cancellation
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    return _respond(await raw_request.app.state.openai_serving_chat.create_chat_completion(
        _as_served(request, raw_request)))


@router.post("/v1/responses")
@with_cancellation
async def create_responses(request: ResponsesRequest, raw_request: Request) -> Response:
    return _respond(await raw_request.app.state.openai_serving_responses.create_responses(request))


@router.get("/v1/responses/{response_id}")
async def retrieve_responses(response_id: str, raw_request: Request, stream: bool = False,
                             starting_after: Optional[int] = None) -> Response:
    return _respond(raw_request.app.state.openai_serving_responses.retrieve_responses(response_id, stream,
                                                                                      starting_after))


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_responses(response_id: str, raw_request: Request) -> Response:
    return _respond(await raw_request.app.state.openai_serving_responses.cancel_responses(response_id))


@router.post("/v1/completions")
@with_cancellation
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    return _respond(await raw_request.app.state.openai_serving_completion.create_completion(
        _as_served(request, raw_request)))


@lora_router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: LoadLoRAAdapterRequest, raw_request: Request) -> Response:
    await raw_request.app.state.openai_serving_models.load_lora_adapter_async(request.lora_name, request.lora_path,
                                                                              request.load_inplace)
    return Response(f"Success: LoRA adapter '{request.lora_name}' added successfully.", media_type="text/plain")


@lora_router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: UnloadLoRAAdapterRequest, raw_request: Request) -> Response:
    await raw_request.app.state.openai_serving_models.unload_lora_adapter(request.lora_name)
    return Response(f"Success: LoRA adapter '{request.lora_name}' removed successfully.", media_type="text/plain")


@dev_router.post("/reset_prefix_cache")
async def reset_prefix_cache(raw_request: Request, reset_running_requests: bool = False) -> dict:
    """vLLM's: forgets the prefix cache, ``{"success": false}`` while requests hold blocks (unless
    ``?reset_running_requests=true``, which preempts them first)."""
    logger.info("Resetting prefix cache...")
    return {"success": bool(await raw_request.app.state.engine_client.reset_prefix_cache(reset_running_requests))}


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    freeze_gc_heap()  # started: what the process holds now lives as long as it does (gc_utils.py), as vLLM's
    yield
    app.state.engine_client.shutdown()


def build_app(engine_client: Any, registry: CollectorRegistry, served_model_names: list[str],
              frontend: argparse.Namespace, chat_template: Optional[str] = None, api_keys: Optional[list[str]] = None,
              tool_call_parser: Optional[str] = None, lora_modules: Optional[list[dict]] = None,
              allow_runtime_lora_updating: bool = False, dev_mode: bool = False) -> FastAPI:
    """``frontend``: the HTTP and request flags (cli_args.add_frontend_args: CORS, request logging, response
    role, the web page). ``lora_modules``: adapters served from the start ({"name", "path", "base_model_name"});
    a bad one is a ValueError. ``dev_mode``: serve dev_router's paths too (server_dev_mode())."""
    # --disable-fastapi-docs (vLLM's): no OpenAPI document, Swagger UI or ReDoc page
    docs = {"openapi_url": None, "docs_url": None, "redoc_url": None} if frontend.disable_fastapi_docs else {}
    app = FastAPI(lifespan=lifespan, **docs)
    app.include_router(router)
    if allow_runtime_lora_updating:
        app.include_router(lora_router)
    if dev_mode:
        logger.warning("SECURITY WARNING: development endpoints (/reset_prefix_cache) are enabled; this should not "
                       "be used in production")
        app.include_router(dev_router)
    if not frontend.disable_web_ui:
        mount_web_ui(app, api_key_required=bool(api_keys))
    register_exception_handlers(app)
    app.state.server_load_metrics = 0
    app.state.force_include_usage = frontend.enable_force_include_usage
    app.state.return_tokens_as_token_ids = frontend.return_tokens_as_token_ids
    if frontend.enable_server_load_tracking:  # innermost: what authentication refuses does not count
        app.add_middleware(ServerLoadTracking)
    if api_keys:
        app.add_middleware(AuthenticationMiddleware, api_keys=api_keys)
    app.add_middleware(CORSMiddleware, allow_origins=frontend.allowed_origins,
                       allow_credentials=frontend.allow_credentials, allow_methods=frontend.allowed_methods,
                       allow_headers=frontend.allowed_headers)
    if frontend.enable_request_id_headers:
        app.add_middleware(RequestIdHeader)
    # Added last, so outermost: a request arriving while the server drains gets its 503 before anything else;
    # CORS comes next, so preflights are answered before authentication and 401s carry CORS headers too.
    app.add_middleware(RejectWhileShuttingDown)
    app.state.shutting_down = False
    request_logger = RequestLogger(max_log_len=frontend.max_log_len, log_outputs=frontend.enable_log_outputs) \
        if frontend.enable_log_requests else None
    init_app_state(app.state, engine_client, served_model_names, chat_template, tool_call_parser, lora_modules,
                   response_role=frontend.response_role, request_logger=request_logger,
                   enable_prompt_tokens_details=frontend.enable_prompt_tokens_details,
                   reasoning_parser=frontend.reasoning_parser,
                   default_chat_template_kwargs=frontend.default_chat_template_kwargs,
                   chat_template_content_format=frontend.chat_template_content_format,
                   exclude_tools_when_tool_choice_none=frontend.exclude_tools_when_tool_choice_none)
    app.state.registry = registry
    return app


def init_app_state(state: Any, engine_client: Any, served_model_names: list[str], chat_template: Optional[str],
                   tool_call_parser: Optional[str], lora_modules: Optional[list[dict]], *,
                   response_role: str = "assistant", request_logger: Optional[RequestLogger] = None,
                   enable_prompt_tokens_details: bool = False, reasoning_parser: Optional[str] = None,
                   default_chat_template_kwargs: Optional[dict] = None,
                   chat_template_content_format: str = "auto", exclude_tools_when_tool_choice_none: bool = False
                   ) -> None:
    """The serving objects on ``state``, as the routes use them (and `pagedllm run-batch`, so that its results are
    the server's). ``response_role``, ``request_logger``, ``enable_prompt_tokens_details``, ``reasoning_parser``,
    ``default_chat_template_kwargs``, ``chat_template_content_format``, ``exclude_tools_when_tool_choice_none``:
    --response-role, --enable-log-requests, --enable-prompt-tokens-details, --reasoning-parser,
    --default-chat-template-kwargs, --chat-template-content-format, --exclude-tools-when-tool-choice-none."""
    model_config = engine_client.model_config
    models = OpenAIServingModels(served_model_names, model_config.model, model_config.max_model_len,
                                 engine_client, model_config.get_diff_sampling_param())
    for module in lora_modules or ():
        try:
            models.load_lora_adapter(module["name"], module["path"], module.get("base_model_name"))
        except OpenAIError as e:
            raise ValueError(f"--lora-modules {module['name']}: {e.message}") from None
    state.engine_client = engine_client
    state.openai_serving_models = models
    state.openai_serving_chat = OpenAIServingChat(
        engine_client, models, chat_template, tool_call_parser, response_role=response_role,
        request_logger=request_logger, enable_prompt_tokens_details=enable_prompt_tokens_details,
        reasoning_parser=reasoning_parser, default_chat_template_kwargs=default_chat_template_kwargs,
        chat_template_content_format=chat_template_content_format,
        exclude_tools_when_tool_choice_none=exclude_tools_when_tool_choice_none)
    state.openai_serving_responses = OpenAIServingResponses(state.openai_serving_chat)
    state.openai_serving_completion = OpenAIServingCompletion(engine_client, models, request_logger=request_logger,
                                                              enable_prompt_tokens_details=enable_prompt_tokens_details)
    state.openai_serving_tokenization = OpenAIServingTokenization(engine_client.tokenizer, models, chat_template,
                                                                  default_chat_template_kwargs,
                                                                  chat_template_content_format)


class ServerLoadTracking:
    """ASGI middleware (vLLM's --enable-server-load-tracking): app.state.server_load_metrics counts the requests to
    the routes that generate (chat, completions, Responses, as vLLM's load_aware_call routes) from their arrival until
    their response, a stream's last event included, is sent or the client has gone."""
    PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))  # as routed (--root-path)
        if scope["type"] != "http" or not path.startswith(self.PATHS):
            await self.app(scope, receive, send)
            return
        state = scope["app"].state
        state.server_load_metrics += 1
        try:
            await self.app(scope, receive, send)
        finally:
            state.server_load_metrics -= 1


class RequestIdHeader:
    """ASGI middleware (vLLM's --enable-request-id-headers): every response carries an X-Request-Id header, the
    request's own when it sent one (which a chat or completion answer's id then carries too), else a random one."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get("X-Request-Id", random_uuid())

        async def send_with_request_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append("X-Request-Id", request_id)
            await send(message)

        await self.app(scope, receive, send_with_request_id)


class AccessLogFilter(logging.Filter):
    """vLLM's --disable-access-log-for-endpoints (its UvicornAccessLogFilter): no access log line for a request to one
    of these comma-separated paths, matched exactly without the query string (uvicorn's record holds the client, the
    method, then the path)."""

    def __init__(self, endpoints: str) -> None:
        super().__init__()
        self.paths = {path.strip() for path in endpoints.split(",") if path.strip()}

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str)
                    and urlsplit(args[2]).path in self.paths)


class _Server(uvicorn.Server):
    """uvicorn, calling on_exit (on the event loop) at each exit signal."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._on_exit)
        super().handle_exit(sig, frame)


def api_keys_from(args: argparse.Namespace) -> list[str]:
    """The keys a request may authenticate with: --api-key's, else PAGEDLLM_API_KEY's, else VLLM_API_KEY's (so that a
    deployment moved from vLLM with its key in the environment does not come up open); none: no authentication."""
    return [key for key in (args.api_key or [os.environ.get("PAGEDLLM_API_KEY") or os.environ.get("VLLM_API_KEY")])
            if key]


def listening_socket(args: argparse.Namespace) -> Optional[socket.socket]:
    """The TCP socket --host/--port name, bound before the engine starts (as vLLM's setup_server), so that an
    address in use or not this machine's is a ValueError naming the flags at once, not after the model has loaded;
    None with --uds (uvicorn makes that socket). No host (a --config file's ``host:`` or ``host: null``) is every
    interface, as in vLLM (``args.host or ""``) and as uvicorn took it."""
    if args.uds:
        return None
    host = args.host or ""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's create_server, which uvicorn uses
    try:
        sock.bind((host, args.port))
    except OSError as e:
        sock.close()
        raise ValueError(f"--host {args.host} --port {args.port}: cannot listen there: {e.strerror}") from None
    return sock


async def run_server(args: argparse.Namespace) -> None:
    """Serves until an exit signal; ``args`` are `pagedllm serve`'s, checked by validate_parsed_serve_args."""
    chat_template = load_chat_template(args.chat_template)  # a bad path fails before the model loads
    interval = None if args.disable_log_stats else log_stats_interval()  # so does a bad variable
    dev_mode = server_dev_mode()
    keep_alive = keep_alive_on_engine_death()  # and this one
    served_model_names = args.served_model_name or [args.model]
    registry = CollectorRegistry()
    # vLLM serves prometheus_client's default registry, which holds the process_*, python_info and python_gc_*
    # metrics as well as its own: so does this server's.
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    # --disable-log-stats: no statistics kept, the pagedllm: metrics' included (vLLM's log_stats=False: no stat
    # loggers); /metrics serves the process's alone.
    stat_loggers = [] if interval is None else [
        aggregate(lambda config: PrometheusStatLogger.from_config(served_model_names[0], registry, config)),
        aggregate(lambda config: LoggingStatLogger(args.data_parallel_size, interval))]
    sock = listening_socket(args)  # last before the try that closes it: a bad flag above leaves no port taken
    engine_client = watchdog = None
    try:
        # The server's loggers alone (its own Prometheus logger among them, with which vLLM's AsyncLLM adds none).
        engine_args = dataclasses.replace(serve_engine_args(args), disable_log_stats=True)
        engine_client = AsyncLLM.from_engine_args(engine_args, stat_loggers=stat_loggers)
        app = build_app(engine_client, registry, served_model_names, args, chat_template, api_keys_from(args),
                        args.tool_call_parser, args.lora_modules, args.allow_runtime_lora_updating, dev_mode)
        await app.state.openai_serving_models.init_static_loras()
        # --uds replaces host and port (uvicorn listens on the socket); a certificate file turns on TLS, with client
        # certificates checked as --ssl-cert-reqs and --ssl-ca-certs say.
        # --root-path is the ASGI root_path: the prefix a proxy strips, which URLs the app makes (OpenAPI) carry.
        config = uvicorn.Config(app, host=args.host, port=args.port, uds=args.uds, root_path=args.root_path or "",
                                log_level=args.uvicorn_log_level, access_log=not args.disable_uvicorn_access_log,
                                ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                                ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs, timeout_keep_alive=5)
        if args.disable_access_log_for_endpoints:  # after uvicorn.Config, which configures its loggers
            logging.getLogger("uvicorn.access").addFilter(AccessLogFilter(args.disable_access_log_for_endpoints))
        scheme = "https" if args.ssl_certfile else "http"
        where = f"unix:{args.uds}" if args.uds else f"{args.host or '0.0.0.0'}:{sock.getsockname()[1]}"
        logger.info("Serving %s as %s on %s://%s%s", args.model, ", ".join(served_model_names), scheme, where,
                    args.root_path or "")
        server = _Server(config, on_exit=lambda: on_exit_signal(app.state, args.shutdown_timeout))
        if not keep_alive:
            watchdog = asyncio.create_task(exit_when_engine_dies(server, engine_client))
        await server.serve(sockets=[sock] if sock is not None else None)
    finally:
        if watchdog is not None:
            watchdog.cancel()
        if engine_client is not None:
            engine_client.shutdown()
        if sock is not None:
            sock.close()
