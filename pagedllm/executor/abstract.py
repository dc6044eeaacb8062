"""Executor: how the engine core reaches its workers. Everything it does is a collective_rpc: one worker method
run on every rank, its results gathered (vLLM V1's Executor)."""
from __future__ import annotations

import logging
import os
import threading
from abc import ABC, abstractmethod
from typing import Any, Callable, Optional, Protocol, Union

from pagedllm.config import EngineConfig, ParallelConfig
from pagedllm.core.sched.output import SchedulerOutput
from pagedllm.worker.outputs import ModelRunnerOutput

logger = logging.getLogger(__name__)

# A worker method by name, or a function called with the worker as its first argument (which an executor whose
# workers are other processes sends as cloudpickle's bytes, as vLLM's).
WorkerMethod = Union[str, Callable[..., Any], bytes]

# How long a step may take before its workers are taken for hung (alive but not answering: a stopped process, a
# deadlocked collective) and the engine fails, as vLLM's VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS.
EXECUTE_MODEL_TIMEOUT_S = float(os.environ.get("PAGEDLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "300"))


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.parallel_config = config.parallel_config
        # The rank whose ModelRunnerOutput the engine gets: TP rank 0 of the last pipeline stage.
        pc = self.parallel_config
        self.output_rank = (pc.pipeline_parallel_size - 1) * pc.tensor_parallel_size
        # Before the workers start (a failed start shuts down). Re-entrant: the frontend's SIGTERM, whose handler
        # shuts down, may land on the main thread inside shutdown (after a failed step), which must return at once
        # there, not wait for itself for ever.
        self._shutdown_lock = threading.RLock()
        self._shut_down = False
        self._init_executor()

    @staticmethod
    def get_class(parallel_config: ParallelConfig) -> type["Executor"]:
        """The executor for ``distributed_executor_backend`` (resolved by EngineArgs)."""
        backend = parallel_config.distributed_executor_backend or ("uni" if parallel_config.world_size == 1 else "mp")
        if backend == "uni":
            from pagedllm.executor.uniproc import UniProcExecutor
            return UniProcExecutor
        if backend == "mp":
            from pagedllm.executor.multiproc import MultiprocExecutor
            return MultiprocExecutor
        from pagedllm.executor.ray_executor import RayExecutor
        return RayExecutor

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers, join them into process groups and load the model."""

    @abstractmethod
    def collective_rpc(self, method: WorkerMethod, args: tuple = (), kwargs: Optional[dict] = None,
                       timeout: Optional[float] = None, unique_reply_rank: Optional[int] = None) -> Any:
        """Run ``method`` on every worker; the list of their results in rank order, or only rank
        ``unique_reply_rank``'s result. A worker that raises or dies raises here (naming its rank); ``timeout``
        (seconds) bounds the wait."""

    def determine_num_kv_blocks(self) -> int:
        """The number of KV blocks every worker can hold: the minimum over the ranks."""
        return min(self.collective_rpc("determine_num_kv_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", args=(num_blocks,))

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False
                      ) -> Union[ModelRunnerOutput, "ModelRunnerOutputFuture"]:
        """The step's output; with ``non_block``, a future of it (the call is under way when this returns)."""
        if non_block:
            return self.submit_rpc("execute_model", args=(scheduler_output,), unique_reply_rank=self.output_rank,
                                   timeout=EXECUTE_MODEL_TIMEOUT_S)
        return self.collective_rpc("execute_model", args=(scheduler_output,), unique_reply_rank=self.output_rank,
                                   timeout=EXECUTE_MODEL_TIMEOUT_S)

    def submit_rpc(self, method: WorkerMethod, args: tuple = (), kwargs: Optional[dict] = None,
                   unique_reply_rank: Optional[int] = None, timeout: Optional[float] = None
                   ) -> "ModelRunnerOutputFuture":
        """collective_rpc without waiting (``timeout`` bounds the wait for its result): executors that can overlap
        calls override it."""
        return _Done(self.collective_rpc(method, args, kwargs, timeout=timeout, unique_reply_rank=unique_reply_rank))

    def check_health(self) -> None:
        """Raises if a worker is gone or does not answer."""
        self.collective_rpc("check_health", timeout=10)

    def check_workers_alive(self) -> None:
        """Raises if a worker process has exited (a cheap look, no call: what an idle engine checks between
        waits, so that a worker lost while nothing runs ends the engine then, not at the next request). Executors
        whose workers are not processes of this one have nothing to look at."""

    @property
    def max_concurrent_batches(self) -> int:
        """Batches the engine core may keep in flight: one per pipeline stage (stages then overlap) where calls
        can overlap, else 1."""
        return 1

    def shutdown(self) -> None:
        """Stops the workers and releases what they hold (_shutdown), once. Callable from any thread, more than once:
        a second caller (the engine's main thread while the parent-death watchdog's thread shuts down,
        core_proc.stop_in_main_thread) waits for the first to finish, so that the process does not exit with the
        cleanup half done, and nothing is stopped or released twice. A call on the thread already inside it (a
        signal handler's) returns at once."""
        with self._shutdown_lock:
            if self._shut_down:
                return
            self._shut_down = True
            self._shutdown()

    def _shutdown(self) -> None:
        """What shutdown does, once: executors with workers to stop override it."""


class ModelRunnerOutputFuture(Protocol):
    def result(self) -> Any: ...


class _Done:
    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self) -> Any:
        return self.value


def run_worker_method(worker: Any, method: WorkerMethod, args: tuple, kwargs: Optional[dict]) -> Any:
    """What a worker does with one collective_rpc (vLLM's run_method)."""
    if isinstance(method, bytes):
        import cloudpickle  # only where a function was sent: the engine's own calls name their methods
        method = cloudpickle.loads(method)
    if isinstance(method, str):
        return getattr(worker, method)(*args, **(kwargs or {}))
    return method(worker, *args, **(kwargs or {}))


def method_name(method: WorkerMethod) -> str:
    """How logs and errors name a worker method."""
    if isinstance(method, bytes):
        return "a pickled function"
    return method if isinstance(method, str) else getattr(method, "__qualname__", repr(method))


def run_user_method(method: WorkerMethod, args: tuple, kwargs: Optional[dict], worker: Any) -> tuple[bool, Any]:
    """A caller's collective_rpc (EngineCore.collective_rpc) on one worker: (True, its result), or (False, what it
    raised) — a reply, never a raise, which an executor takes for a broken worker that ends the engine: as vLLM's,
    a caller's method that fails fails its call only, and the engine serves on. Sent bound to its method and
    arguments, so that an executor sends them all with cloudpickle (a lambda among the arguments too: apply_model's)."""
    try:
        return True, run_worker_method(worker, method, args, kwargs)
    except Exception as e:  # the traceback goes to the worker's log, the caller gets the exception
        logger.exception("collective_rpc %s failed", method_name(method))
        return False, f"{type(e).__name__}: {e}"
