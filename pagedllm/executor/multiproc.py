"""MultiprocExecutor: one worker process per rank on this machine (vLLM V1's MultiprocExecutor).

Each call is broadcast to every worker through one shared-memory MessageQueue (the executor writes, each rank
reads); the replies come back on one ZMQ PULL socket, each tagged with its rank and the call's sequence number. A
call with ``unique_reply_rank`` (execute_model) gets a reply from that rank only, but any rank that raises
replies with its error, and a worker process that exits is noticed while waiting: either ends the call with an
error naming the rank within a poll interval, never a hang. Workers are forked by the fork server (or are fresh
interpreters where it cannot fork them), as the EngineCore process is, and exit when this process is gone; shutdown
stops them and unlinks the queue's segment.
"""
from __future__ import annotations

import logging
import os
import pickle
import shutil
import tempfile
import time
from typing import Any, Optional

import zmq

from pagedllm.distributed.shm_broadcast import MessageQueue
from pagedllm.distributed.utils import get_open_port
from pagedllm.engine.stopping import stop_processes
from pagedllm.executor.abstract import Executor, WorkerMethod
from pagedllm.forkserver import Process, process_identity, start_process

logger = logging.getLogger(__name__)

WORKER_STARTUP_TIMEOUT_S = 600
POLL_MS = 100
DEAD_PEER_GRACE_S = 1.0


class WorkerError(RuntimeError):
    """A worker raised or died; the message names its rank."""


