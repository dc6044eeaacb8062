"""AuthenticationMiddleware: with --api-key, /v1/* and /engine/* (the web page's engine view) answer 401 unless the
request carries `Bearer <key>` for one of the keys (vLLM's --api-key takes several; the scheme in any case: HTTP's
auth schemes are case-insensitive, and vLLM reads it so). The rest stays open as in vLLM (/health, /metrics, ...), and
so does the web page itself, which asks for the key.

A plain ASGI middleware rather than @app.middleware("http"), which buffers streams and hides disconnects.
"""
from __future__ import annotations

import secrets

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm.entrypoints.openai.errors import create_error_response, json_error

GATED_PREFIXES = ("/v1", "/engine")


class AuthenticationMiddleware:
    def __init__(self, app: ASGIApp, api_keys: list[str]) -> None:
        self.app = app
        self.expected = [key.encode() for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["method"] == "OPTIONS"
                or not _route_path(scope).startswith(GATED_PREFIXES)):
            await self.app(scope, receive, send)
            return
        scheme, _, given = Headers(scope=scope).get("authorization", "").partition(" ")
        # Every key is compared (no early exit), so the time taken says nothing about which one came close.
        matches = sum(secrets.compare_digest(given.encode("latin-1"), expected) for expected in self.expected)
        if scheme.lower() != "bearer" or not matches:
            response = json_error(create_error_response("Invalid or missing API key.", 401))
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _route_path(scope: Scope) -> str:
    """The path the routes see: with --root-path, scope["path"] carries the prefix (/api/v1/..., as ASGI says),
    which routing strips, so the check must too or /v1 would be reachable without the key."""
    path, root_path = scope["path"], scope.get("root_path", "")
    return path[len(root_path):] if root_path and path.startswith(root_path + "/") else path
