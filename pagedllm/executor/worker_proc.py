"""A worker process of the MultiprocExecutor: one rank's Worker and its busy loop.

Started as `python -m pagedllm.executor.worker_proc STARTUP_PICKLE RANK`. It builds its Worker (joining the
process groups, loading its slice of the model), attaches to the executor's broadcast queue, says READY, then
runs each call it reads: every rank runs every call, and replies when the call wants its reply or when it raised.
It exits when the executor's process is gone, so no worker outlives its engine.
"""
from __future__ import annotations

from pagedllm.gc_utils import freeze_gc_heap, pause_gc_for_startup

if __name__ == "__main__":  # a worker process, before its imports (gc_utils.py)
    pause_gc_for_startup()

import logging
import pickle
import signal
import sys
import threading

import zmq

from pagedllm.distributed.shm_broadcast import MessageQueue
from pagedllm.engine.core_proc import exit_when_parent_dies
from pagedllm.engine.stopping import dump_stacks_on_sigusr1
from pagedllm.executor.abstract import method_name, run_worker_method
from pagedllm.executor.multiproc import WORKER_STARTUP_TIMEOUT_S

logger = logging.getLogger(__name__)


def main() -> None:
    dump_stacks_on_sigusr1()
    startup_path, rank = sys.argv[1], int(sys.argv[2])
    with open(startup_path, "rb") as f:
        config, init_method, mq_handle, reply_address, parent = pickle.load(f)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the executor stops us
    # The executor's stop ends us at once, also inside a blocking call (a rendezvous with a rank that never came, a
    # collective with a dead peer), where a Python handler would wait for the call to return.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    threading.Thread(target=exit_when_parent_dies, args=(parent, []), daemon=True).start()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s Worker rank {rank} %(levelname)s %(message)s")

    from pagedllm.worker.worker import start_worker  # after the logging set-up: its import is the slow part
    worker = start_worker(config, rank, init_method)

    ctx = zmq.Context()
    replies = ctx.socket(zmq.PUSH)
    replies.connect(reply_address)
    mq = MessageQueue.create_from_handle(mq_handle, rank)
    freeze_gc_heap()
    replies.send(pickle.dumps((-1, rank, True, "READY")))
    # The go-ahead comes once every rank has loaded, which may be long after this one (uneven pipeline stages, a
    # cold disk): as long as the executor gives them all (an executor that dies is the watchdog's to notice).
    mq.wait_until_ready(timeout=WORKER_STARTUP_TIMEOUT_S)
    while True:
        seq, method, args, kwargs, reply_rank = mq.dequeue()
        try:
            result = run_worker_method(worker, method, args, kwargs)
        except Exception as e:  # the traceback goes to this log; the reply, which the engine's error quotes to its
            # clients (an HTTP error body), names the exception only
            logger.exception("%s failed", method_name(method))
            replies.send(pickle.dumps((seq, rank, False, f"{type(e).__name__}: {e}")))
            continue
        if reply_rank is None or reply_rank == rank:
            replies.send(pickle.dumps((seq, rank, True, result), protocol=pickle.HIGHEST_PROTOCOL))


if __name__ == "__main__":
    main()
