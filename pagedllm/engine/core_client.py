"""Clients of the EngineCore: in-process, and in a child process over ZMQ (synchronous and asyncio).

The multi-process clients own the engine process: they start it, wait for its ready response (what its start-up
settled, applied to the frontend's config), send requests on one socket, receive batched outputs on another in a
background thread, and notice within a second when the process dies (every waiter then gets EngineDeadError
instead of hanging).
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import pickle
import queue
import shutil
import tempfile
import threading
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Any, Callable, Optional

import msgspec
import zmq

from pagedllm.config import EngineConfig
from pagedllm.engine.core import EngineCore
from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.engine.launch import start_engine_core
from pagedllm.engine.protocol import (EngineCoreOutputs, EngineCoreReadyResponse, EngineCoreRequest,
                                      EngineCoreRequestType, SchedulerStats)
from pagedllm.engine.stopping import STOP_TIMEOUT_S, stop_processes
from pagedllm.forkserver import Process, process_identity
from pagedllm.envs import env_flag
from pagedllm.executor.abstract import WorkerMethod
from pagedllm.models.hf_config import load_tokenizer

logger = logging.getLogger(__name__)

ENGINE_STARTUP_TIMEOUT_S = 600
OUTPUT_POLL_MS = 100
SHUT_DOWN_MESSAGE = "The engine has been shut down (shutdown()); start a new one to generate."


def multiprocessing_enabled() -> bool:
    """PAGEDLLM_ENABLE_MULTIPROCESSING=0 runs the engine core in the caller's process (vLLM's
    VLLM_ENABLE_V1_MULTIPROCESSING)."""
    return env_flag("PAGEDLLM_ENABLE_MULTIPROCESSING", True)


class InprocClient:
    """The engine core as a plain object: step() runs in the caller's thread."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine_core = EngineCore(config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.engine_core.reset_prefix_cache(reset_running_requests)

    def get_stats(self) -> SchedulerStats:
        return self.engine_core.get_stats()

    def collective_rpc(self, method: WorkerMethod, timeout: Optional[float] = None, args: tuple = (),
                       kwargs: Optional[dict] = None) -> list:
        return self.engine_core.collective_rpc(method, timeout, args, kwargs)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.engine_core.sleep(level, mode)

    def wake_up(self, tags: Optional[list[str]] = None) -> bool:
        return self.engine_core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine_core.is_sleeping()

    def profile(self, is_start: bool = True, profile_prefix: Optional[str] = None) -> None:
        self.engine_core.profile(is_start, profile_prefix)

    def call_utility(self, method: str, *args: Any) -> Any:
        """An EngineCore method's result (the LoRA management calls)."""
        return getattr(self.engine_core, method)(*args)

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """``timeout``: vLLM's, for an engine process; none here (vLLM's InprocClient ignores it too)."""
        self.engine_core.shutdown()


