"""MessageQueue: one writer broadcasts pickled objects to N reader processes on one machine, through a ring of
fixed-size slots in shared memory, with a ZMQ PUB socket as the readers' doorbell and as the path for messages
too large for a slot (as vLLM's shm_broadcast does).

The executor creates the queue (it is the writer), sends `export_handle()` to its workers, and each worker
attaches with `create_from_handle(handle, rank)`. Both sides then call `wait_until_ready`; after that every
reader gets every message, in the order it was enqueued.

This module imports only the standard library and pyzmq, so that it can be loaded without the rest of pagedllm.

Segment layout (every field an 8-byte unsigned int, native order; each block on its own 64-byte line):

    header       magic, n_reader, max_chunks, max_chunk_bytes         written once by the writer, at creation
    reader r     read_seq[r]: how many messages reader r has consumed  written only by reader r
    slot i meta  seq, nbytes, kind                                     written only by the writer
    slot i data  max_chunk_bytes of payload                            written only by the writer

Messages are numbered 1, 2, 3, ...; message k lives in slot (k - 1) % max_chunks. Invariants:

* A slot whose seq is k holds message k completely: the writer writes the payload, then nbytes and kind, and
  stores seq last. seq 0 means the slot was never written.
* The writer may write message k into its slot only once every read_seq[r] >= k - max_chunks, i.e. every reader
  has consumed the slot's previous message. So a reader waiting for message k never sees its slot lapped: its
  seq is k - max_chunks (not yet written) or k.
* Reader r reads message k only when the slot's seq is k, reads nbytes, kind and the payload, and only then
  stores read_seq[r] = k. After that store it does not touch the slot again.

Memory ordering: this relies on x86's ordering of plain stores and loads (stores are not reordered with older
stores, loads not with older loads, stores not with older loads), which is what the accesses above through a
memoryview of the segment compile to; CPython offers no fences, so this is not safe as is on weakly-ordered CPUs.

Overflow: a pickled message larger than a slot is sent on the PUB socket as [b"O", k, payload] before its slot is
published with kind OVERFLOW; the slot still takes its turn in the ring, so order and back-pressure are the same
as for small messages, and a reader takes the payload from its SUB socket (frames arrive in the order sent).

Doorbell: after publishing a slot the writer sends an empty frame on the PUB socket. A reader with nothing to read
drains its SUB socket without blocking, re-checks the slot, and only then blocks in `poll` for at most
_POLL_INTERVAL_S, so a blocked reader costs no CPU, and `timeout` and `cancel` are honoured. The doorbell is only a
wake-up hint: whether a message is there is decided by the slot's seq alone. A writer with no free slot (some
reader is max_chunks messages behind) sleeps briefly and re-checks, asking its caller now and then whether the readers
are alive (check_alive).

Handshake (ZMQ's slow joiner: a PUB socket drops what it sends before a subscription reaches it): the writer's
socket is an XPUB, each reader subscribes to everything and to a topic naming its rank, and the writer's
`wait_until_ready` returns once every rank's subscription has arrived, then sends b"R", which each reader's
`wait_until_ready` waits for. The writer refuses to enqueue before its handshake.
"""
from __future__ import annotations

import os
import pickle
import secrets
import shutil
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any, Callable, Optional

import zmq

__all__ = ["DequeueCancelled", "Handle", "MessageQueue"]

_MAGIC = 0x5051_4D51_5F76_3031  # any fixed value: catches attaching to something that is not a queue
_LINE = 64  # bytes per header block, so that fields written by different processes sit on different cache lines
_WORDS_PER_LINE = _LINE // 8

_KIND_INLINE = 1
_KIND_OVERFLOW = 2

_FRAME_DOORBELL = b""
_FRAME_OVERFLOW = b"O"
_FRAME_READY = b"R"
_TOPIC_RANK = b"\xffrank"  # no frame we send starts with 0xff, so these subscriptions only identify readers

_POLL_INTERVAL_S = 0.1  # longest a blocked reader sleeps before re-checking cancel / timeout
_WRITER_SLEEP_MIN_S = 1e-5
_WRITER_SLEEP_MAX_S = 1e-3

_ATTACH_LOCK = threading.Lock()  # serialises the patching of resource_tracker.register in _attach_untracked


class DequeueCancelled(RuntimeError):
    """dequeue gave up because its cancel event was set."""


@dataclass(frozen=True)
class Handle:
    """What a reader needs to attach: plain data, picklable, valid in any process on this machine."""

    shm_name: str
    n_reader: int
    max_chunk_bytes: int
    max_chunks: int
    zmq_address: str  # ipc:// address of the writer's XPUB socket


