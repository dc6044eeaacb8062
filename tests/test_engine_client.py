"""The multi-process engine clients' failures, against a fake engine process: the test plays the engine on the
client's sockets (its ready response, its outputs), so that each failure is made exactly and in milliseconds. Every
test has a hard timeout: the failures these guard against are hangs."""
from __future__ import annotations

import asyncio
import pickle
import threading

import msgspec
import pytest
import zmq

from pagedllm.engine import core_client, core_proc
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.engine.protocol import EngineCoreOutputs, EngineCoreReadyResponse, UtilityOutput


class FakeProcess:
    """The parts of an engine Process the client uses; it runs until terminated, killed or died()."""

    def __init__(self) -> None:
        self.pid, self.returncode, self._exited = 0, None, threading.Event()

    def poll(self):
        return self.returncode

    def wait(self, timeout=None) -> int:
        self._exited.wait(timeout)
        return self.returncode

    def died(self, returncode: int = 1) -> None:
        self.returncode = returncode
        self._exited.set()

    def terminate(self) -> None:
        self.died(0)

    kill = terminate

    def send_signal(self, signal) -> None:
        pass


class FakeEngine:
    """The engine's ends of the client's sockets, and its process."""

    def __init__(self, config_path: str) -> None:
        with open(config_path, "rb") as f:
            _, input_address, output_address, _ = pickle.load(f)
        self.proc = FakeProcess()
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.connect(input_address)
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.connect(output_address)

    def send(self, message) -> None:
        self.output.send(message if isinstance(message, bytes) else msgspec.msgpack.encode(message))

    def ready(self) -> None:
        self.send(EngineCoreReadyResponse(max_model_len=256, num_gpu_blocks=8))

    def close(self) -> None:
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.ctx.term()


class FakeEngines(list):
    ready = True


@pytest.fixture
def fake_engines(monkeypatch):
    """The FakeEngines of the clients made in the test, in order; each is ready at once unless the test set
    ``fake_engines.ready`` False."""
    engines = FakeEngines()

    def start(config_path: str) -> FakeProcess:
        engine = FakeEngine(config_path)
        engines.append(engine)
        if engines.ready:
            engine.ready()
        return engine.proc

    monkeypatch.setattr(core_client, "start_engine_core", start)
    yield engines
    for engine in engines:
        engine.close()


def config():
    return EngineArgs(dtype="float32", max_model_len=256, kv_cache_memory="32MiB").create_engine_config()


@pytest.mark.timeout(30)
def test_an_output_the_client_cannot_read_fails_every_waiter_instead_of_hanging(fake_engines):
    """The output thread dying silently (here: a message it cannot decode) left every request and utility call
    waiting for ever: they get an EngineDeadError that says why, as at the engine's death."""
    client = core_client.SyncMPClient(config())
    try:
        pending = client._mp.call_utility("get_stats")
        fake_engines[0].send(b"not msgpack")
        with pytest.raises(EngineDeadError, match="could not take the engine.s outputs: ValidationError"):
            client.get_output()
        with pytest.raises(EngineDeadError, match="ValidationError"):
            pending.result(timeout=10)
        with pytest.raises(EngineDeadError, match="ValidationError"):
            client.get_output()  # and at every later call
    finally:
        client.shutdown()


@pytest.mark.timeout(30)
def test_an_output_the_client_cannot_read_stops_the_engine_process(fake_engines):
    """The client the output thread's failure ended left its engine process running, holding its workers and memory,
    until the client was shut down or collected: the failure stops it."""
    client = core_client.SyncMPClient(config())
    try:
        fake_engines[0].send(b"not msgpack")
        assert fake_engines[0].proc.wait(timeout=10) is not None
        with pytest.raises(EngineDeadError, match="ValidationError"):  # its failure, not its stop, is what callers get
            client.add_request(None)
    finally:
        client.shutdown()


@pytest.mark.timeout(30)
def test_an_async_utility_call_cancelled_while_it_waits_leaves_the_outputs_flowing(fake_engines):
    """A utility call whose asyncio task was cancelled (its Future with it) made the output thread's set_result
    raise when the answer came, which killed the thread: every later output was lost."""
    client = core_client.AsyncMPClient(config())

    async def run() -> EngineCoreOutputs:
        call = asyncio.ensure_future(client.call_utility_async("get_stats"))
        await asyncio.sleep(0.05)
        call.cancel()
        await asyncio.sleep(0.05)
        fake_engines[0].send(EngineCoreOutputs(utility_output=UtilityOutput(call_id=0, result=None)))
        fake_engines[0].send(EngineCoreOutputs(engine_index=7))
        return await asyncio.wait_for(client.get_output_async(), 10)

    try:
        assert asyncio.run(run()).engine_index == 7
    finally:
        client.shutdown()


