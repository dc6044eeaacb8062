"""CPU graphs: a step's native kernel calls recorded once and replayed (the CPU analogue of vLLM's CUDA graphs,
which replay a step's kernel launches without the Python that issued them).

With float32 activations on CPU a step's forward is native kernels only (gemm.c or gemm_bf16.c, the
paged-attention kernels, fused_ops.c), ~10 a layer, and for a batch of a few rows the Python around them
(modules, views, allocations, argument checks) costs about as much as the kernels, and still a visible share of a
prompt's step on a few cores (whose OpenMP workers wait meanwhile). Capture runs the forward once,
as usual, while ``launch`` records every kernel call with its arguments; replay makes the same calls again and
nothing else. A graph captured ahead of its steps (a decode batch size, at start-up) need not compute anything:
its capture can record the calls without making them (``run_kernels=False``), since a graph is its calls and their
arguments, not the values its forward computed; its first replay is then the first run of its kernels.

That is only right under CUDA graphs' two rules. Every per-step input must sit in the same memory at every
step: the model runner keeps static buffers per batch size and refreshes them before each replay. And nothing
but the recorded kernels may compute what the kernels read: capture checks this one, since a torch op between
two kernels (a dtype conversion, a fallback path) would not run again on replay. Such a capture is refused
and the step stays eager. Python decisions taken during capture are frozen into the graph: in a step's forward
these are the batch's shape (requests, tokens, decode rows) and the length of a prefix every request shares
(attended once for all rows by cascade attention), which is why the model runner keys its graphs by both
(worker/cpu_graphs.py).

Where native/graph_replay.c knows the platform's calling convention, a replay is one ctypes call that makes the
recorded calls in C (each a kernel's address and its arguments, packed at capture); elsewhere Python makes them one
by one.
"""

import ctypes
import struct
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pagedllm.native.signature import FLOAT, INT, INT64, POINTER, CFunction, arguments

_aten = torch.ops.aten
# Ops that only make memory (or a view of it): their results hold nothing until a kernel writes them.
_ALLOCATIONS = {_aten.empty.memory_format, _aten.empty_like.default, _aten.new_empty.default,
                _aten.empty_strided.default}

# .calls: those of the graph this thread is capturing, else None; .run_kernels: whether that capture makes them
_capture = threading.local()


def launch(kernel, *args):
    """Call a native kernel (a ctypes function); while this thread captures a graph, also record the call, and
    where the capture does not run its kernels only record it, taking its status as success (0)."""
    calls = getattr(_capture, "calls", None)
    if calls is not None:
        calls.append((kernel, args))
        if not _capture.run_kernels:
            return 0
    return kernel(*args)


def _as_ctypes(kernel, args: tuple) -> tuple:
    """A recorded call's arguments as instances of the kernel's argtypes (NULL stays None): ctypes then passes them
    without converting each Python number on every replay (about a quarter of a small kernel's call)."""
    argtypes = getattr(kernel, "argtypes", None)
    if not argtypes or len(argtypes) != len(args):
        return args
    return tuple(a if a is None else argtype(a) for argtype, a in zip(argtypes, args))


class GraphReplayError(RuntimeError):
    pass


GRAPH_REPLAY_SIGNATURES = [
    CFunction("graph_replay_available", INT),
    CFunction("graph_replay", INT64, *arguments("calls", POINTER, "n", INT64, "status", POINTER)),
]


class _GraphCall(ctypes.Structure):
    """graph_replay.c's GraphCall: a kernel's address, whether it returns a status, and its integer-class and
    float arguments, each class in its order (a float as its bits in the low half of a double's)."""

    INT_ARGS, FLOAT_ARGS = 24, 8  # GRAPH_INT_ARGS, GRAPH_FLOAT_ARGS
    _fields_ = [("kernel", ctypes.c_void_p), ("returns_status", ctypes.c_int64),
                ("ints", ctypes.c_int64 * INT_ARGS), ("floats", ctypes.c_double * FLOAT_ARGS)]


_INTEGER_CLASS = (POINTER, INT, INT64)


def _float_in_double(value: float) -> float:
    """The double whose low 32 bits are ``value``'s float32 bits (the register a float argument travels in)."""
    return struct.unpack("<d", struct.pack("<f4x", value))[0]


def _packed_calls(calls: list[tuple]) -> ctypes.Array | None:
    """``calls`` (kernel, ctypes arguments) as graph_replay.c's GraphCall array, or None where one of them does not
    fit it: a return type other than int or void, an argument of another type, more arguments than it holds."""
    packed = (_GraphCall * len(calls))()
    for record, (kernel, args) in zip(packed, calls):
        argtypes = getattr(kernel, "argtypes", None)
        if kernel.restype not in (None, INT) or argtypes is None or len(argtypes) != len(args):
            return None
        ints = [0 if a is None else a.value or 0 for t, a in zip(argtypes, args) if t in _INTEGER_CLASS]
        floats = [_float_in_double(a.value) for t, a in zip(argtypes, args) if t is FLOAT]
        if (len(ints) + len(floats) != len(args) or len(ints) > _GraphCall.INT_ARGS
                or len(floats) > _GraphCall.FLOAT_ARGS):
            return None
        record.kernel = ctypes.cast(kernel, ctypes.c_void_p).value
        record.returns_status = kernel.restype is not None
        record.ints[: len(ints)] = ints
        record.floats[: len(floats)] = floats
    return packed