def _segment_size(n_reader: int, max_chunk_bytes: int, max_chunks: int) -> tuple[int, int]:
    """(offset of slot 0's data, total bytes)."""
    data_offset = _LINE * (1 + n_reader + max_chunks)
    return data_offset, data_offset + max_chunk_bytes * max_chunks


def _remove_writer_files(shm: shared_memory.SharedMemory, ipc_dir: str) -> None:
    """Unlink the segment and remove the ipc directory: at the writer's close, or at interpreter exit if the
    writer was never closed."""
    try:
        shm.unlink()
    except FileNotFoundError:
        pass
    shutil.rmtree(ipc_dir, ignore_errors=True)


def _attach_untracked(name: str) -> shared_memory.SharedMemory:
    """Attach to an existing segment without registering it with a resource tracker.

    Before Python 3.13 SharedMemory registers every segment it opens, and the tracker unlinks (and warns about)
    whatever is still registered when its processes exit. Unregistering after attaching is not enough: a reader
    started by multiprocessing's spawn shares its parent's tracker, whose single registration per name is the
    writer's own, so the reader would drop the writer's registration. So the registration is skipped instead:
    resource_tracker.register is replaced, while this segment is opened, by one that ignores this name only.
    """
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    with _ATTACH_LOCK:
        register = resource_tracker.register

        def register_others(resource_name: str, rtype: str) -> None:
            if not (rtype == "shared_memory" and resource_name.lstrip("/") == name.lstrip("/")):
                register(resource_name, rtype)

        resource_tracker.register = register_others
        try:
            return shared_memory.SharedMemory(name=name)
        finally:
            resource_tracker.register = register