@pytest.mark.timeout(180)
def test_an_engine_that_fails_to_start_says_why(tmp_path):
    """An engine process whose start-up raises (here its model load: a model directory that is not there) sends its
    exception before it exits: the client's error carried only "see its log above"."""
    engine_config = config()
    engine_config.model_config.path = str(tmp_path / "no-such-model")
    with pytest.raises(RuntimeError, match=r"failed to start: \w+Error: .*no-such-model"):
        core_client.SyncMPClient(engine_config)


@pytest.mark.timeout(30)
def test_a_fake_engine_that_fails_to_start_says_why(fake_engines):
    """The client's side of it: the engine's last words in place of its ready response."""
    fake_engines.ready = False
    client_error: list[BaseException] = []

    def start() -> None:
        try:
            core_client.SyncMPClient(config())
        except BaseException as e:
            client_error.append(e)

    starting = threading.Thread(target=start)
    starting.start()
    while not fake_engines:
        starting.join(0.01)
    fake_engines[0].send(EngineCoreOutputs(engine_dead="ValueError: the model's weights are not there"))
    fake_engines[0].proc.died()
    starting.join(10)
    assert "failed to start: ValueError: the model's weights are not there" in str(client_error[0])


@pytest.mark.timeout(30)
def test_a_dead_engine_shut_down_after_says_it_died_at_every_call(fake_engines):
    """After the engine's death and then shutdown(), get_output alternated between the death and the shut-down
    error, and add_request said only "shut down": the death is what the caller needs to know, every time."""
    client = core_client.SyncMPClient(config())
    fake_engines[0].send(EngineCoreOutputs(engine_dead="RuntimeError: worker rank 0 died"))
    fake_engines[0].proc.died()
    with pytest.raises(EngineDeadError, match="worker rank 0 died"):
        client.get_output()
    client.shutdown()
    for _ in range(3):
        with pytest.raises(EngineDeadError, match="worker rank 0 died"):
            client.get_output()
        with pytest.raises(EngineDeadError, match="worker rank 0 died"):
            client.add_request(None)


@pytest.mark.timeout(30)
def test_the_all_engines_dead_error_names_an_engine_shut_down_as_such(fake_engines):
    """Data parallel: engine 0 died, then the client was shut down: the every-engine-dead error said
    "engine 1: None"."""
    from pagedllm import SamplingParams
    from pagedllm.engine.dp_client import DPAsyncMPClient
    from pagedllm.engine.protocol import EngineCoreRequest

    engine_config = EngineArgs(dtype="float32", max_model_len=256, kv_cache_memory="32MiB",
                               data_parallel_size=2).create_engine_config()
    client = DPAsyncMPClient(engine_config)
    fake_engines[0].send(EngineCoreOutputs(engine_dead="RuntimeError: worker rank 0 died"))
    fake_engines[0].proc.died()
    while not client.engines[0].dead:
        threading.Event().wait(0.01)
    client.shutdown()
    with pytest.raises(EngineDeadError):
        client.add_request(EngineCoreRequest("r", [1, 2, 3], SamplingParams(), None, 0.0))
    error = str(client.dead_error)
    assert "engine 0: The engine process died: RuntimeError: worker rank 0 died" in error
    assert f"engine 1: {core_client.SHUT_DOWN_MESSAGE}" in error


@pytest.mark.timeout(30)
def test_shutdown_leaves_the_output_socket_to_an_output_thread_still_busy(fake_engines):
    """shutdown() waits for the output thread only briefly; where the thread is still busy after that (here: an
    output whose handling takes longer), its socket (ZMQ sockets are not thread-safe) stays open until it leaves,
    and is closed, with the ZMQ context, then."""
    handling, release = threading.Event(), threading.Event()

    def slow(outputs) -> None:
        handling.set()
        release.wait()

    client = core_client.MPClient(config(), slow)
    fake_engines[0].send(EngineCoreOutputs())
    assert handling.wait(10)
    client.shutdown()
    thread = client._output_thread_handle
    assert thread.is_alive() and not client._output_socket.closed
    release.set()
    thread.join(10)
    assert client._output_socket.closed and client._ctx.closed


class RecordingExecutor:
    """The thread of each shutdown() call that did the work (a real executor's later calls do nothing)."""

    def __init__(self) -> None:
        self.stopped_in: list[threading.Thread] = []

    def shutdown(self) -> None:
        if not self.stopped_in:
            self.stopped_in.append(threading.current_thread())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("main_thread_stuck", [False, True])
