"""EngineCoreProc: the EngineCore in its own process, talking to the frontend over ZMQ.

Socket I/O runs in two background threads that feed plain queues, so the busy loop never touches a socket:
it blocks on the input queue while idle (no spinning: on 2 cores a spinning engine steals the frontend's
core), and otherwise drains inputs, steps, and hands outputs to the sender.
"""
from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import sys
import threading
import time
from typing import Any

import msgspec
import zmq

from pagedllm.config import EngineConfig
from pagedllm.engine.core import EngineCore
from pagedllm.engine.protocol import (READY_MESSAGE, EngineCoreOutputs, EngineCoreRequest,
                                      EngineCoreRequestType, UtilityOutput)

logger = logging.getLogger(__name__)

PARENT_POLL_SECONDS = 1.0
_SHUTDOWN = object()


class EngineCoreProc(EngineCore):
    def __init__(self, config: EngineConfig, input_address: str, output_address: str) -> None:
        super().__init__(config)
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
        threading.Thread(target=self._output_thread, daemon=True, name="EngineCoreOutput").start()

    # ---------------------------------------------------------------------------------- socket threads
    def _input_thread(self) -> None:
        while True:
            request_type, payload = self._input_socket.recv_multipart(copy=False)
            request_type = EngineCoreRequestType(bytes(request_type.buffer))
            if request_type == EngineCoreRequestType.ADD:
                self.input_queue.put((request_type, self._decoder.decode(payload.buffer)))
            else:
                self.input_queue.put((request_type, self._generic_decoder.decode(payload.buffer)))

    def _output_thread(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        self._output_socket.send(READY_MESSAGE)
        while True:
            outputs = self.output_queue.get()
            if outputs is _SHUTDOWN:
                return
            self._output_socket.send(encoder.encode(outputs), copy=False)

    # ---------------------------------------------------------------------------------- busy loop
    def run_busy_loop(self) -> None:
        while True:
            self._process_input_queue()
            if self.scheduler.has_requests():
                outputs = self.step()
                if outputs.outputs or not self.scheduler.has_requests():
                    self.output_queue.put(outputs)

    def _process_input_queue(self) -> None:
        """Blocks while there is nothing to run; otherwise takes whatever arrived without waiting."""
        if not self.scheduler.has_requests():
            self._handle(*self.input_queue.get())
        while not self.input_queue.empty():
            self._handle(*self.input_queue.get_nowait())

    def _handle(self, request_type: EngineCoreRequestType, payload: Any) -> None:
        if request_type == EngineCoreRequestType.ADD:
            self.add_request(payload)
        elif request_type == EngineCoreRequestType.ABORT:
            self.abort_requests(payload)
            if not self.scheduler.has_requests():  # idle now: report the freed capacity at once
                self.output_queue.put(EngineCoreOutputs(scheduler_stats=self.get_stats()))
        else:
            call_id, method, args = payload
            self.output_queue.put(EngineCoreOutputs(utility_output=self._call_utility(call_id, method, args)))

    def _call_utility(self, call_id: int, method: str, args: list) -> UtilityOutput:
        if method not in ("reset_prefix_cache", "get_stats", "abort_requests"):
            return UtilityOutput(call_id, failure_message=f"unknown utility method {method!r}")
        try:
            return UtilityOutput(call_id, result=getattr(self, method)(*args))
        except Exception as e:  # the caller gets the error; the engine keeps serving
            return UtilityOutput(call_id, failure_message=f"{type(e).__name__}: {e}")


def _exit_when_parent_dies(parent_pid: int) -> None:
    """An orphaned engine would hold its memory forever: leave as soon as the frontend is gone."""
    while True:
        time.sleep(PARENT_POLL_SECONDS)
        if os.getppid() != parent_pid:
            os._exit(1)


def run_engine_core(config: EngineConfig, input_address: str, output_address: str, parent_pid: int) -> None:
    """Entry point of the engine process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the frontend's to handle; it stops us
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    threading.Thread(target=_exit_when_parent_dies, args=(parent_pid,), daemon=True).start()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s EngineCore %(levelname)s %(message)s")
    try:
        engine = EngineCoreProc(config, input_address, output_address)
    except Exception:
        logger.exception("EngineCore failed to start")
        raise
    engine.run_busy_loop()


def main() -> None:
    """`python -m pagedllm.engine.core_proc EngineCore CONFIG_PICKLE`, as started by the MP client."""
    with open(sys.argv[2], "rb") as f:
        config, input_address, output_address, parent_pid = pickle.load(f)
    run_engine_core(config, input_address, output_address, parent_pid)


if __name__ == "__main__":
    main()
