"""Errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, for every failure the server reports.

Serving code raises OpenAIError subclasses; the handlers registered here turn them, FastAPI's validation errors
(malformed JSON and wrong types are 400, as OpenAI answers, not FastAPI's 422) and a dead engine (503) into
responses. Streams report the same payload as a final SSE event.
"""
from __future__ import annotations

import http
import logging
import re
from typing import Any, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                500: "InternalServerError", 503: "ServiceUnavailableError"}


def error_type(status_code: int) -> str:
    """The openai client's exception class name for a status ("Method Not Allowed" -> MethodNotAllowedError)."""
    if status_code in _ERROR_TYPES:
        return _ERROR_TYPES[status_code]
    return http.HTTPStatus(status_code).phrase.replace(" ", "").replace("-", "") + "Error"


class OpenAIError(Exception):
    status_code = 500
    err_type: Optional[str] = None  # the body's "type"; None: the openai client's name for the status (error_type)

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def to_response(self) -> ErrorResponse:
        return create_error_response(self.message, self.status_code, self.param, self.err_type)


class BadRequestError(OpenAIError):
    status_code = 400


class InvalidUserInputError(BadRequestError):
    """vLLM's 400 for a LoRA load or unload request it refuses before loading anything (a name missing, taken, or
    a served model's): the body's type is "InvalidUserInput", as vLLM's."""
    err_type = "InvalidUserInput"


class NotFoundError(OpenAIError):
    status_code = 404


class ServiceUnavailableError(OpenAIError):
    status_code = 503


def create_error_response(message: str, status_code: int, param: Optional[str] = None,
                          err_type: Optional[str] = None) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type or error_type(status_code), param=param,
                                         code=status_code))


def json_error(error: ErrorResponse) -> JSONResponse:
    return JSONResponse(error.model_dump(), status_code=error.error.code)


def to_openai_error(exc: Exception) -> OpenAIError:
    """What a request failure means to the client: the engine dying is 503, anything unforeseen 500."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return ServiceUnavailableError(str(exc))
    logger.error("Request failed", exc_info=exc)
    return OpenAIError(f"{type(exc).__name__}: {exc}")


# Parts of a pydantic error location that name a Union member rather than a field: a plain union's member type
# ("prompt.list[int].0"), a union of models' member class ("TokenizeCompletionRequest.prompt": field names are
# never capitalised), or a discriminated union's tag, which the protocol spells "type=<value>" so it reads as one.
_UNION_TAGS = re.compile(r"^(str|int|float|bool|dict|list|none)$|\[|^type=|^[A-Z]")


def error_param(loc: Sequence[Any]) -> Optional[str]:
    """A pydantic error location as OpenAI names the field: union tags dropped, list indices in brackets
    ("input", 1, "content", 0, "type" -> "input[1].content[0].type"); None for the body itself."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif not _UNION_TAGS.search(part):
            param += f".{part}" if param else part
    return param or None


def validation_error(errors: Sequence[Any]) -> BadRequestError:
    """The first of a request body's validation errors (pydantic's, each located from the body down), with the
    offending field as param ("messages", "messages[0].role", ...)."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        return BadRequestError(f"JSON decode error: {first.get('ctx', {}).get('error', first['msg'])}")
    param = error_param(first.get("loc", ()))
    return BadRequestError(f"{param}: {first['msg']}" if param else first["msg"], param)


def register_exception_handlers(app: FastAPI) -> None:
    async def openai_error(_: Request, exc: Exception) -> JSONResponse:
        return json_error(to_openai_error(exc).to_response())

    async def request_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        body_errors = [{**e, "loc": e.get("loc", ())[1:]} for e in exc.errors()]  # FastAPI's start at "body"
        return json_error(validation_error(body_errors).to_response())

    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return json_error(create_error_response(str(exc.detail), exc.status_code))

    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(EngineDeadError, openai_error)
    app.add_exception_handler(Exception, openai_error)
    app.add_exception_handler(RequestValidationError, request_validation_error)
    app.add_exception_handler(HTTPException, http_error)
