"""EngineCoreProc: the EngineCore in its own process, talking to the frontend over ZMQ.

Socket I/O runs in two background threads that feed plain queues, so the busy loop never touches a socket:
it waits on the input queue while idle (no spinning: on 2 cores a spinning engine steals the frontend's
core; the wait wakes ten times a second to run a pending SIGTERM handler), and otherwise drains inputs, steps, and
hands outputs to the sender.
"""
from __future__ import annotations

from pagedllm.gc_utils import freeze_gc_heap, pause_gc_for_startup

if __name__ == "__main__":  # the engine process, before its imports (gc_utils.py)
    pause_gc_for_startup()

import logging
import os
import pickle
import queue
import select
import signal
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Optional, Union

import msgspec
import zmq

from pagedllm.config import EngineConfig
from pagedllm.engine.core import EngineCore, check_pause_args
from pagedllm.engine.protocol import (EngineCoreOutputs, EngineCoreReadyResponse, EngineCoreRequest,
                                      EngineCoreRequestType, UtilityOutput)
from pagedllm.engine.stopping import dump_stacks_on_sigusr1
from pagedllm.forkserver import process_identity

logger = logging.getLogger(__name__)

PARENT_POLL_SECONDS = 1.0
PARENT_DEATH_STOP_GRACE_S = 5.0  # for the main thread to begin the stop once the frontend is gone (stop_in_main_thread)
IDLE_WAKE_S = 0.1  # how late an idle engine may run its SIGTERM handler (_process_input_queue)
_SHUTDOWN = object()
_UNREADABLE = object()  # input_queue's entry for a message the input thread could not decode