class MessageQueue:
    """One writer, n_reader readers; see the module docstring for the layout and the rules of the ring.

    The writer is built with the constructor, readers with `create_from_handle`. Not thread-safe: one thread per
    process calls enqueue (writer) or dequeue (reader).
    """

    def __init__(self, n_reader: int, max_chunk_bytes: int = 1 << 20, max_chunks: int = 8):
        if n_reader < 1 or max_chunks < 1 or max_chunk_bytes < 1:
            raise ValueError(f"need n_reader, max_chunks, max_chunk_bytes >= 1, got {n_reader}, {max_chunks}, "
                             f"{max_chunk_bytes}")
        max_chunk_bytes = -(-max_chunk_bytes // 8) * 8  # keep every slot 8-byte aligned
        name = f"pagedllm_mq_{os.getpid()}_{secrets.token_hex(4)}"
        _, size = _segment_size(n_reader, max_chunk_bytes, max_chunks)
        shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        ipc_dir = tempfile.mkdtemp(prefix="pagedllm-mq-")
        self._remove_files = weakref.finalize(self, _remove_writer_files, shm, ipc_dir)
        handle = Handle(shm.name, n_reader, max_chunk_bytes, max_chunks, f"ipc://{ipc_dir}/bcast")
        self._setup(handle, shm, reader_rank=None)
        try:
            header = self._words
            header[1], header[2], header[3] = n_reader, max_chunks, max_chunk_bytes
            header[0] = _MAGIC
            self._socket = self._ctx.socket(zmq.XPUB)
            self._socket.setsockopt(zmq.SNDHWM, 0)  # never drop: overflow payloads must arrive; the ring bounds them
            self._socket.setsockopt(zmq.RCVHWM, 0)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.bind(handle.zmq_address)
        except BaseException:
            self.close()
            raise
        self._n_written = 0
        self._min_read = 0  # a lower bound of min(read_seq), refreshed when it is too low for the next message
        self._ranks_seen: set[int] = set()

    @classmethod
    def create_from_handle(cls, handle: Handle, reader_rank: int) -> "MessageQueue":
        """Attach as reader `reader_rank` (0 <= reader_rank < handle.n_reader). Subscribes at once, so the
        writer's wait_until_ready can see this reader."""
        if not 0 <= reader_rank < handle.n_reader:
            raise ValueError(f"reader_rank {reader_rank} not in [0, {handle.n_reader})")
        self = cls.__new__(cls)
        shm = _attach_untracked(handle.shm_name)
        self._setup(handle, shm, reader_rank)
        try:
            expected = (_MAGIC, handle.n_reader, handle.max_chunks, handle.max_chunk_bytes)
            if tuple(self._words[:4]) != expected:
                raise ValueError(f"shared memory {handle.shm_name} does not hold the queue its handle describes")
            self._socket = self._ctx.socket(zmq.SUB)
            self._socket.setsockopt(zmq.RCVHWM, 0)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.setsockopt(zmq.SUBSCRIBE, b"")
            self._socket.setsockopt(zmq.SUBSCRIBE, _TOPIC_RANK + str(reader_rank).encode())
            self._socket.connect(handle.zmq_address)
        except BaseException:
            self.close()
            raise
        self._n_read = 0
        self._ready_seen = False
        self._overflow: dict[int, Any] = {}  # message number -> payload frame, received before its slot is read
        return self

    def _setup(self, handle: Handle, shm: shared_memory.SharedMemory, reader_rank: Optional[int]) -> None:
        self._handle = handle
        self._shm = shm
        self._rank = reader_rank
        self._closed = False
        self._ready = False
        self._socket = None
        self._ctx = zmq.Context(io_threads=1)
        data_offset, size = _segment_size(handle.n_reader, handle.max_chunk_bytes, handle.max_chunks)
        self._words = shm.buf[:data_offset].cast("Q")
        self._data = shm.buf[data_offset:size]
        self._reader_word0 = _WORDS_PER_LINE  # read_seq[r] is word _reader_word0 + r * _WORDS_PER_LINE
        self._slot_word0 = _WORDS_PER_LINE * (1 + handle.n_reader)

    # -- both sides --------------------------------------------------------------------------------------------

    @property
    def is_writer(self) -> bool:
        return self._rank is None

    def export_handle(self) -> Handle:
        return self._handle

    def wait_until_ready(self, timeout: float) -> None:
        """Writer: return once every reader has subscribed, then tell them. Reader: return once told."""
        self._check_open()
        deadline = time.monotonic() + timeout
        if self.is_writer:
            while len(self._ranks_seen) < self._handle.n_reader:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(self._handle.n_reader)) - self._ranks_seen)
                    raise TimeoutError(f"readers {missing} did not connect within {timeout} s")
                if self._socket.poll(int(remaining * 1000) + 1, zmq.POLLIN):
                    self._note_subscription(self._socket.recv())
            self._socket.send(_FRAME_READY)
        else:
            while not self._ready_seen:
                self._drain()
                if self._ready_seen:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"writer did not answer reader {self._rank} within {timeout} s")
                self._socket.poll(int(min(remaining, _POLL_INTERVAL_S) * 1000) + 1, zmq.POLLIN)
        self._ready = True

    def close(self) -> None:
        """Release the sockets and the mapping; the writer also unlinks the segment and removes its ipc
        directory (which also happens at interpreter exit for a writer never closed). Safe to call more than
        once."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        if self._socket is not None:
            self._socket.close(linger=0)
        self._ctx.term()
        self._words.release()
        self._data.release()
        self._shm.close()
        if self.is_writer:
            self._remove_files()
        else:
            self._overflow.clear()

    def __enter__(self) -> "MessageQueue":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("MessageQueue is closed")

    def _slot_word(self, k: int) -> int:
        return self._slot_word0 + ((k - 1) % self._handle.max_chunks) * _WORDS_PER_LINE

    def _slot_data_offset(self, k: int) -> int:
        return ((k - 1) % self._handle.max_chunks) * self._handle.max_chunk_bytes

    # -- writer ------------------------------------------------------------------------------------------------

    def enqueue(self, obj: Any, timeout: Optional[float] = None,
                check_alive: Optional[Callable[[], None]] = None) -> None:
        """Broadcast obj to every reader. Waits while the ring is full; raises TimeoutError (nothing sent) if
        no slot frees up within `timeout` seconds (None: wait for ever). `check_alive` is called about every
        _POLL_INTERVAL_S of that wait, and what it raises ends it (nothing sent): a reader that died never frees
        its slots, and the writer would otherwise wait for it for ever."""
        self._check_open()
        if not self.is_writer:
            raise RuntimeError("enqueue is for the writer; this is a reader")
        if not self._ready:
            raise RuntimeError("call wait_until_ready() before enqueue(): messages sent earlier could be lost")
        payload = pickle.dumps(obj, protocol=5)
        k = self._n_written + 1
        self._wait_for_slot(k, timeout, check_alive)
        word = self._slot_word(k)
        words = self._words
        nbytes = len(payload)
        if nbytes <= self._handle.max_chunk_bytes:
            offset = self._slot_data_offset(k)
            self._data[offset:offset + nbytes] = payload
            kind = _KIND_INLINE
        else:
            self._socket.send(_FRAME_OVERFLOW, zmq.SNDMORE)
            self._socket.send(k.to_bytes(8, "little"), zmq.SNDMORE)
            self._socket.send(payload, copy=False)
            kind = _KIND_OVERFLOW
        words[word + 1] = nbytes
        words[word + 2] = kind
        words[word] = k  # publish: last
        self._n_written = k
        try:
            self._socket.send(_FRAME_DOORBELL, zmq.NOBLOCK)
        except zmq.Again:  # cannot happen with SNDHWM 0; a lost doorbell only delays readers by a poll interval
            pass

    def _wait_for_slot(self, k: int, timeout: Optional[float], check_alive: Optional[Callable[[], None]]) -> None:
        """Return once every reader has consumed message k - max_chunks (the slot's previous occupant)."""
        needed = k - self._handle.max_chunks
        if self._min_read >= needed:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        next_check = time.monotonic()
        sleep = _WRITER_SLEEP_MIN_S
        while True:
            self._min_read = self._min_read_seq()
            if self._min_read >= needed:
                return
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError(f"ring full for {timeout} s: a reader has not consumed message {needed}")
            if check_alive is not None and now >= next_check:
                check_alive()
                next_check = now + _POLL_INTERVAL_S
            time.sleep(sleep)
            sleep = min(sleep * 2, _WRITER_SLEEP_MAX_S)

    def _min_read_seq(self) -> int:
        words = self._words
        return min(words[self._reader_word0 + r * _WORDS_PER_LINE] for r in range(self._handle.n_reader))

    def _note_subscription(self, msg: bytes) -> None:
        if msg[:1] == b"\x01" and msg[1:].startswith(_TOPIC_RANK):
            rank = msg[1 + len(_TOPIC_RANK):]
            if rank.isdigit() and int(rank) < self._handle.n_reader:
                self._ranks_seen.add(int(rank))

    # -- reader ------------------------------------------------------------------------------------------------

    def dequeue(self, timeout: Optional[float] = None, cancel: Optional[threading.Event] = None) -> Any:
        """Return the next message. Blocks (without spinning) until one is there; raises TimeoutError after
        `timeout` seconds (None: wait for ever) and DequeueCancelled once `cancel` is set while waiting. Either
        leaves the queue as it was: the next call returns the same message."""
        self._check_open()
        if self.is_writer:
            raise RuntimeError("dequeue is for readers; this is the writer")
        k = self._n_read + 1
        word = self._slot_word(k)
        words = self._words
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # Doorbells are drained before the check, so a publish after the check still wakes the poll below;
            # draining on the fast path too keeps them from piling up while this reader runs behind.
            self._drain()
            seq = words[word]
            if seq == k:
                break
            if seq > k:
                raise RuntimeError(f"reader {self._rank}: slot for message {k} holds message {seq} (overwritten)")
            self._block(deadline, timeout, cancel)
        nbytes = words[word + 1]
        if words[word + 2] == _KIND_INLINE:
            offset = self._slot_data_offset(k)
            view = self._data[offset:offset + nbytes]
            try:
                obj = pickle.loads(view)
            finally:
                view.release()
                self._mark_read(k)
            return obj
        while k not in self._overflow:
            self._drain()
            if k in self._overflow:
                break
            self._block(deadline, timeout, cancel)
        frame = self._overflow.pop(k)
        self._mark_read(k)
        return pickle.loads(frame.buffer)

    def _mark_read(self, k: int) -> None:
        self._words[self._reader_word0 + self._rank * _WORDS_PER_LINE] = k
        self._n_read = k

    def _block(self, deadline: Optional[float], timeout: Optional[float],
               cancel: Optional[threading.Event]) -> None:
        """Sleep on the doorbell for at most one poll interval; raise if cancelled or past the deadline."""
        if cancel is not None and cancel.is_set():
            raise DequeueCancelled(f"reader {self._rank}: dequeue cancelled")
        wait = _POLL_INTERVAL_S
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"reader {self._rank}: no message within {timeout} s")
            wait = min(wait, remaining)
        self._socket.poll(max(1, int(wait * 1000)), zmq.POLLIN)

    def _drain(self) -> None:
        """Take everything waiting on the SUB socket without blocking: drop doorbells, keep overflow payloads."""
        sock = self._socket
        while True:
            try:
                first = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if first == _FRAME_OVERFLOW:
                k = int.from_bytes(sock.recv(), "little")
                self._overflow[k] = sock.recv(copy=False)
            elif first == _FRAME_READY:
                self._ready_seen = True
