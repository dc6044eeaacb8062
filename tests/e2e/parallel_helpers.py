"""What the tensor/pipeline-parallel tests share: the engine and worker processes and queue segments an engine owns,
so a test can kill one rank and check that nothing is left behind. Engines and workers are found by their command
lines among this process's descendants: the fork server forks them, so they are its children, not their starters'."""
from __future__ import annotations

import glob
import time

import psutil

SHM_PATTERN = "/dev/shm/pagedllm_mq_*"


def command_line(process: psutil.Process) -> list[str]:
    """A process's arguments, for a fork server's child too, whose title (setproctitle: its `python -m` command
    line) /proc shows as one string padded with NULs."""
    return " ".join(process.cmdline()).split()


def worker_processes() -> list[psutil.Process]:
    """This test process's descendant MultiprocExecutor workers (alive, not zombies)."""
    return _descendants_running("pagedllm.executor.worker_proc")


def engine_processes() -> list[psutil.Process]:
    """This test process's descendant EngineCore processes (alive, not zombies)."""
    return _descendants_running("EngineCore")


def _descendants_running(argument: str) -> list[psutil.Process]:
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and argument in command_line(child):
                found.append(child)
        except psutil.Error:
            pass  # gone meanwhile
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
