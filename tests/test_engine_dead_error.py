"""An engine known dead (or shut down) fails every later call with a new EngineDeadError carrying the kept one's
words, as vLLM's raises a new one each time: one exception object raised at every call keeps every earlier raise's
frames (and their locals) on its traceback, which grows for as long as the process lives. No engine is started: the
clients are built empty, holding what their engine's death left."""
import asyncio
import queue
import threading
import traceback
import types

import msgspec
import pytest

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.core_client import MPClient, SyncMPClient
from pagedllm.engine.dp_client import DPSyncMPClient
from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.engine.protocol import EngineCoreRequestType

LAST_WORDS = "The engine process died: out of memory"


def _raised(call) -> EngineDeadError:
    with pytest.raises(EngineDeadError) as info:
        call()
    return info.value


def assert_raised_anew(call) -> None:
    """Two calls raise two errors, with the kept one's words and a traceback of their own call only."""
    first, second = _raised(call), _raised(call)
    assert first is not second and str(first) == str(second) == LAST_WORDS
    assert len(list(traceback.walk_tb(second.__traceback__))) == len(list(traceback.walk_tb(first.__traceback__)))


def test_a_send_to_a_dead_engine_raises_a_new_error_each_time():
    client = MPClient.__new__(MPClient)
    client._closing, client.dead_error, client._encoder = False, EngineDeadError(LAST_WORDS), msgspec.msgpack.Encoder()
    client._input_lock = threading.Lock()
    assert_raised_anew(lambda: client._send(EngineCoreRequestType.ABORT, ["r"]))


def test_a_step_of_a_dead_engine_raises_a_new_error_each_time():
    client = SyncMPClient.__new__(SyncMPClient)
    client._outputs, client._error = queue.Queue(), None
    client._outputs.put(EngineDeadError(LAST_WORDS))  # what the monitor delivers
    assert_raised_anew(client.get_output)


def test_a_dead_async_engine_raises_a_new_error_each_time():
    engine = AsyncLLM.__new__(AsyncLLM)
    engine._dead_error, engine.engine_core = None, types.SimpleNamespace(dead=True,
                                                                         dead_error=EngineDeadError(LAST_WORDS))
    assert_raised_anew(lambda: asyncio.run(engine.check_health()))
    engine._dead_error = EngineDeadError(LAST_WORDS)  # the output handler's, once it took the death
    assert_raised_anew(lambda: asyncio.run(engine.check_health()))


def test_a_dead_data_parallel_client_raises_a_new_error_each_time():
    client = DPSyncMPClient.__new__(DPSyncMPClient)
    client._dead_error = EngineDeadError(LAST_WORDS)
    assert_raised_anew(client.get_output)
    assert_raised_anew(lambda: client.add_request(None))
