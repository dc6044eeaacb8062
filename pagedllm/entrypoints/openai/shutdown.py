"""What the server does on SIGTERM or SIGINT, with vLLM's --shutdown-timeout.

uvicorn, at the first signal, stops listening (new connections are refused) and waits for the open ones to end.
Meanwhile any request that still reaches the app gets 503 (``app.state.shutting_down``; /health too, so a load
balancer sees the drain). In-flight requests run on for up to the timeout; then (at once with the default 0)
the engine is shut down, which ends every request still running with finish_reason "abort" and stops the
engine process. If they all finish sooner, uvicorn's own exit shuts the engine down. A second signal aborts
what is left without waiting. Before uvicorn runs (the engine starting) SIGTERM unwinds as Ctrl-C does.

An engine that dies ends the server too, as vLLM's watchdog does: requests in flight have their error by then, and
uvicorn's exit shuts the rest down, so a supervisor sees the process go and restarts it. With
PAGEDLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 (vLLM's VLLM_KEEP_ALIVE_ON_ENGINE_DEATH) the server stays up, answering 503.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any, Iterator

from pagedllm.entrypoints.openai.errors import ServiceUnavailableError, json_error
from pagedllm.envs import env_flag

logger = logging.getLogger(__name__)

ENGINE_WATCHDOG_S = 5.0  # vLLM's VLLM_WATCHDOG_TIME_S: how often the server looks whether its engine died


class RejectWhileShuttingDown:
    """ASGI middleware: 503 for every HTTP request that arrives once shutdown has begun."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["app"].state.shutting_down:
            response = json_error(ServiceUnavailableError("The server is shutting down.").to_response())
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt within the block (except while uvicorn holds the exit signals), as vLLM's
    run_server: a server stopped while its engine starts unwinds, stopping the engine and removing its files,
    where SIGTERM's default action ended the server at once and left them behind."""
    def interrupt(*_: Any) -> None:
        raise KeyboardInterrupt("terminated")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def on_exit_signal(state: Any, shutdown_timeout: float) -> None:
    """Called on the event loop at each exit signal: the first starts the drain, a later one ends it."""
    engine_client = state.engine_client
    if state.shutting_down or shutdown_timeout <= 0:
        engine_client.shutdown()
    else:
        logger.info("Shutting down: in-flight requests have %s s to finish before they are aborted.",
                    shutdown_timeout)
        asyncio.get_running_loop().call_later(shutdown_timeout, engine_client.shutdown)
    state.shutting_down = True


def keep_alive_on_engine_death() -> bool:
    return env_flag("PAGEDLLM_KEEP_ALIVE_ON_ENGINE_DEATH", False)


async def exit_when_engine_dies(server: Any, engine_client: Any) -> None:
    """Asks uvicorn ``server`` to exit once ``engine_client`` is dead (``errored``: with data parallelism, every
    engine; while one serves, the server serves)."""
    while not engine_client.errored:
        await asyncio.sleep(ENGINE_WATCHDOG_S)
    if not server.should_exit:
        logger.error("The engine is dead: the server exits (PAGEDLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 keeps it up).")
        server.should_exit = True
