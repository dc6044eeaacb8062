"""The shutdown pieces without a server: the 503 for requests arriving during the drain, and which exit signal
shuts the engine down when."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from fastapi import FastAPI
from fastapi.testclient import TestClient

from pagedllm.entrypoints.openai.shutdown import RejectWhileShuttingDown, on_exit_signal


class FakeEngineClient:
    def __init__(self) -> None:
        self.shutdowns = 0

    def shutdown(self) -> None:
        self.shutdowns += 1


def test_requests_during_shutdown_get_503():
    app = FastAPI()
    app.get("/health")(lambda: {})
    app.add_middleware(RejectWhileShuttingDown)
    app.state.shutting_down = False
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        app.state.shutting_down = True
        response = client.get("/health")
    assert response.status_code == 503 and response.json()["error"]["type"] == "ServiceUnavailableError"


def test_first_signal_drains_until_the_timeout_and_a_second_aborts_at_once():
    async def signals(timeout: float, count: int) -> list[int]:
        state = SimpleNamespace(engine_client=FakeEngineClient(), shutting_down=False)
        seen = []
        for _ in range(count):
            on_exit_signal(state, timeout)
            seen.append(state.engine_client.shutdowns)
        await asyncio.sleep(0.3)
        return seen + [state.engine_client.shutdowns]

    assert asyncio.run(signals(0, 1)) == [1, 1]          # default: abort at once
    assert asyncio.run(signals(0.1, 1)) == [0, 1]        # the drain, then the timer
    assert asyncio.run(signals(10, 2)) == [0, 1, 1]      # a second signal does not wait
