"""Async plumbing for request handlers: cancel on client disconnect, merge generators, surface early errors."""
from __future__ import annotations

import asyncio
import contextlib
import functools
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request

T = TypeVar("T")


async def listen_for_disconnect(request: Request) -> None:
    """Returns once the client has gone (the body is already read, so receive() only reports disconnects)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def with_cancellation(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Cancels the handler when the client disconnects, so a non-streaming request is aborted in the engine
    rather than generated to the end for nobody. The handler takes the raw Request as `raw_request`."""

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        handler_task = asyncio.create_task(handler(*args, **kwargs))
        disconnect_task = asyncio.create_task(listen_for_disconnect(kwargs["raw_request"]))
        try:
            done, _ = await asyncio.wait((handler_task, disconnect_task), return_when=asyncio.FIRST_COMPLETED)
        finally:
            handler_task.cancel()
            disconnect_task.cancel()
        if handler_task in done:
            return handler_task.result()
        with contextlib.suppress(asyncio.CancelledError):
            await handler_task  # let the cancellation reach the engine before we go
        return None

    return wrapper


async def merge_async_iterators(*iterators: AsyncIterator[T]) -> AsyncIterator[tuple[int, T]]:
    """Yields (iterator index, item) as items arrive from any of the iterators; closing it closes them all."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[i]))] = i
                yield i, item
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for it in iterators:
            with contextlib.suppress(Exception):
                await it.aclose()


async def peek(iterator: AsyncIterator[T]) -> AsyncIterator[T]:
    """Waits for the first item, so an error the iterator raises before producing anything (a prompt the
    engine rejects, a dead engine) becomes an HTTP error instead of an event in an already-started stream."""
    first = await anext(iterator)

    async def chained() -> AsyncIterator[T]:
        yield first
        async for item in iterator:
            yield item

    return chained()
