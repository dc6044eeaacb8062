"""Stopping the engine's and the workers' processes, loudly when one will not stop.

A parent stops its children with SIGTERM and waits; a child still there after the wait is killed. Before it is
killed it is asked (SIGUSR1) to write every thread's Python stack to its stderr, which is the parent's: a process
that ignores SIGTERM is a bug (its handler exits at once), and the stacks say where it was stuck, where a silent
SIGKILL would only have cost the caller the wait.
"""
from __future__ import annotations

import faulthandler
import logging
import signal
import subprocess
import time

from pagedllm.forkserver import Process

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 5.0
_DUMP_WAIT_S = 0.5  # for faulthandler, which writes from its signal handler, to finish


def dump_stacks_on_sigusr1() -> None:
    """In a child process: SIGUSR1 writes all its threads' stacks to stderr (from the C signal handler, so also while
    the main thread is stuck outside the interpreter)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def stop_processes(procs: list[Process], what: str, timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM to every process of ``procs`` still running, then wait for them all within ``timeout``; any left
    then has its stacks dumped (dump_stacks_on_sigusr1), is named in an error and killed."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        proc.terminate()
    deadline = time.monotonic() + timeout
    for proc in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.error("%s (pid %d) did not exit within %g s of SIGTERM: its threads' stacks follow, then it is "
                         "killed", what, proc.pid, timeout)
            proc.send_signal(signal.SIGUSR1)
            time.sleep(_DUMP_WAIT_S)
            proc.kill()
            proc.wait()
