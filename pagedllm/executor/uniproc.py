"""UniProcExecutor: one worker, called directly in the engine core's process."""
from __future__ import annotations

from typing import Any, Optional

from pagedllm.executor.abstract import Executor, WorkerMethod, run_worker_method
from pagedllm.worker.worker import start_worker


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        self.worker = start_worker(self.config)

    def collective_rpc(self, method: WorkerMethod, args: tuple = (), kwargs: Optional[dict] = None,
                       timeout: Optional[float] = None, unique_reply_rank: Optional[int] = None) -> Any:
        result = run_worker_method(self.worker, method, args, kwargs)
        return result if unique_reply_rank is not None else [result]
