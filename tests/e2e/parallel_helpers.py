"""What the tensor/pipeline-parallel tests share: the worker processes and queue segments an engine owns, so a test
can kill one rank and check that nothing is left behind."""
from __future__ import annotations

import glob
import time

import psutil

SHM_PATTERN = "/dev/shm/pagedllm_mq_*"


def worker_processes() -> list[psutil.Process]:
    """This test process's descendant MultiprocExecutor workers (alive, not zombies)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "pagedllm.executor.worker_proc" in child.cmdline():
                found.append(child)
        except psutil.Error:
            pass
    return found


def shm_segments() -> set[str]:
    return set(glob.glob(SHM_PATTERN))


def wait_until(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
