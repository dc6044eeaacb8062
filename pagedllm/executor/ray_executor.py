"""RayExecutor: one Ray actor per rank, placed by a placement group (one bundle per rank), so ranks may sit on
different machines of a Ray cluster (vLLM's Ray executor, with plain Ray calls).

The driver reaches every actor with one remote call per collective_rpc and waits on them together: the first to
fail (the actor raised, or its process or node died) ends the call with an error naming its rank, while the
others may still be blocked in a collective with it. Ranks meet for torch.distributed at rank 0's node.
Ray is an optional extra: ``pip install 'pagedllm[ray]'``.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Optional

from pagedllm.executor.abstract import Executor, WorkerMethod, run_worker_method
from pagedllm.executor.multiproc import WorkerError

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120
ALIVE_CHECK_S = 1.0  # how often an idle engine looks at the actors
ALIVE_WAIT_S = 0.2  # how long a look waits for their answers (an idle actor answers in milliseconds)
WAIT_SLICE_S = 0.5


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend='ray' needs Ray: pip install 'pagedllm[ray]'") from None
    return ray


def _join_or_start_cluster(ray, caller_address: Optional[str], world_size: int) -> None:
    """Connects this process to the cluster the frontend was in (its address travels in the config); else to the one
    this machine belongs to, as vLLM's ray.init(address=None) finds it (RAY_ADDRESS, or the cluster `ray start`
    began here: how `pagedllm serve`, which never joins one itself, reaches a multi-node cluster); else starts a
    local one with a logical CPU per rank even where ranks outnumber cores. Ray refuses num_cpus (a ValueError,
    before it connects) exactly when it finds such a cluster to join."""
    if caller_address:
        ray.init(address=caller_address, log_to_driver=True)
        return
    try:
        ray.init(num_cpus=max(os.cpu_count() or 1, world_size), include_dashboard=False)
    except ValueError:
        ray.init(log_to_driver=True)


class RayWorkerWrapper:
    """The actor around one rank's Worker: built empty (so the driver can ask where it runs), then given its
    rank and the rendezvous address."""

    def __init__(self) -> None:
        self.worker = None

    def get_node_ip(self) -> str:
        import ray
        return ray.util.get_node_ip_address()

    def get_open_port(self) -> int:
        from pagedllm.distributed.utils import get_open_port
        return get_open_port()

    def init_worker(self, config, rank: int, init_method: str) -> None:
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s Worker rank {rank} %(levelname)s %(message)s")
        from pagedllm.worker.worker import start_worker
        self.worker = start_worker(config, rank, init_method)

    def execute_method(self, method: WorkerMethod, args: tuple, kwargs: Optional[dict]) -> Any:
        return run_worker_method(self.worker, method, args, kwargs)


class RayExecutor(Executor):
    def _init_executor(self) -> None:
        ray = self.ray = _import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pc = self.parallel_config
        self.world_size = pc.world_size
        self._failure: Optional[str] = None
        self._started_ray = False
        self._last_alive_check = 0.0
        self.workers: list = []
        self.placement_group = None
        if not ray.is_initialized():
            _join_or_start_cluster(ray, pc.ray_address, self.world_size)
            self._started_ray = True
        try:
            self.placement_group = placement_group([{"CPU": 1}] * self.world_size, strategy="PACK")
            ray.get(self.placement_group.ready(), timeout=PLACEMENT_TIMEOUT_S)
            actor_class = ray.remote(num_cpus=1)(RayWorkerWrapper)
            env = {"runtime_env": {"env_vars": {k: v for k, v in os.environ.items() if k.startswith("PAGEDLLM_")}}}
            self.workers = [
                actor_class.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=rank), **env).remote()
                for rank in range(self.world_size)]
            ip, port = ray.get([self.workers[0].get_node_ip.remote(), self.workers[0].get_open_port.remote()])
            init_method = f"tcp://{ip}:{port}"
            self._wait([w.init_worker.remote(self.config, rank, init_method) for rank, w in enumerate(self.workers)],
                       None)
        except BaseException:
            self.shutdown()
            raise
        nodes = ray.get([w.get_node_ip.remote() for w in self.workers])
        logger.info("RayExecutor: %d workers on nodes %s", self.world_size, nodes)

    def collective_rpc(self, method: WorkerMethod, args: tuple = (), kwargs: Optional[dict] = None,
                       timeout: Optional[float] = None, unique_reply_rank: Optional[int] = None) -> Any:
        if self._failure is not None:
            raise WorkerError(self._failure)
        return self.submit_rpc(method, args, kwargs, unique_reply_rank, timeout).result()

    def submit_rpc(self, method: WorkerMethod, args: tuple = (), kwargs: Optional[dict] = None,
                   unique_reply_rank: Optional[int] = None, timeout: Optional[float] = None) -> "_RayReplies":
        if self._failure is not None:
            raise WorkerError(self._failure)
        refs = [w.execute_method.remote(method, args, kwargs) for w in self.workers]
        return _RayReplies(self, refs, unique_reply_rank, timeout)

    @property
    def max_concurrent_batches(self) -> int:
        return self.parallel_config.pipeline_parallel_size

    def check_workers_alive(self) -> None:
        """A look at each actor, a call it answers at once while it lives (the actors are no processes of this
        one): a dead one fails the executor now, so an idle engine ends then, not at the next request. One that is
        merely slow to answer is left for the next look. At most one look every ALIVE_CHECK_S (the idle engine
        asks far more often)."""
        if self._failure is not None:
            raise WorkerError(self._failure)
        now = time.monotonic()
        if now - self._last_alive_check < ALIVE_CHECK_S:
            return
        self._last_alive_check = now
        refs = [w.get_node_ip.remote() for w in self.workers]
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=ALIVE_WAIT_S)
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        for ref in ready:
            try:
                self.ray.get(ref)
            except Exception as e:
                self._failure = f"worker rank {rank_of[ref]} died: {type(e).__name__}: {e}"
                raise WorkerError(self._failure) from None

    def _wait(self, refs: list, timeout: Optional[float]) -> list:
        """Every rank's result, in rank order; the first failure raises WorkerError naming its rank."""
        ray = self.ray
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list = [None] * len(refs)
        pending = list(refs)
        waited = 0.0
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=WAIT_SLICE_S)
            for ref in ready:
                try:
                    results[rank_of[ref]] = ray.get(ref)
                except Exception as e:
                    # Ray's error carries the actor's traceback, for the log; the failure, which the engine's error
                    # quotes to its clients (an HTTP error body), names the exception only.
                    logger.error("worker rank %d failed: %s", rank_of[ref], e)
                    cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) else e
                    self._failure = f"worker rank {rank_of[ref]} failed: {type(cause).__name__}: {cause}"
                    raise WorkerError(self._failure) from None
            waited += 0 if ready else WAIT_SLICE_S
            if timeout is not None and waited > timeout:
                self._failure = f"worker rank(s) {sorted(rank_of[r] for r in pending)} did not answer in {timeout} s"
                raise WorkerError(self._failure)
        return results

    def _shutdown(self) -> None:
        """Kills the actors and removes their placement group; stops the Ray this executor started."""
        ray = self.ray
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(self.placement_group)
            self.placement_group = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False


class _RayReplies:
    """The future of one submitted call (each actor runs its calls in order)."""

    def __init__(self, executor: RayExecutor, refs: list, unique_reply_rank: Optional[int], timeout: Optional[float]):
        self.executor, self.refs, self.unique_reply_rank, self.timeout = executor, refs, unique_reply_rank, timeout

    def result(self) -> Any:
        results = self.executor._wait(self.refs, self.timeout)
        return results[self.unique_reply_rank] if self.unique_reply_rank is not None else results