class GraphPool:
    """Memory the graphs' activations are carved from, shared by all of a runner's graphs: they replay one at a
    time and keep nothing from one replay to the next, so every capture carves from the pool's start again
    (CUDA graphs share a memory pool the same way). The pool grows to the largest graph's needs."""

    ALIGN = 64  # bytes: each carved tensor starts on a cache line
    MIN_CHUNK = 1 << 22

    def __init__(self):
        self._chunks: list[torch.Tensor] = []  # uint8

    def allocator(self) -> "_Carver":
        return _Carver(self)


class _Carver:
    """One capture's allocator over its pool's chunks: first fit among the memory no live tensor of this capture
    holds, adding a chunk where none fits. A carved tensor's memory is free again once the forward has dropped
    every view of it, as the eager forward's allocator would reuse it: so a graph's activations take what its
    forward has live at once, not the sum of all its tensors (every layer's), and a replay writes them into
    memory that is still in cache. Reuse is exact on replay too: the kernels run in the order
    they ran at capture, each done with a buffer before a later one is placed over it.

    Each carved tensor gets a storage of its own over its bytes (``torch.frombuffer`` of a numpy view of the
    chunk): the storage holds the view while any tensor uses it, so the view's weak reference dying says the
    memory is free."""

    def __init__(self, pool: GraphPool):
        self.pool = pool
        self._arrays = [chunk.numpy() for chunk in pool._chunks]
        self._live: list[tuple[weakref.ref, int, int, int]] = []  # (the view, chunk, start, end)

    def empty(self, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        numel = torch.Size(shape).numel()
        nbytes = max(1, numel) * dtype.itemsize
        chunk, start = self._place(-(-nbytes // GraphPool.ALIGN) * GraphPool.ALIGN)
        view = self._arrays[chunk][start : start + nbytes]
        self._live.append((weakref.ref(view), chunk, start, start + nbytes))
        return torch.frombuffer(view, dtype=torch.uint8).view(dtype)[:numel].view(shape)

    def holds(self, address: int) -> bool:
        """Whether ``address`` is in the pool's memory."""
        return any(chunk.data_ptr() <= address < chunk.data_ptr() + chunk.numel() for chunk in self.pool._chunks)

    def _place(self, nbytes: int) -> tuple[int, int]:
        """The first (chunk, offset) with nbytes that no live carved tensor holds."""
        self._live = [entry for entry in self._live if entry[0]() is not None]
        for chunk, array in enumerate(self._arrays):
            offset = 0
            for start, end in sorted(e[2:] for e in self._live if e[1] == chunk):
                if start - offset >= nbytes:
                    break
                offset = max(offset, -(-end // GraphPool.ALIGN) * GraphPool.ALIGN)
            if array.size - offset >= nbytes:
                return chunk, offset
        chunks = self.pool._chunks
        chunks.append(torch.empty(max(nbytes, GraphPool.MIN_CHUNK, 2 * sum(c.numel() for c in chunks)),
                                  dtype=torch.uint8))
        self._arrays.append(chunks[-1].numpy())
        return len(chunks) - 1, 0


def _tensors_in(value):
    """The tensors in an op's arguments or results (nested tuples, lists and dicts): what torch's pytree
    flattening finds there, without its generality, which a capture paid for on every op."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)


class _TensorOrigins(TorchDispatchMode):
    """During capture: places the forward's new tensors in the graph pool (replay writes into the same memory
    again), keeps every other tensor it creates alive, and notes the memory of those a torch op computed rather
    than only allocated or viewed."""

    def __init__(self, carver: _Carver):
        super().__init__()
        self.carver = carver
        self.tensors: list[torch.Tensor] = []
        self.computed: list[tuple[int, int]] = []  # [start, end) byte ranges

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: torch then leaves __torch_dispatch__ unwrapped by its dynamo guard, whose first call imports
        torch._dynamo (seconds, in every engine process's first capture). Nothing runs torch.compile under this
        mode, so there is nothing for the guard to do."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        carved = self._carve(func, args, kwargs)
        if carved is not None:
            return carved
        out = func(*args, **kwargs)
        tensors = list(_tensors_in(out))
        # Views of the pool's memory live as long as the forward keeps them (the carver reuses what it drops).
        self.tensors.extend(t for t in tensors if not self.carver.holds(t.untyped_storage().data_ptr()))
        if func in _ALLOCATIONS:
            return out
        inputs = {t.untyped_storage().data_ptr() for t in _tensors_in((args, kwargs))} if func.is_view else ()
        for t in tensors:
            storage = t.untyped_storage()
            # A view (or an op like ``to`` that returned its input) holds what its input held; anything else
            # wrote its result: into new memory, or in place into an input.
            if not (func.is_view and storage.data_ptr() in inputs):
                self.computed.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
        return out

    def _carve(self, func, args, kwargs) -> torch.Tensor | None:
        """A new contiguous CPU tensor from the pool for an allocation op, or None (other ops and layouts)."""
        if kwargs.get("device", "cpu") not in ("cpu", torch.device("cpu")) or kwargs.get("pin_memory"):
            return None
        if func is _aten.empty.memory_format:
            return self.carver.empty(args[0], kwargs.get("dtype") or torch.get_default_dtype())
        if func in (_aten.empty_like.default, _aten.new_empty.default):
            like = args[0]
            if like.device.type != "cpu" or (func is _aten.empty_like.default and not like.is_contiguous()):
                return None
            shape = like.shape if func is _aten.empty_like.default else args[1]
            return self.carver.empty(shape, kwargs.get("dtype") or like.dtype)
        return None

    def computed_by_torch(self, address: int) -> bool:
        return any(start <= address < end for start, end in self.computed)


class CpuGraph:
    """The kernel calls of one captured forward. ``capture`` runs it (its result is that step's output);
    afterwards ``failure`` says why the graph cannot be replayed, or is None and ``replay`` recomputes the
    output in place for the inputs now in the static buffers. Graphs sharing a pool must not interleave: a
    capture or replay of one overwrites the others' activations and outputs.

    A capture without its kernels (``run_kernels=False``) computes nothing (its result holds no values) and takes
    every call's status as success; ``verified`` is False until a replay has made every call: where a kernel
    refuses its arguments (a status its eager caller would have turned into a torch fallback, refusing the graph),
    that first replay raises GraphReplayError, and the caller runs the step eagerly instead, which rewrites
    whatever the replay wrote before it failed."""

    def __init__(self, pool: GraphPool | None = None):
        self.pool = pool or GraphPool()
        self.calls: list[tuple] = []  # (kernel, its arguments as ctypes values; () once packed_calls holds them)
        self.packed_calls: ctypes.Array | None = None  # the calls for graph_replay.c, where it replays them
        self._replayer: ctypes.CDLL | None = None
        self.failure: str | None = None
        self.output: torch.Tensor | None = None
        self.verified = True
        self._tensors: list[torch.Tensor] = []

    def capture(self, forward, run_kernels: bool = True) -> torch.Tensor:
        if getattr(_capture, "calls", None) is not None:
            raise RuntimeError("a CPU graph is already being captured")
        origins = _TensorOrigins(self.pool.allocator())
        _capture.calls, _capture.run_kernels, self.verified = self.calls, run_kernels, run_kernels
        try:
            with origins:
                output = forward()
        finally:
            _capture.calls = None
        self.failure = self._unreplayable(origins, output)
        if self.failure is None:
            self.output, self._tensors = output, origins.tensors
            self.calls = [(kernel, _as_ctypes(kernel, args)) for kernel, args in self.calls]
            from pagedllm import native  # here: pagedllm.native imports this module (its kernels call launch)

            self._replayer = native.graph_replay()
            self.packed_calls = None if self._replayer is None else _packed_calls(self.calls)
            if self.packed_calls is not None:  # the packed arguments are the replay's: keep the kernels' names
                self.calls = [(kernel, ()) for kernel, _ in self.calls]
        else:
            self.calls = []
        return output

    def _unreplayable(self, origins: _TensorOrigins, output: torch.Tensor) -> str | None:
        if not self.calls:
            return "no native kernel ran"
        for kernel, args in self.calls:
            if any(isinstance(a, int) and origins.computed_by_torch(a) for a in args):
                return f"{kernel.__name__} reads memory a torch op computed during capture"
        if origins.computed_by_torch(output.data_ptr()):
            return "a torch op computed the output"
        return None

    def replay(self) -> torch.Tensor:
        if self.packed_calls is not None:
            status = ctypes.c_int(0)
            failed = self._replayer.graph_replay(ctypes.addressof(self.packed_calls), len(self.packed_calls),
                                                 ctypes.addressof(status))
            if failed:
                self._replay_failed(self.calls[failed - 1][0], status.value)
        else:
            for kernel, args in self.calls:
                status = kernel(*args)
                if status:  # None for kernels without a status, 0 for success
                    self._replay_failed(kernel, status)
        self.verified = True
        return self.output

    @staticmethod
    def _replay_failed(kernel, status: int):
        raise GraphReplayError(f"{kernel.__name__} failed on replay (status {status})")