class MPClient:
    """Starts the EngineCore process and bridges its sockets to in-process callbacks. With ``wait=False`` the
    constructor returns once the process is started, and the caller calls ``wait_until_ready`` before using the
    client (so that several engines start at the same time)."""

    def __init__(self, config: EngineConfig, on_outputs: Callable[[Any], None], wait: bool = True) -> None:
        self._config = config  # the frontend's: the engine's ready response updates it
        self._ipc_dir = tempfile.mkdtemp(prefix="pagedllm-")
        input_address = f"ipc://{self._ipc_dir}/input"
        output_address = f"ipc://{self._ipc_dir}/output"
        self._ctx = zmq.Context()
        self._input_socket = self._ctx.socket(zmq.PUSH)
        self._input_socket.bind(input_address)
        # The input socket's every use, a send or its close: ZMQ sockets are not thread-safe, and callers send from
        # any thread (an LLM's users, AsyncLLM's loop beside a utility call from another thread, a shutdown).
        self._input_lock = threading.Lock()
        self._output_socket = self._ctx.socket(zmq.PULL)
        self._output_socket.bind(output_address)
        self._encoder = msgspec.msgpack.Encoder()
        self._on_outputs = on_outputs
        self._utility_calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self.death_reason: Optional[str] = None  # what the engine said as it failed, if it could
        # Set once the engine process has died (not when shut down), with its last words, or the output thread failed:
        # the error every caller gets (_fail)
        self.dead_error: Optional[EngineDeadError] = None
        self._fail_lock = threading.Lock()
        self._closing = False
        # Forked by the fork server or a fresh interpreter (launch.py), never a fork of this process (unsafe once
        # torch's OpenMP threads exist) or multiprocessing's spawn (which re-runs an unguarded __main__ script): the
        # config travels as a pickle file.
        config_path = os.path.join(self._ipc_dir, "config.pkl")
        with open(config_path, "wb") as f:
            pickle.dump((config, input_address, output_address, process_identity(os.getpid())), f)
        self._output_thread_handle: Optional[threading.Thread] = None
        self._output_thread_running = False  # until it has left: the output socket is its alone (_close_output)
        self._output_lock = threading.Lock()
        self.proc: Optional[Process] = None
        try:
            self.proc = start_engine_core(config_path)
        except BaseException:  # a Ctrl-C or SIGTERM while the fork server still imports: the sockets, their ZMQ
            self.shutdown()  # context (whose collection would wait on them for ever) and the directory go with it
            raise
        if wait:
            self.wait_until_ready()

    def wait_until_ready(self) -> None:
        """Blocks until the engine process is up, then starts the threads that take its outputs and notice its
        death. Anything that ends the wait (an engine that fails or takes too long to start, a Ctrl-C) shuts the
        client down, engine process and its workers with it, before it propagates (vLLM's MPClient)."""
        try:
            self._wait_for_ready_message()
        except BaseException:
            self.shutdown()
            raise
        self._output_thread_running = True
        self._output_thread_handle = threading.Thread(target=self._output_thread, daemon=True,
                                                      name="EngineCoreClientOutput")
        self._output_thread_handle.start()
        threading.Thread(target=self._monitor_thread, daemon=True, name="EngineCoreMonitor").start()

    def _wait_for_ready_message(self) -> None:
        poller = zmq.Poller()
        poller.register(self._output_socket, zmq.POLLIN)
        waited = 0.0
        while not poller.poll(timeout=500):
            waited += 0.5
            # Exited without even last words (given the ZMQ I/O thread a poll's time to deliver ones sent as it exited)
            if self.proc.poll() is not None and not poller.poll(timeout=OUTPUT_POLL_MS):
                raise RuntimeError("The engine process failed to start; see its log above.")
            if waited > ENGINE_STARTUP_TIMEOUT_S:
                raise TimeoutError(f"The engine process did not start in {ENGINE_STARTUP_TIMEOUT_S} s.")
        message = self._output_socket.recv()
        try:
            ready = msgspec.msgpack.decode(message, type=EngineCoreReadyResponse)
        except msgspec.DecodeError:
            raise RuntimeError(_startup_failure(message)) from None
        # What the engine's start-up settled (vLLM's _apply_ready_response); with data parallelism every engine
        # sizes the same cache, and the DP client sums their blocks (num_gpu_blocks) once all are ready.
        self._config.model_config.max_model_len = min(self._config.model_config.max_model_len, ready.max_model_len)
        self._config.scheduler_config.max_model_len = self._config.model_config.max_model_len
        self._config.cache_config.num_blocks = self.num_gpu_blocks = ready.num_gpu_blocks

    def _output_thread(self) -> None:
        """The only user of the output socket; it polls so that shutdown can stop it before closing. A message it
        cannot decode or handle ends the client as the engine's death does (_fail): this thread gone, no output
        would arrive again, and every request and utility call would wait for ever. The engine process, which no
        one can use then, is stopped here, not left holding its workers and memory until the client's shutdown;
        what else the client holds (its input socket, its directory) that shutdown still closes (_close, which
        joins this thread, so cannot run in it)."""
        decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        try:
            while not self._closing:
                if not self._output_socket.poll(timeout=OUTPUT_POLL_MS):
                    continue
                outputs = decoder.decode(self._output_socket.recv(copy=False).buffer)
                if outputs.engine_dead is not None:
                    self.death_reason = outputs.engine_dead
                elif outputs.utility_output is not None:
                    self._resolve_utility(outputs.utility_output)
                else:
                    self._on_outputs(outputs)
        except Exception as e:
            logger.exception("The engine client's output thread failed")
            self._fail(EngineDeadError(f"The engine client could not take the engine's outputs: "
                                       f"{type(e).__name__}: {e}"))
            stop_processes([self.proc], "EngineCore")  # its exit is no death (dead_error is set): the monitor is mute
        finally:
            self._output_thread_running = False
            self._close_output()

    @property
    def dead(self) -> bool:
        """Whether the engine process has died, or this client can no longer take its outputs (a shut-down engine
        is not dead)."""
        return self.dead_error is not None

    @property
    def error(self) -> Optional[EngineDeadError]:
        """What a call raises now, a new exception each time (EngineDeadError.anew): the engine's death where it died
        (also once shut down after: the death is what the caller needs to know), else the shut-down error once shut
        down; None while the engine serves."""
        if self.dead_error is not None:
            return self.dead_error.anew()
        return EngineDeadError(SHUT_DOWN_MESSAGE) if self._closing else None

    def _monitor_thread(self) -> None:
        """The engine is dead to callers only once its error, with its last words, is known (dead_error): the first
        call after a death (an engine that died idle, before any request) raises it as every later one does. Until
        then a send waits (_send), and the futures registered meanwhile are failed with it here."""
        self.proc.wait()
        if self._closing:
            return
        if self._output_thread_handle is not None:  # it may still hold the engine's last words
            self._output_thread_handle.join(timeout=2 * OUTPUT_POLL_MS / 1000)
        self._fail(EngineDeadError(f"The engine process died: {self.death_reason}" if self.death_reason
                                   else EngineDeadError().args[0]))

    def _fail(self, error: EngineDeadError) -> None:
        """Ends the client with ``error``, once (the first of the engine's death and the output thread's failure):
        every later call raises it, and every caller waiting gets it (the utility calls' futures, and the outputs'
        taker through on_outputs)."""
        with self._fail_lock:
            if self.dead_error is not None:
                return
            self.dead_error = error
        self._fail_utility_calls(error)
        self._on_outputs(error)

    def _fail_utility_calls(self, error: EngineDeadError) -> None:
        """Every utility call still waiting gets ``error`` and is forgotten (one answered or cancelled meanwhile is
        left as it is): after a death, or once shut down, no answer will come."""
        for call_id in list(self._utility_calls):
            future = self._utility_calls.pop(call_id, None)
            if future is not None:
                with contextlib.suppress(InvalidStateError):
                    future.set_exception(error)

    def _resolve_utility(self, result) -> None:
        future = self._utility_calls.pop(result.call_id, None)
        if future is None:
            return
        # Its caller may give up at any moment (an asyncio task cancelled while it waited: asyncio.wrap_future cancels
        # the future from the loop's thread), also between a check and the set: then the answer is dropped.
        with contextlib.suppress(InvalidStateError):
            if result.failure_message:
                future.set_exception(RuntimeError(result.failure_message))
            else:
                future.set_result(result.result)

    def _send(self, request_type: EngineCoreRequestType, payload: Any) -> None:
        """Sends without ever blocking for good: a PUSH socket whose engine has gone (dead, before the monitor has
        said so) blocks a plain send for ever, which froze the caller (the server's event loop); the send waits
        instead while the engine's queue is full or the monitor has not yet said the engine died. Each try holds
        the input lock, and looks at the error under it: a client closing is marked so (stop_clients) before its
        socket is closed under the lock (_close), so no send reaches a closed socket."""
        frames = (request_type.value, self._encoder.encode(payload))
        while True:
            with self._input_lock:
                error = self.error
                if error is not None:
                    raise error
                try:
                    return self._input_socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    self._input_socket.poll(timeout=OUTPUT_POLL_MS, flags=zmq.POLLOUT)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not (self.dead or self._closing):
            self._send(EngineCoreRequestType.ABORT, list(request_ids))

    def call_utility(self, method: str, *args: Any) -> Future:
        call_id = next(self._call_ids)
        future: Future = Future()
        self._utility_calls[call_id] = future
        try:
            self._send(EngineCoreRequestType.UTILITY, (call_id, method, list(args)))
        except BaseException:  # not sent (a dead or shut-down engine): no answer will come for it
            self._utility_calls.pop(call_id, None)
            raise
        return future

    def collective_rpc(self, method: WorkerMethod, timeout: Optional[float], args: tuple,
                       kwargs: Optional[dict]) -> Future:
        """The future of the workers' results (EngineCore.collective_rpc): the call and its results cross the
        sockets pickled (EngineCoreProc.collective_rpc_pickled)."""
        import cloudpickle  # only for this call, which may send a function
        future: Future = Future()

        def unpickle(call: Future) -> None:
            try:
                future.set_result(pickle.loads(call.result()))
            except Exception as e:  # the engine's error, or results this process cannot load
                future.set_exception(e)

        self.call_utility("collective_rpc_pickled", cloudpickle.dumps((method, timeout, args, kwargs))
                          ).add_done_callback(unpickle)
        return future

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Stops the engine process: SIGTERM, then a kill if it has not exited within ``timeout`` seconds (vLLM's;
        None: STOP_TIMEOUT_S)."""
        stop_clients([self], timeout)

    def _close(self) -> None:
        """What is left once the engine process is gone: the output thread, the sockets, the directory."""
        with self._input_lock:
            self._input_socket.close(linger=0)
        if self._output_thread_handle is not None:
            self._output_thread_handle.join(timeout=2 * OUTPUT_POLL_MS / 1000)
        self._fail_utility_calls(EngineDeadError(SHUT_DOWN_MESSAGE))  # a thread waiting on one would wait for ever
        self._close_output()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def _close_output(self) -> None:
        """Closes the output socket and the ZMQ context once the client is closed (its input socket closed, which
        the context's term waits for) and the output thread has left, whichever comes last: ZMQ sockets are not
        thread-safe, and a close whose join of the thread timed out (a thread busy with a large message, or not
        scheduled on a busy machine) would close the socket under the thread, which may be polling it."""
        with self._output_lock:
            if self._input_socket.closed and not self._output_thread_running and not self._output_socket.closed:
                self._output_socket.close(linger=0)
                self._ctx.term()


def _startup_failure(message: bytes) -> str:
    """The error for an engine's first message that is no ready response: the engine's own, where it sent why it
    failed to start (core_proc.report_startup_failure)."""
    try:
        reason = msgspec.msgpack.decode(message, type=EngineCoreOutputs).engine_dead
    except msgspec.DecodeError:
        reason = None
    return (f"The engine process failed to start: {reason}" if reason
            else "Unexpected first message from the engine process.")


def stop_clients(clients: list[MPClient], timeout: Optional[float] = None) -> None:
    """Stops the engine processes of ``clients`` together (SIGTERM to all, then one wait within ``timeout``, vLLM's
    engine manager's), then closes what each held; a client already shut down is left as it is. Each is marked
    closing first, so that its monitor takes the process's exit for the shutdown it is, not a death."""
    clients = [client for client in clients if not client._closing]
    for client in clients:
        client._closing = True
    stop_processes([client.proc for client in clients if client.proc is not None], "EngineCore",
                   STOP_TIMEOUT_S if timeout is None else timeout)
    for client in clients:
        client._close()


class SyncMPClient:
    """For the synchronous LLMEngine: get_output() blocks until the engine's next batch of outputs."""

    def __init__(self, config: EngineConfig) -> None:
        self._outputs: queue.Queue = queue.Queue()
        self._error: Optional[EngineDeadError] = None  # the first error get_output took: raised from then on
        self._mp = MPClient(config, self._outputs.put)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._mp.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._mp.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        """The engine's next outputs. A dead engine stays dead: the first error taken (its death, or the shut-down
        error) is raised at every later call too (anew), none waits, and none says otherwise (the shut-down error
        that a shutdown after the death queues behind it)."""
        if self._error is None:
            outputs = self._outputs.get()
            if not isinstance(outputs, EngineDeadError):
                return outputs
            self._error = outputs
        raise self._error.anew()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self._mp.call_utility("reset_prefix_cache", reset_running_requests).result()

    def get_stats(self) -> SchedulerStats:
        return msgspec.convert(self._mp.call_utility("get_stats").result(), SchedulerStats)

    def collective_rpc(self, method: WorkerMethod, timeout: Optional[float] = None, args: tuple = (),
                       kwargs: Optional[dict] = None) -> list:
        return self._mp.collective_rpc(method, timeout, args, kwargs).result()

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self._mp.call_utility("sleep", level, mode).result()

    def wake_up(self, tags: Optional[list[str]] = None) -> bool:
        return self._mp.call_utility("wake_up", tags).result()

    def is_sleeping(self) -> bool:
        return self._mp.call_utility("is_sleeping").result()

    def profile(self, is_start: bool = True, profile_prefix: Optional[str] = None) -> None:
        self._mp.call_utility("profile", is_start, profile_prefix).result()

    def call_utility(self, method: str, *args: Any) -> Any:
        return self._mp.call_utility(method, *args).result()

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Stops the engine. An engine shut down sends nothing more, and its exit is no death the monitor reports:
        a get_output() waiting (another thread's step, or the one a signal handler that shuts down interrupted)
        raises this error instead of waiting for ever, as every later one does."""
        self._mp.shutdown(timeout)
        self._outputs.put(EngineDeadError(SHUT_DOWN_MESSAGE))


class LoopQueue:
    """Items put from any thread, got in an asyncio event loop: the loop of the first get(). Those put before it wait
    there in order, so that an async client may be made before its loop runs (vLLM's AsyncLLM may be: a script
    makes the engine, then asyncio.run()s what uses it), while the engine's first outputs already arrive."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._queue: Optional[asyncio.Queue] = None
        self._early: list = []  # put before the loop was known

    def put(self, item: Any) -> None:
        with self._lock:
            if self._loop is None:
                self._early.append(item)
                return
            loop, target = self._loop, self._queue
        if not loop.is_closed():  # else no one is left to take it, and the thread putting it must live on
            loop.call_soon_threadsafe(target.put_nowait, item)

    async def get(self) -> Any:
        if self._queue is None:
            with self._lock:  # on the loop's thread: no item put after this can be handed over before these
                self._loop, self._queue = asyncio.get_running_loop(), asyncio.Queue()
                for item in self._early:
                    self._queue.put_nowait(item)
                self._early = []
        return await self._queue.get()


class AsyncMPClient:
    """For AsyncLLM: outputs arrive on a LoopQueue, for the event loop that takes them."""

    def __init__(self, config: EngineConfig) -> None:
        self._outputs = LoopQueue()
        self._mp = MPClient(config, self._outputs.put)

    @property
    def proc(self) -> Process:
        return self._mp.proc

    @property
    def dead(self) -> bool:
        return self._mp.dead

    @property
    def dead_error(self) -> Optional[EngineDeadError]:
        return self._mp.dead_error

    def add_request(self, request: EngineCoreRequest) -> None:
        self._mp.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._mp.abort_requests(request_ids)

    async def get_output_async(self) -> EngineCoreOutputs:
        outputs = await self._outputs.get()
        if isinstance(outputs, Exception):
            raise outputs
        return outputs

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        return await asyncio.wrap_future(self._mp.call_utility(method, *args))

    async def collective_rpc_async(self, method: WorkerMethod, timeout: Optional[float] = None, args: tuple = (),
                                   kwargs: Optional[dict] = None) -> list:
        return await asyncio.wrap_future(self._mp.collective_rpc(method, timeout, args, kwargs))

    def shutdown(self, timeout: Optional[float] = None) -> None:
        self._mp.shutdown(timeout)


def make_sync_client(config: EngineConfig, multiprocess: bool = False):
    """The engine core in a process of its own where ``multiprocess`` or multiprocessing_enabled(), else in this
    one (data parallelism: a process per engine always)."""
    if config.parallel_config.data_parallel_size > 1:
        from pagedllm.engine.dp_client import DPSyncMPClient
        return DPSyncMPClient(config)
    return SyncMPClient(config) if multiprocess or multiprocessing_enabled() else InprocClient(config)


def make_async_client(config: EngineConfig):
    if config.parallel_config.data_parallel_size > 1:
        from pagedllm.engine.dp_client import DPAsyncMPClient
        return DPAsyncMPClient(config)
    return AsyncMPClient(config)


def start_client_and_tokenizer(config: EngineConfig, make_client: Callable[[EngineConfig], Any]) -> tuple[Any, Any]:
    """``make_client(config)`` (the engine started and ready) and the model's tokenizer, loaded meanwhile on a thread:
    the frontend mostly waits while its engine process starts. None for the tokenizer with skip_tokenizer_init."""
    if config.model_config.skip_tokenizer_init:
        return make_client(config), None
    with ThreadPoolExecutor(1, thread_name_prefix="load_tokenizer") as pool:
        tokenizer = pool.submit(load_tokenizer, config.model_config.tokenizer)
        client = make_client(config)
        try:
            return client, tokenizer.result()
        except BaseException:
            client.shutdown()
            raise