def test_the_parent_death_watchdog_has_the_main_thread_stop_the_executor(monkeypatch, main_thread_stuck):
    """The engine's parent-death watchdog shut the executor down from its own thread, its sockets and shared memory
    closed under a main thread that may be using them: it now has the main thread do it (SIGTERM, as the frontend's
    shutdown), and stops the executor itself only where the main thread does not begin within the grace."""
    import signal

    from pagedllm.engine import core_proc

    monkeypatch.setattr(core_proc, "PARENT_DEATH_STOP_GRACE_S", 0.5)
    executor = RecordingExecutor()
    previous = signal.signal(signal.SIGTERM, lambda *_: None if main_thread_stuck else executor.shutdown())
    try:
        watchdog = threading.Thread(target=core_proc.stop_in_main_thread, args=(executor,))
        watchdog.start()
        watchdog.join(10)  # the main thread runs a Python signal handler while it waits here
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert executor.stopped_in == [watchdog if main_thread_stuck else threading.main_thread()]


@pytest.mark.timeout(240)
def test_an_engine_whose_frontend_is_killed_stops_its_workers_and_exits(tmp_path):
    """The watchdog's stop end to end: a frontend killed (SIGKILL: no shutdown of its own) leaves no engine and no
    worker behind, and the engine's busy loop does not fail on the way (the executor's sockets closed under it, when
    the watchdog stopped the executor from its own thread)."""
    import subprocess
    import sys

    import psutil

    script = ("from pagedllm import LLM\n"
              "llm = LLM(dtype='float32', max_model_len=256, kv_cache_memory='32MiB', tensor_parallel_size=3,\n"
              "          distributed_executor_backend='mp')\n"
              "print('ready', flush=True)\n"
              "import time; time.sleep(600)\n")
    with open(tmp_path / "stderr", "w") as log:  # the engine's and its workers' too
        frontend = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        assert frontend.stdout.readline() == "ready\n"
        children = psutil.Process(frontend.pid).children(recursive=True)
        assert any("EngineCore" in " ".join(child.cmdline()) for child in children)
    finally:
        frontend.kill()
        frontend.wait()
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive
    assert "EngineCore failed" not in (tmp_path / "stderr").read_text()


def test_an_engine_that_cannot_say_why_it_failed_to_start_raises_its_own_error(monkeypatch):
    """Where telling the frontend why fails too (its socket gone), the engine process still fails with the start-up's
    error, not with the failure to report it."""
    def broken_engine(*_):
        raise FileNotFoundError("no-such-model")

    def unreachable_frontend(*_):
        raise zmq.ZMQError(zmq.ENOENT)

    monkeypatch.setattr(core_proc, "EngineCoreProc", broken_engine)
    monkeypatch.setattr(core_proc, "report_startup_failure", unreachable_frontend)
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        core_proc.start_engine_core_proc(config(), "ipc:///nowhere/in", "ipc:///nowhere/out")


class OverlapDetectingSocket:
    """A socket that records any use of it while another thread uses it (ZMQ sockets are not thread-safe): each
    send and the close take a while, so that an unserialized overlap is all but certain."""

    def __init__(self, socket) -> None:
        self._socket, self._users, self.overlaps = socket, 0, 0
        self._count = threading.Lock()

    def __getattr__(self, name):
        return getattr(self._socket, name)

    def _use(self, method, *args, **kwargs):
        with self._count:
            self._users += 1
            self.overlaps += self._users > 1
        try:
            threading.Event().wait(0.005)
            return method(*args, **kwargs)
        finally:
            with self._count:
                self._users -= 1

    def send_multipart(self, *args, **kwargs):
        return self._use(self._socket.send_multipart, *args, **kwargs)

    def close(self, *args, **kwargs):
        return self._use(self._socket.close, *args, **kwargs)


@pytest.mark.timeout(30)
def test_sends_from_several_threads_and_a_shutdown_never_use_the_input_socket_at_once(fake_engines):
    """User threads (an LLM used from two threads, AsyncLLM's loop beside a utility call from another thread) sent on
    the input socket together, and shutdown closed it under a send: each use now holds the socket alone."""
    client = core_client.MPClient(config(), lambda outputs: None)
    client._input_socket = socket = OverlapDetectingSocket(client._input_socket)
    sent = [0] * 4

    def send(index: int) -> None:
        try:
            while True:
                client.add_request(None)  # the fake engine decodes nothing
                sent[index] += 1
        except EngineDeadError:  # shut down
            pass

    senders = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(len(sent))]
    for sender in senders:
        sender.start()
    while min(sent) < 5:
        threading.Event().wait(0.01)
    client.shutdown()
    for sender in senders:
        sender.join(10)
    assert not any(sender.is_alive() for sender in senders)
    assert socket.closed and socket.overlaps == 0