class EngineCoreProc(EngineCore):
    def __init__(self, config: EngineConfig, input_address: str, output_address: str) -> None:
        super().__init__(config)
        # pause_scheduler(mode="wait") until the requests in flight finish: what completes each pending pause once
        # the engine is idle, and the requests added meanwhile, held back from the scheduler until then (vLLM's
        # PAUSED_NEW: they queue, the others run on).
        self._idle_state_callbacks: list[Callable[[], None]] = []
        self._held_requests: list[EngineCoreRequest] = []
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        self._generic_decoder = msgspec.msgpack.Decoder()
        self._ctx = zmq.Context()
        self._input_socket = self._ctx.socket(zmq.PULL)
        self._input_socket.connect(input_address)
        self._output_socket = self._ctx.socket(zmq.PUSH)
        self._output_socket.connect(output_address)
        threading.Thread(target=self._input_thread, daemon=True, name="EngineCoreInput").start()
        self._output_thread_handle = threading.Thread(target=self._output_thread, daemon=True,
                                                      name="EngineCoreOutput")
        self._output_thread_handle.start()

    # ---------------------------------------------------------------------------------- socket threads
    def _input_thread(self) -> None:
        """Decodes what the frontend sends into input_queue. A message it cannot read (a frontend bug: the
        Processor lets through only what the engine's types take) ends the engine, loudly, through the busy loop:
        this thread dying alone would leave the engine up but deaf, and every request waiting forever."""
        while True:
            request_type, payload = self._input_socket.recv_multipart(copy=False)
            try:
                request_type = EngineCoreRequestType(bytes(request_type.buffer))
                decoder = self._decoder if request_type == EngineCoreRequestType.ADD else self._generic_decoder
                self.input_queue.put((request_type, decoder.decode(payload.buffer)))
            except Exception as e:
                self.input_queue.put((_UNREADABLE, e))
                return

    def _output_thread(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        self._output_socket.send(encoder.encode(EngineCoreReadyResponse(self.config.model_config.max_model_len,
                                                                        self.config.cache_config.num_blocks)))
        while True:
            outputs = self.output_queue.get()
            if outputs is _SHUTDOWN:
                return
            self._output_socket.send(encoder.encode(outputs), copy=False)

    def report_death(self, reason: str, flush_timeout: float = 2.0) -> None:
        """The last message to the frontend: every waiter's EngineDeadError carries ``reason``."""
        self.output_queue.put(EngineCoreOutputs(engine_dead=reason))
        self.output_queue.put(_SHUTDOWN)
        self._output_thread_handle.join(timeout=flush_timeout)

    # ---------------------------------------------------------------------------------- busy loop
    def run_busy_loop(self) -> None:
        while True:
            self._process_input_queue()
            if self.has_work():
                outputs = self.step()
                if outputs.outputs or not self.has_work():
                    self.output_queue.put(outputs)

    def _process_input_queue(self) -> None:
        """Waits while there is nothing to run; otherwise takes whatever arrived without waiting. The idle wait wakes
        every IDLE_WAKE_S: a Python signal handler runs only in the main thread, once it next runs bytecode, and the
        kernel may hand SIGTERM to another thread (any that does not block it), which does not interrupt the main
        thread's wait on a lock; an idle engine would then outlive the frontend's SIGTERM until it is killed. Each
        wake also looks at the workers, so that one that died meanwhile ends the engine (and /health says so). An
        engine asleep (sleep()) waits as an idle one does, whatever requests it holds."""
        while not self.has_work():
            self._notify_idle_state_callbacks()
            try:
                request = self.input_queue.get(timeout=IDLE_WAKE_S)
            except queue.Empty:
                self.executor.check_workers_alive()  # a worker lost while idle ends the engine now (vLLM's monitor)
                continue
            self._handle(*request)
            break
        while not self.input_queue.empty():
            self._handle(*self.input_queue.get_nowait())

    def _handle(self, request_type: EngineCoreRequestType, payload: Any) -> None:
        if request_type is _UNREADABLE:
            raise RuntimeError(f"The engine could not read a message from the frontend: {payload}")
        if request_type == EngineCoreRequestType.ADD:
            self.add_request(payload)
        elif request_type == EngineCoreRequestType.ABORT:
            self.abort_requests(payload)
            if not self.scheduler.has_requests():  # idle now: report the freed capacity at once
                self.output_queue.put(EngineCoreOutputs(scheduler_stats=self.get_stats()))
        else:
            self._call_utility(*payload)

    def _call_utility(self, call_id: int, method: str, args: list) -> None:
        """Answers the call on the output socket: now, or once the Future it returned (pause_scheduler and sleep in
        "wait" mode) is done, as vLLM's."""
        output = self._invoke_utility(call_id, method, args)
        if isinstance(output, Future):
            output.add_done_callback(lambda done: self.output_queue.put(EngineCoreOutputs(
                utility_output=_utility_output(call_id, done))))
        else:
            self.output_queue.put(EngineCoreOutputs(utility_output=output))

    def _invoke_utility(self, call_id: int, method: str, args: list) -> Union[UtilityOutput, Future]:
        if method not in ("reset_prefix_cache", "get_stats", "get_engine_view", "abort_requests",
                          "collective_rpc_pickled", "sleep", "wake_up", "is_sleeping", "profile", "pause_scheduler",
                          "resume_scheduler", "is_scheduler_paused", "add_lora", "remove_lora", "pin_lora",
                          "list_loras", "release_kv_cache_memory"):
            return UtilityOutput(call_id, failure_message=f"unknown utility method {method!r}")
        try:
            result = getattr(self, method)(*args)
        except Exception as e:  # the caller gets the error; the engine keeps serving
            return UtilityOutput(call_id, failure_message=f"{type(e).__name__}: {e}")
        return result if isinstance(result, Future) else UtilityOutput(call_id, result=result)

    # ---------------------------------------------------------------------------------- pause "wait"
    def add_request(self, request: EngineCoreRequest) -> None:
        if self._idle_state_callbacks:  # a pause is waiting for the requests in flight: this one waits for resume
            self._held_requests.append(request)
        else:
            super().add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        aborted = set(request_ids)
        self._held_requests = [r for r in self._held_requests if r.request_id not in aborted]
        super().abort_requests(request_ids)

    def pause_scheduler(self, mode: str = "abort", clear_cache: bool = True) -> Optional[Future]:
        """vLLM's EngineCoreProc's: "wait" schedules on until the requests in flight have finished, the requests
        added meanwhile held back; then the engine pauses as with "keep" (those requests waiting in the scheduler)
        and the Future this returns is done. With nothing in flight it pauses now (None)."""
        if mode != "wait":
            return super().pause_scheduler(mode, clear_cache)
        check_pause_args(mode, clear_cache)
        if not self.has_work():
            return super().pause_scheduler("keep", clear_cache)
        paused: Future = Future()

        def finish_pause() -> None:
            try:
                super(EngineCoreProc, self).pause_scheduler("keep", clear_cache)
                for request in self._held_requests:
                    super(EngineCoreProc, self).add_request(request)
                self._held_requests = []
            except Exception as e:
                paused.set_exception(e)
            else:
                paused.set_result(None)

        self._idle_state_callbacks.append(finish_pause)
        return paused

    def _notify_idle_state_callbacks(self) -> None:
        while self._idle_state_callbacks:
            self._idle_state_callbacks.pop(0)()

    def resume_scheduler(self) -> None:
        if self._idle_state_callbacks:
            raise RuntimeError("resume_scheduler called while a pause (mode 'wait') is still in flight; wait for it "
                               "to complete before resuming.")
        super().resume_scheduler()

    def is_scheduler_paused(self) -> bool:
        return self.paused or bool(self._idle_state_callbacks)

    def is_sleeping(self) -> bool:
        return self.is_scheduler_paused()

    def collective_rpc_pickled(self, call: bytes) -> bytes:
        """collective_rpc from the frontend: its call, (method, timeout, args, kwargs), comes pickled (cloudpickle's,
        which sends a lambda or a closure too) and its results go back pickled, for a worker method takes and returns
        any Python objects (as vLLM's utility calls do with its pickle-based serialization)."""
        return pickle.dumps(self.collective_rpc(*pickle.loads(call)), protocol=pickle.HIGHEST_PROTOCOL)


def _utility_output(call_id: int, done: Future) -> UtilityOutput:
    """A utility call's answer once the Future it returned is done."""
    error = done.exception()
    if error is not None:
        return UtilityOutput(call_id, failure_message=f"{type(error).__name__}: {error}")
    return UtilityOutput(call_id, result=done.result())


def exit_when_parent_dies(parent: tuple[int, Optional[int]], before_exit: list) -> None:
    """An orphaned engine would hold its memory forever: leave as soon as the frontend is gone (after
    ``before_exit``'s callbacks: the executor stops its workers). The frontend is ``parent`` (process_identity's),
    which need not be this process's parent (a fork server's child): its pidfd says when it exits, where the kernel
    has pidfds (a fork server forks nothing without them, so there the frontend is the parent, which a poll of
    getppid watches). A pidfd opened on the frontend's pid after the frontend died may be a later process's, which
    the frontend's start time tells apart: otherwise an engine (or a worker of an engine) that died while this
    process started would be taken for alive for as long as that stranger lives."""
    parent_pid = parent[0]
    try:
        pidfd = os.pidfd_open(parent_pid)
    except ProcessLookupError:  # gone already
        pass
    except (AttributeError, OSError):  # no pidfds here
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_SECONDS)
    else:
        if process_identity(parent_pid) == parent:  # read after the pidfd opened: it is the frontend's
            select.select([pidfd], [], [])
    for callback in before_exit:
        callback()
    os._exit(1)


