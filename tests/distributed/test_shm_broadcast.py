"""MessageQueue (pagedllm/distributed/shm_broadcast.py): one writer (this process) broadcasting to readers that are
fresh interpreters (tests/distributed/shm_reader.py). Exceptions: the timeout / cancel tests keep their reader in
this process, to time it directly, and one test runs the writer in a fresh interpreter too, with a reader started
by multiprocessing's spawn context."""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
import threading
import time

import psutil
import pytest

from pagedllm.distributed.shm_broadcast import DequeueCancelled, Handle, MessageQueue
from tests.distributed.shm_reader import make_message

READER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shm_reader.py")
WARNING_WORDS = ("resource_tracker", "leaked", "Warning", "Traceback")


def start_readers(mq: MessageQueue, mode: str = "collect", **spec) -> list[subprocess.Popen]:
    """One reader process per rank; spec["per_rank"][rank] overrides the spec for that rank."""
    handle = dataclasses.asdict(mq.export_handle())
    per_rank = spec.pop("per_rank", {})
    procs = []
    for rank in range(mq.export_handle().n_reader):
        args = {"handle": handle, "rank": rank, "mode": mode, **spec, **per_rank.get(rank, {})}
        procs.append(subprocess.Popen([sys.executable, READER, json.dumps(args)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def finish(procs: list[subprocess.Popen], timeout: float = 20) -> list[dict]:
    """Wait for the readers; check each exited cleanly without printing a warning; return their results."""
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, err
        assert not any(word in err for word in WARNING_WORDS), err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def wait_ready(mq: MessageQueue, procs: list[subprocess.Popen]) -> None:
    """The writer's handshake, showing the stderr of any reader that died before connecting."""
    try:
        mq.wait_until_ready(10)
    except TimeoutError:
        dead = [proc.communicate()[1] for proc in procs if proc.poll() is not None]
        raise AssertionError(f"readers did not connect; dead readers' stderr: {dead}") from None


def wait_line(proc: subprocess.Popen, expected: str = "ready") -> None:
    assert proc.stdout.readline().strip() == expected


@pytest.fixture
def cleanup():
    """Closes the queues and kills the readers a failed test leaves behind."""
    queues: list[MessageQueue] = []
    procs: list[subprocess.Popen] = []
    yield queues, procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for mq in queues:
        mq.close()


def make_writer(cleanup, *args, **kwargs) -> MessageQueue:
    mq = MessageQueue(*args, **kwargs)
    cleanup[0].append(mq)
    return mq


def assert_all_received(results: list[dict], count: int) -> None:
    for result in results:
        assert result["error"] is None, result
        assert result["received"] == count, result
        assert result["mismatch"] is None, result


def test_small_messages_reach_every_reader_in_order(cleanup):
    mq = make_writer(cleanup, n_reader=3)
    count = 1000
    procs = start_readers(mq, count=count)
    cleanup[1].extend(procs)
    wait_ready(mq, procs)
    for i in range(count):
        mq.enqueue(make_message(i), timeout=10)
    assert_all_received(finish(procs), count)


def test_messages_larger_than_a_slot_interleave_in_order(cleanup):
    slot = 4096
    mq = make_writer(cleanup, n_reader=2, max_chunk_bytes=slot, max_chunks=4)
    gen = {"large_every": 5, "large_size": 1 << 20, "edge_bytes": slot}
    count = 60
    sizes = [len(pickle.dumps(make_message(i, **gen), protocol=5)) for i in range(count)]
    assert sum(s > slot for s in sizes) >= 15 and sum(s <= slot for s in sizes) >= 30
    assert any(slot - 64 <= s <= slot for s in sizes) and any(slot < s <= slot + 64 for s in sizes)
    procs = start_readers(mq, count=count, gen=gen)
    cleanup[1].extend(procs)
    wait_ready(mq, procs)
    for i in range(count):
        mq.enqueue(make_message(i, **gen), timeout=10)
    assert_all_received(finish(procs), count)


def test_full_ring_makes_the_writer_wait_not_overwrite(cleanup):
    mq = make_writer(cleanup, n_reader=2, max_chunk_bytes=4096, max_chunks=4)
    count = 30
    procs = start_readers(mq, count=count, per_rank={1: {"sleep_before": 0.6}})
    cleanup[1].extend(procs)
    wait_ready(mq, procs)
    start = time.monotonic()
    for i in range(count):
        mq.enqueue(make_message(i), timeout=10)
    assert time.monotonic() - start >= 0.4  # reader 1 slept, so the writer had to wait for it
    assert_all_received(finish(procs), count)


def test_enqueue_times_out_when_a_reader_never_reads(cleanup):
    mq = make_writer(cleanup, n_reader=1, max_chunk_bytes=4096, max_chunks=4)
    (proc,) = start_readers(mq, mode="hold")
    cleanup[1].append(proc)
    wait_ready(mq, [proc])
    wait_line(proc)
    for i in range(4):
        mq.enqueue(i, timeout=1)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        mq.enqueue(4, timeout=0.3)
    assert 0.25 <= time.monotonic() - start < 1.5
    finish([proc])  # communicate() closes its stdin, which lets it exit


def in_process_pair(cleanup) -> tuple[MessageQueue, MessageQueue]:
    writer = make_writer(cleanup, n_reader=1, max_chunk_bytes=4096, max_chunks=4)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    cleanup[0].append(reader)
    writer.wait_until_ready(10)
    reader.wait_until_ready(10)
    return writer, reader


def test_dequeue_times_out(cleanup):
    writer, reader = in_process_pair(cleanup)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        reader.dequeue(timeout=0.2)
    assert 0.15 <= time.monotonic() - start < 1.0
    writer.enqueue("after")  # a timed-out dequeue leaves the queue usable
    assert reader.dequeue(timeout=1) == "after"


def test_dequeue_cancelled_from_another_thread(cleanup):
    writer, reader = in_process_pair(cleanup)
    cancel = threading.Event()
    timer = threading.Timer(0.2, cancel.set)
    timer.start()
    start = time.monotonic()
    with pytest.raises(DequeueCancelled, match="cancelled"):
        reader.dequeue(timeout=10, cancel=cancel)
    assert time.monotonic() - start < 1.0
    timer.join()
    writer.enqueue(b"x" * 10000)  # overflow path, in one process
    assert reader.dequeue(timeout=1) == b"x" * 10000


def test_blocked_reader_does_not_spin(cleanup):
    mq = make_writer(cleanup, n_reader=1)
    (proc,) = start_readers(mq, mode="idle", count=1, timeout=10)
    cleanup[1].append(proc)
    wait_ready(mq, [proc])
    wait_line(proc)
    time.sleep(0.2)  # let it get into dequeue
    process = psutil.Process(proc.pid)
    before = process.cpu_times()
    time.sleep(1.0)
    after = process.cpu_times()
    used = (after.user - before.user) + (after.system - before.system)
    mq.enqueue(make_message(0))
    assert_all_received(finish([proc]), 1)
    assert used < 0.2, f"blocked reader used {used:.3f} s of CPU in 1 s"


def test_close_leaves_nothing_behind(cleanup):
    mq = make_writer(cleanup, n_reader=2, max_chunk_bytes=4096, max_chunks=4)
    handle = mq.export_handle()
    shm_path = f"/dev/shm/{handle.shm_name}"
    ipc_dir = os.path.dirname(handle.zmq_address[len("ipc://"):])
    assert os.path.exists(shm_path) and os.path.isdir(ipc_dir)
    gen = {"large_every": 3, "large_size": 10000}
    procs = start_readers(mq, count=6, gen=gen)
    cleanup[1].extend(procs)
    wait_ready(mq, procs)
    for i in range(6):
        mq.enqueue(make_message(i, **gen), timeout=10)
    assert_all_received(finish(procs), 6)  # also checks the readers printed no resource_tracker warning
    assert os.path.exists(shm_path)  # the readers exiting did not unlink it
    mq.close()
    mq.close()
    assert not os.path.exists(shm_path)
    assert not os.path.exists(ipc_dir)
    mine = [name for name in os.listdir("/dev/shm") if name.startswith(f"pagedllm_mq_{os.getpid()}_")]
    assert mine == []  # earlier tests' queues were closed by their fixtures too


def test_reader_sharing_the_writers_resource_tracker():
    """A reader started by multiprocessing's spawn context uses its parent's resource tracker: attaching must not
    touch the writer's registration there (the tracker would print a KeyError when the writer unlinks)."""
    gen = {"large_every": 4, "large_size": 10000}
    proc = subprocess.run([sys.executable, READER, json.dumps({"mode": "spawn_writer", "count": 12, "gen": gen})],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert not any(word in proc.stderr for word in WARNING_WORDS + ("KeyError",)), proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"reader_exitcode": 0, "shm_left": False}


def test_handle_and_misuse():
    mq = MessageQueue(n_reader=2, max_chunk_bytes=1000, max_chunks=2)
    try:
        handle = pickle.loads(pickle.dumps(mq.export_handle()))
        assert isinstance(handle, Handle) and handle == mq.export_handle()
        assert handle.max_chunk_bytes % 8 == 0 and handle.max_chunk_bytes >= 1000
        with pytest.raises(ValueError):
            MessageQueue.create_from_handle(handle, 2)
        with pytest.raises(RuntimeError, match="wait_until_ready"):
            mq.enqueue(1)
        with pytest.raises(TimeoutError):
            mq.wait_until_ready(0.1)  # no reader connected
    finally:
        mq.close()


@pytest.mark.timeout(30)
def test_a_writer_waiting_on_a_full_ring_stops_once_a_reader_is_found_dead(cleanup):
    """A reader that died never frees its slots: an enqueue without a timeout waited for it for ever once the ring
    was full (max_chunks calls outstanding). check_alive, called while it waits, ends the wait with its error, and
    the multiprocess executor's is its check of its workers."""
    from pagedllm.executor.multiproc import MultiprocExecutor, WorkerError

    writer, _ = in_process_pair(cleanup)  # its reader never reads: dead, to the writer
    for i in range(4):
        writer.enqueue(i, timeout=1)

    class DeadWorker:
        def poll(self) -> int:
            return -9

    executor = MultiprocExecutor.__new__(MultiprocExecutor)
    executor.rpc_broadcast_mq, executor.workers, executor.world_size = writer, [DeadWorker()], 1
    executor._failure, executor._seq, executor._replies_of = None, 0, {}
    with pytest.raises(WorkerError, match=r"worker rank 0 died \(exit code -9\)"):
        executor.submit_rpc("execute_model")