class FakeRay:
    """The Ray calls a RayExecutor's shutdown makes, counted; each kill takes a while, so that a second shutdown
    running meanwhile is all but certain to overlap it."""

    def __init__(self) -> None:
        self.killed: list = []
        self.shutdowns = 0

    def kill(self, actor) -> None:
        threading.Event().wait(0.05)
        self.killed.append(actor)

    def shutdown(self) -> None:
        self.shutdowns += 1


@pytest.mark.timeout(30)
def test_a_ray_executor_shut_down_from_two_threads_at_once_stops_its_actors_once(monkeypatch):
    """The engine's main thread and its parent-death watchdog (core_proc.stop_in_main_thread) may both shut the
    executor down: RayExecutor's shutdown, neither locked nor once-only, killed every actor and shut Ray down twice,
    and a caller could return while the other was still stopping. Ray itself is faked: no cluster starts."""
    from pagedllm.executor.ray_executor import RayExecutor

    def fake_start(executor) -> None:
        executor.ray, executor.workers, executor.placement_group = FakeRay(), ["a0", "a1"], None
        executor._started_ray = True

    monkeypatch.setattr(RayExecutor, "_init_executor", fake_start)
    executor = RayExecutor(config())
    ray = executor.ray
    stoppers = [threading.Thread(target=executor.shutdown, daemon=True) for _ in range(2)]
    for stopper in stoppers:
        stopper.start()
    for stopper in stoppers:
        stopper.join(10)
        assert ray.killed == ["a0", "a1"] and ray.shutdowns == 1  # each caller returns once all is stopped


class ReenteringRay(FakeRay):
    """A Ray whose first kill is interrupted by a shutdown on the same thread: the frontend's SIGTERM, whose handler
    shuts down, landing on the engine's main thread while it is inside shutdown (after a failed step)."""

    def __init__(self, executor_of) -> None:
        super().__init__()
        self._executor_of = executor_of

    def kill(self, actor) -> None:
        if not self.killed:
            self._executor_of().shutdown()
        super().kill(actor)


@pytest.mark.timeout(30)
def test_a_shutdown_interrupted_by_another_on_its_own_thread_returns_and_finishes(monkeypatch):
    """Executor.shutdown's lock was not re-entrant: a shutdown entered again on its own thread (a signal handler's)
    waited for itself for ever, and so did the parent-death watchdog's after it."""
    from pagedllm.executor.ray_executor import RayExecutor

    executor = None

    def fake_start(self) -> None:
        self.ray, self.workers, self.placement_group = ReenteringRay(lambda: executor), ["a0", "a1"], None
        self._started_ray = True

    monkeypatch.setattr(RayExecutor, "_init_executor", fake_start)
    executor = RayExecutor(config())
    stopper = threading.Thread(target=executor.shutdown, daemon=True)
    stopper.start()
    stopper.join(10)
    assert not stopper.is_alive() and executor.ray.killed == ["a0", "a1"]


@pytest.mark.timeout(30)
def test_an_answer_whose_caller_gave_up_between_check_and_set_leaves_the_outputs_flowing(fake_engines):
    """A utility call cancelled from the event loop's thread just after the output thread found it waiting: the
    set then raised InvalidStateError, which (since the output thread ends the client on an error) stopped a
    healthy engine. Here the future is cancelled as its answer is set."""
    client = core_client.SyncMPClient(config())
    try:
        future = client._mp.call_utility("get_stats")
        set_result = future.set_result

        def cancelled_first(result) -> None:
            future.cancel()
            set_result(result)

        future.set_result = cancelled_first
        fake_engines[0].send(EngineCoreOutputs(utility_output=UtilityOutput(call_id=0, result=None)))
        fake_engines[0].send(EngineCoreOutputs(engine_index=7))
        assert client.get_output().engine_index == 7 and not client._mp.dead
    finally:
        client.shutdown()


@pytest.mark.timeout(30)
def test_a_utility_call_waiting_when_another_thread_shuts_down_fails_instead_of_waiting(fake_engines):
    """A thread blocked in a utility call's result (reset_prefix_cache, collective_rpc) while another thread shut
    the engine down waited for ever: no answer comes once shut down. Calls after a death leave nothing behind."""
    client = core_client.SyncMPClient(config())
    future = client._mp.call_utility("get_stats")
    client.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        future.result(timeout=10)
    with pytest.raises(EngineDeadError):
        client._mp.call_utility("get_stats")
    assert client._mp._utility_calls == {}