def report_startup_failure(output_address: str, reason: str, flush_timeout: float = 2.0) -> None:
    """The last words of an engine that failed to start (EngineCoreProc's sockets may not exist yet), in place of its
    ready response: the client's start-up error carries ``reason``, as report_death's does a later death."""
    ctx = zmq.Context()
    socket = ctx.socket(zmq.PUSH)
    socket.setsockopt(zmq.LINGER, int(flush_timeout * 1000))  # how long close() may wait for it to be delivered
    try:
        socket.connect(output_address)
        socket.send(msgspec.msgpack.encode(EngineCoreOutputs(engine_dead=reason)))
    finally:
        socket.close()
        ctx.term()


def stop_in_main_thread(executor) -> None:
    """The parent-death watchdog's stop (exit_when_parent_dies): the main thread runs it, as the frontend's shutdown
    (SIGTERM, to this process: its handler stops the executor, then exits), for the executor's sockets and shared
    memory are the main thread's, busy with them in a step or a utility call: ZMQ sockets are not thread-safe, and a
    ring buffer unmapped under its writer crashes it. A main thread that has not begun the stop within
    PARENT_DEATH_STOP_GRACE_S (stuck in a call) is stopped for, by this thread: an orphaned engine must not hold its
    workers and memory for ever. Where it has begun, the executor's shutdown here waits for it to finish (it is
    callable from any thread, and once)."""
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(PARENT_DEATH_STOP_GRACE_S)
    executor.shutdown()


def _exit_while_starting(*_) -> None:
    """SIGTERM (the frontend's shutdown) before the engine is up: unwind, so that the engine's start-up gives back
    what it started (EngineCore's executor stops the workers it has launched)."""
    raise SystemExit(0)


def start_engine_core_proc(config: EngineConfig, input_address: str, output_address: str) -> EngineCoreProc:
    """The engine, built; where that raises, the frontend is told why (report_startup_failure) before the error
    propagates, the start-up's own error whether or not the telling worked."""
    try:
        return EngineCoreProc(config, input_address, output_address)
    except Exception as e:
        logger.exception("EngineCore failed to start")
        try:
            report_startup_failure(output_address, f"{type(e).__name__}: {e}")
        except Exception:
            logger.exception("Could not tell the frontend why")
        raise


def run_engine_core(config: EngineConfig, input_address: str, output_address: str,
                    parent: tuple[int, Optional[int]]) -> None:
    """Entry point of the engine process; ``parent``: the frontend's process_identity."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the frontend's to handle; it stops us
    signal.signal(signal.SIGTERM, _exit_while_starting)
    before_exit: list = []
    threading.Thread(target=exit_when_parent_dies, args=(parent, before_exit), daemon=True).start()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s EngineCore %(levelname)s %(message)s")
    engine = start_engine_core_proc(config, input_address, output_address)

    def stop(*_) -> None:  # the frontend's shutdown: stop the workers first, so none outlives us
        engine.executor.shutdown()
        os._exit(0)

    try:
        signal.signal(signal.SIGTERM, stop)
    except BaseException:  # a SIGTERM that came after the engine was built, before this handler
        engine.executor.shutdown()
        raise
    before_exit.append(lambda: stop_in_main_thread(engine.executor))
    freeze_gc_heap()
    try:
        engine.run_busy_loop()
    except Exception as e:  # a worker failed (or the loop broke): tell the frontend why, then go, workers too
        logger.exception("EngineCore failed")
        engine.report_death(f"{type(e).__name__}: {e}")
        raise
    finally:
        engine.executor.shutdown()


def main() -> None:
    """`python -m pagedllm.engine.core_proc EngineCore CONFIG_PICKLE`, as started by the MP client (launch.py)."""
    dump_stacks_on_sigusr1()
    with open(sys.argv[2], "rb") as f:
        config, input_address, output_address, parent = pickle.load(f)
    run_engine_core(config, input_address, output_address, parent)


if __name__ == "__main__":
    main()
