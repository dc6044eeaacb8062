"""`pagedllm run-batch`, as `vllm run-batch`: a file of requests in OpenAI's batch format, run in this process on
one AsyncLLM through the serving classes the server uses (init_app_state), so each result is what the server
answers to the same request.

Each input line is {"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body"};
each output line, in input order, is {"id", "custom_id", "response", "error"}:
  - answered: response {"status_code": 200, "request_id", "body": the server's response}, error null;
  - refused by the endpoint (a body that does not validate, a bad parameter, an unknown model): response
    {"status_code": the server's status, "request_id", "body": null}, error {"message", "type", "param", "code"}
    as the server's error body holds it;
  - a line that is not a batch request (not JSON, not POST, an unknown url): response null, error as above
    (custom_id null when the line has none to read).
One bad line costs only its own result; all requests are sent at once and the engine batches them.

-i and -o are local files or, as in vLLM, http(s) URLs: the input is fetched by GET before the model loads, the
output sent by PUT once every request is answered.
"""
from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal, Optional

import httpx
from pydantic import ValidationError
from tqdm.auto import tqdm

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.api_server import init_app_state
from pagedllm.entrypoints.openai.chat_utils import load_chat_template
from pagedllm.entrypoints.openai.cli_args import add_config_arg, add_engine_args, add_serving_args, engine_args_from
from pagedllm.entrypoints.openai.errors import BadRequestError, OpenAIError, to_openai_error, validation_error
from pagedllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, ErrorInfo,
                                                  OpenAIBaseModel, random_uuid)
from pagedllm.models.resolve import DEFAULT_MODEL

# url -> (the body's request class, the handler on the serving state).
ENDPOINTS = {
    "/v1/chat/completions": (ChatCompletionRequest, lambda state: state.openai_serving_chat.create_chat_completion),
    "/v1/completions": (CompletionRequest, lambda state: state.openai_serving_completion.create_completion),
}


class BatchRequestInput(OpenAIBaseModel):
    custom_id: str
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


class BatchResponseData(OpenAIBaseModel):
    status_code: int = 200
    request_id: str
    body: Optional[dict[str, Any]] = None


class BatchRequestOutput(OpenAIBaseModel):
    id: str
    custom_id: Optional[str]
    response: Optional[BatchResponseData]
    error: Optional[ErrorInfo]


# Seconds an input or output URL may go without sending or taking a byte.
URL_TIMEOUT_S = 60


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("-i", "--input-file", required=True,
                        help="the batch file of requests (JSON lines): a path, or an http(s) URL to GET")
    parser.add_argument("-o", "--output-file", required=True,
                        help="where the results go (JSON lines): a path, or an http(s) URL to PUT")
    add_config_arg(parser)
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="model alias, Hugging Face model directory or .gguf file (default: %(default)s)")
    add_serving_args(parser.add_argument_group("serving"))
    add_engine_args(parser)
    return parser


def _custom_id(line: str) -> Optional[str]:
    """The custom_id of a line that is not a valid batch request, where it has one to read."""
    try:
        value = json.loads(line)
    except json.JSONDecodeError:
        return None
    custom_id = value.get("custom_id") if isinstance(value, dict) else None
    return custom_id if isinstance(custom_id, str) else None


def _output(custom_id: Optional[str], response: Optional[BatchResponseData],
            error: Optional[OpenAIError] = None) -> BatchRequestOutput:
    return BatchRequestOutput(id=f"pagedllm-{random_uuid()}", custom_id=custom_id, response=response,
                              error=error.to_response().error if error is not None else None)


async def run_request(state: Any, line: str) -> BatchRequestOutput:
    """One line's result; never raises (a failure is the line's error record)."""
    try:
        request = BatchRequestInput.model_validate_json(line)
    except ValidationError as e:
        return _output(_custom_id(line), None, validation_error(e.errors()))
    if request.url not in ENDPOINTS:
        return _output(request.custom_id, None, BadRequestError(
            f"url {request.url!r} is not one of {', '.join(ENDPOINTS)}.", "url"))
    request_class, handler = ENDPOINTS[request.url]
    request_id = f"pagedllm-batch-{random_uuid()}"
    try:
        body = request_class.model_validate(request.body)
        if body.stream:
            raise BadRequestError("stream is not supported in a batch.", "stream")
        result = await handler(state)(body)
    except ValidationError as e:
        error = validation_error(e.errors())
    except Exception as e:
        error = to_openai_error(e)
    else:
        return _output(request.custom_id, BatchResponseData(request_id=request_id,
                                                            body=json.loads(result.model_dump_json())))
    return _output(request.custom_id, BatchResponseData(status_code=error.status_code, request_id=request_id), error)


def _is_url(path: str) -> bool:
    return path.startswith(("http://", "https://"))


async def read_file(path: str) -> str:
    """A local file's text, or an http(s) URL's body (GET); an HTTP error status is an httpx.HTTPStatusError."""
    if not _is_url(path):
        return Path(path).read_text()
    async with httpx.AsyncClient(timeout=URL_TIMEOUT_S) as client:
        response = await client.get(path)
        response.raise_for_status()
        return response.text


async def write_file(path: str, text: str) -> None:
    """Writes a local file, or PUTs an http(s) URL; an HTTP error status is an httpx.HTTPStatusError."""
    if not _is_url(path):
        Path(path).write_text(text)
        return
    async with httpx.AsyncClient(timeout=URL_TIMEOUT_S) as client:
        response = await client.put(path, content=text.encode())
        response.raise_for_status()


async def run_batch(args: argparse.Namespace) -> None:
    chat_template = load_chat_template(args.chat_template)  # a bad path fails before the model loads
    # Lines end at "\n" only (as vLLM splits them): str.splitlines would also cut at U+2028, U+2029 and U+0085, which
    # JSON allows unescaped inside strings (json.dumps(..., ensure_ascii=False) writes them so).
    lines = [line for line in (await read_file(args.input_file)).split("\n") if line.strip()]
    engine_client = AsyncLLM.from_engine_args(engine_args_from(args))
    try:
        state = SimpleNamespace()
        init_app_state(state, engine_client, args.served_model_name or [args.model], chat_template,
                       args.tool_call_parser, args.lora_modules,
                       enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                       reasoning_parser=args.reasoning_parser,
                       default_chat_template_kwargs=args.default_chat_template_kwargs,
                       chat_template_content_format=args.chat_template_content_format,
                       exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none)
        await state.openai_serving_models.init_static_loras()
        with tqdm(total=len(lines), desc="Running batch", unit="req") as progress:
            async def run(line: str) -> BatchRequestOutput:
                output = await run_request(state, line)
                progress.update()
                return output

            outputs = await asyncio.gather(*map(run, lines))
    finally:
        engine_client.shutdown()
    await write_file(args.output_file, "".join(output.model_dump_json() + "\n" for output in outputs))
