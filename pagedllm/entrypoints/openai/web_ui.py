"""The web page at / (a chat with the served model and a live view of the engine) and the JSON it polls.

The page is static files in the package (pagedllm/entrypoints/web/), served by this server alone: no build step,
no CDN, so it works offline. It reaches the API by relative URLs, so it also works under --root-path behind a
proxy. GET /engine/view is each engine's EngineView (core/sched/engine_view.py), taken when asked. Off with
--disable-web-ui; with --api-key the page asks for the key and /engine/* requires it (auth.py).
"""
from __future__ import annotations

from pathlib import Path

import msgspec
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

import pagedllm

WEB_DIR = Path(__file__).resolve().parent.parent / "web"

_INDEX_HTML = (WEB_DIR / "index.html").read_text()

router = APIRouter()


@router.get("/", include_in_schema=False)
async def index(raw_request: Request) -> HTMLResponse:
    """index.html, its <body> saying whether the API needs a key: the page then asks for it before calling
    anything, rather than learning it from a 401 (which browsers report as an error on the console)."""
    needs_key = "true" if raw_request.app.state.api_key_required else "false"
    return HTMLResponse(_INDEX_HTML.replace("<body>", f'<body data-api-key-required="{needs_key}">', 1))


@router.get("/engine/view")
async def engine_view(raw_request: Request) -> Response:
    """{"model", "version", "engines": [EngineView, ...]}: one entry per data-parallel engine."""
    state = raw_request.app.state
    views = await state.engine_client.get_engine_views()
    body = {"model": state.openai_serving_models.model_name, "version": pagedllm.__version__,
            "engines": views}
    return Response(msgspec.json.encode(body), media_type="application/json")


def mount_web_ui(app: FastAPI, api_key_required: bool) -> None:
    app.state.api_key_required = api_key_required
    app.include_router(router)
    app.mount("/static", StaticFiles(directory=WEB_DIR), name="static")