class MultiprocExecutor(Executor):
    def _init_executor(self) -> None:
        pc = self.parallel_config
        self.world_size = pc.world_size
        if self.world_size > os.cpu_count():
            logger.warning("%d ranks on %d cores: ranks share cores and run slower than on fewer ranks",
                           self.world_size, os.cpu_count())
        self._seq = 0
        self._replies_of: dict[int, dict[int, Any]] = {}  # call seq -> replies so far, for calls not yet gathered
        self._failure: Optional[str] = None
        # Ranks that did not answer a call within its timeout: hung (a deadlock, a stopped process), so shutdown
        # does not give them SIGTERM's grace, which only delays the engine's failure (their stacks still dumped).
        self._hung_ranks: list[int] = []
        self._ipc_dir = tempfile.mkdtemp(prefix="pagedllm-workers-")
        self._ctx = zmq.Context()
        self._replies = self._ctx.socket(zmq.PULL)
        reply_address = f"ipc://{self._ipc_dir}/replies"
        self._replies.bind(reply_address)
        self._poller = zmq.Poller()
        self._poller.register(self._replies, zmq.POLLIN)
        self.rpc_broadcast_mq = MessageQueue(self.world_size)
        self.workers: list[Process] = []
        try:
            init_method = f"tcp://127.0.0.1:{get_open_port()}"
            startup = (self.config, init_method, self.rpc_broadcast_mq.export_handle(), reply_address,
                       process_identity(os.getpid()))
            startup_path = os.path.join(self._ipc_dir, "startup.pkl")
            with open(startup_path, "wb") as f:
                pickle.dump(startup, f)
            for rank in range(self.world_size):
                self.workers.append(start_process("pagedllm.executor.worker_proc", [startup_path, str(rank)]))
            self._replies_of[-1] = {}
            self._wait_for_replies(-1, set(range(self.world_size)), WORKER_STARTUP_TIMEOUT_S, starting=True)
            self.rpc_broadcast_mq.wait_until_ready(timeout=60)
        except BaseException:
            self.shutdown()
            raise
        logger.info("MultiprocExecutor: %d workers (tensor_parallel_size=%d, pipeline_parallel_size=%d)",
                    self.world_size, pc.tensor_parallel_size, pc.pipeline_parallel_size)

    def collective_rpc(self, method: WorkerMethod, args: tuple = (), kwargs: Optional[dict] = None,
                       timeout: Optional[float] = None, unique_reply_rank: Optional[int] = None) -> Any:
        return self.submit_rpc(method, args, kwargs, unique_reply_rank, timeout).result()

    def submit_rpc(self, method: WorkerMethod, args: tuple = (), kwargs: Optional[dict] = None,
                   unique_reply_rank: Optional[int] = None, timeout: Optional[float] = None) -> "_Replies":
        """Broadcast the call now; its replies are gathered when the returned future's result() is asked for
        (calls complete in order: every rank runs them in order)."""
        if self._failure is not None:
            raise WorkerError(self._failure)
        self._seq += 1
        if not isinstance(method, str):  # a function, maybe a lambda or a closure: cloudpickle's bytes, as vLLM's
            import cloudpickle
            method = cloudpickle.dumps(method, protocol=pickle.HIGHEST_PROTOCOL)
        self.rpc_broadcast_mq.enqueue((self._seq, method, args, kwargs or {}, unique_reply_rank), timeout=timeout,
                                      check_alive=self.check_workers_alive)  # a dead rank never frees its slots
        expected = set(range(self.world_size)) if unique_reply_rank is None else {unique_reply_rank}
        self._replies_of[self._seq] = {}
        return _Replies(self, self._seq, expected, unique_reply_rank, timeout)

    def _wait_for_replies(self, seq: int, expected: set[int], timeout: Optional[float],
                          starting: bool = False) -> dict[int, Any]:
        """Replies of call ``seq`` from the ranks ``expected`` (replies of later calls are kept for theirs);
        raises WorkerError on any rank's failure or exit, TimeoutError past ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        results = self._replies_of.setdefault(seq, {})
        while len(results) < len(expected):
            if self._poller.poll(POLL_MS):
                reply_seq, rank, ok, payload = pickle.loads(self._replies.recv())
                if not ok:
                    # A peer that died makes the others' collectives raise: name the dead rank, the cause.
                    deadline_dead = time.monotonic() + DEAD_PEER_GRACE_S
                    while not self._dead_workers() and time.monotonic() < deadline_dead:
                        time.sleep(POLL_MS / 1000)
                    dead = self._dead_workers()
                    if dead:
                        self._fail(f"{dead}; then worker rank {rank} raised: {payload.splitlines()[0]}")
                    self._fail(f"worker rank {rank} raised: {payload}")
                if rank in self._hung_ranks:  # it answers after all: no longer taken for hung
                    self._hung_ranks.remove(rank)
                if reply_seq in self._replies_of:
                    self._replies_of[reply_seq][rank] = payload
                continue  # a late reply of an earlier call that timed out: dropped
            dead = self._dead_workers(starting)
            if dead:
                self._fail(dead)
            if deadline is not None and time.monotonic() > deadline:
                # As vLLM's: a TimeoutError that fails this call only (a step's fails the engine, which it ends), its
                # late replies dropped; the ranks are taken for hung until they answer again.
                missing = sorted(expected - set(results))
                self._hung_ranks = missing
                del self._replies_of[seq]
                raise TimeoutError(f"worker rank(s) {missing} did not answer within {timeout} s")
        del self._replies_of[seq]
        return results

    def check_workers_alive(self) -> None:
        dead = self._dead_workers()
        if dead:
            self._fail(dead)

    def _dead_workers(self, starting: bool = False) -> str:
        """Which workers have exited, in words ("" if none)."""
        what = "failed to start" if starting else "died"
        return "; ".join(f"worker rank {rank} {what} (exit code {proc.poll()}); see its log above"
                         for rank, proc in enumerate(self.workers) if proc.poll() is not None)

    def _fail(self, message: str) -> None:
        self._failure = message
        raise WorkerError(message)

    @property
    def max_concurrent_batches(self) -> int:
        return self.parallel_config.pipeline_parallel_size

    def _shutdown(self) -> None:
        """Stops the workers and removes what they shared."""
        # The hung ranks first and at once (a stopped process acts on SIGTERM only once continued); the others end on
        # SIGTERM wherever they are (worker_proc), a peer blocked in a collective with a hung rank too.
        stop_processes([self.workers[rank] for rank in self._hung_ranks], "Hung worker", timeout=0)
        stop_processes(self.workers, "Worker")
        self.rpc_broadcast_mq.close()
        self._replies.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)


class _Replies:
    """The future of one submitted call."""

    def __init__(self, executor: MultiprocExecutor, seq: int, expected: set[int], unique_reply_rank: Optional[int],
                 timeout: Optional[float] = None):
        """``timeout``: the submitter's bound on the wait for the replies."""
        self.executor, self.seq, self.expected, self.unique_reply_rank = executor, seq, expected, unique_reply_rank
        self.timeout = timeout

    def result(self) -> Any:
        results = self.executor._wait_for_replies(self.seq, self.expected, self.timeout)
        if self.unique_reply_rank is not None:
            return results[self.unique_reply_rank]
        return [results[rank] for rank in range(self.executor.world_size)]
