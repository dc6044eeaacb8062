"""The EngineCore in its own process: the LLM default, its wire types, and what happens when it dies."""
from __future__ import annotations

import gc
import os
import queue
import re
import subprocess
import tempfile
import threading
import time

import msgspec
import psutil
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine import core_client
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core_client import multiprocessing_enabled
from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.engine.protocol import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason,
                                      SchedulerStats)
from tests.e2e.parallel_helpers import command_line, engine_processes, wait_until


@pytest.fixture
def mp_llm(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_ENABLE_MULTIPROCESSING", raising=False)  # the default
    llm = LLM(dtype="float32", max_model_len=512, kv_cache_memory="64MiB")
    yield llm
    llm.shutdown()


def test_an_interrupt_while_the_engine_process_is_asked_for_leaves_nothing(monkeypatch, tmp_path):
    """A Ctrl-C (or the server's SIGTERM) while the client waits for its engine process (the fork server still
    importing) stops the client: its sockets and their ZMQ context closed (a context collected with sockets open
    waits on them for ever: a server that hung instead of exiting) and its directory removed."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def interrupted(config_path: str):
        raise KeyboardInterrupt

    monkeypatch.setattr(core_client, "start_engine_core", interrupted)
    config = EngineArgs(dtype="float32", max_model_len=256, kv_cache_memory="32MiB").create_engine_config()
    with pytest.raises(KeyboardInterrupt):
        core_client.MPClient(config, lambda outputs: None)
    assert list(tmp_path.iterdir()) == []  # the IPC directory, removed by shutdown (which also closed the sockets)


def test_llm_runs_the_engine_core_in_a_child_process(mp_llm):
    proc = mp_llm.llm_engine.engine_core._mp.proc
    child = psutil.Process(proc.pid)
    # forked by the fork server LLM started before its config and tokenizer loaded (launch.py), titled as `python -m`
    assert child.pid != os.getpid() and child.parent().ppid() == os.getpid()
    assert "pagedllm.forkserver" in command_line(child.parent())
    assert command_line(child)[-4:-1] == ["-m", "pagedllm.engine.core_proc", "EngineCore"]
    out = mp_llm.generate(["The capital of France is", "One, two,"],
                          SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [8, 8]
    stats = mp_llm.get_stats()
    assert stats.num_running_reqs == 0 and stats.kv_cache_usage == 0.0
    mp_llm.shutdown()
    assert not psutil.pid_exists(proc.pid) or psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE
    with pytest.raises(EngineDeadError, match="has been shut down"):  # not "died unexpectedly"
        mp_llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)


def test_dead_engine_raises_instead_of_hanging(mp_llm):
    mp_llm.llm_engine.engine_core._mp.proc.kill()
    start = time.monotonic()
    with pytest.raises(EngineDeadError):
        mp_llm.generate("Hello", SamplingParams(max_tokens=64), use_tqdm=False)
    assert time.monotonic() - start < 10
    # and stays dead: every later call raises, none waits for outputs that cannot come
    assert not mp_llm.llm_engine.has_unfinished_requests()
    for _ in range(2):
        with pytest.raises(EngineDeadError):
            mp_llm.llm_engine.step()
    with pytest.raises(EngineDeadError):
        mp_llm.generate("Hello", SamplingParams(max_tokens=64), use_tqdm=False)
    assert time.monotonic() - start < 10


def test_a_request_sent_as_the_engine_dies_fails_instead_of_blocking(mp_llm):
    """A request sent after the engine process has gone but before the client's monitor has said so (a window as
    long as the monitor thread takes to run) went to a socket with no peer, whose send blocks for ever: the caller
    (the server's event loop) froze. Now it fails with EngineDeadError once the monitor has spoken."""
    client = mp_llm.llm_engine.engine_core._mp
    client.proc.kill()
    assert wait_until(lambda: client.dead, 10)
    error, client.dead_error = client.dead_error, None  # back in the window: the engine gone, the monitor to say so
    failed = threading.Event()

    def send_late() -> None:  # a thread of its own, so that a send blocking for ever fails the test, not hangs it
        with pytest.raises(EngineDeadError):
            mp_llm.llm_engine.add_request("late", "Hello", SamplingParams())
        failed.set()

    threading.Thread(target=send_late, daemon=True).start()
    time.sleep(0.5)
    client.dead_error = error  # what the monitor does
    assert failed.wait(10), "the request's send blocked"


def test_a_data_parallel_engine_that_dies_ends_the_offline_client(monkeypatch):
    """Offline, as vLLM's client, one data-parallel engine's death ends them all: LLMEngine.step() raises
    EngineDeadError then and every time after, and so does a new request. A step() after the first error waited for
    ever for the requests the dead engine had held."""
    monkeypatch.delenv("PAGEDLLM_ENABLE_MULTIPROCESSING", raising=False)
    llm = LLM(dtype="float32", max_model_len=512, kv_cache_memory="64MiB", data_parallel_size=2)
    engine, client = llm.llm_engine, llm.llm_engine.engine_core
    try:
        for i in range(4):
            engine.add_request(f"q{i}", f"Question {i}:", SamplingParams(max_tokens=300, ignore_eos=True))
        assert sorted(client.balancer.engine_of.values()) == [0, 0, 1, 1]
        client.engines[1].proc.kill()

        def step_until_done() -> None:  # vLLM's LLMEngine loop
            while engine.has_unfinished_requests():
                engine.step()

        for _ in range(2):
            errors = []
            # a thread of its own, so that a step() waiting for ever fails the test rather than hanging it
            steps = threading.Thread(target=lambda: errors.append(pytest.raises(EngineDeadError, step_until_done)),
                                     daemon=True)
            steps.start()
            steps.join(timeout=120)
            assert errors and "data-parallel engine 1" in str(errors[0].value)
        with pytest.raises(EngineDeadError, match="data-parallel engine 1"):
            llm.generate("Hello", SamplingParams(max_tokens=4), use_tqdm=False)
        assert all(e.proc.poll() is not None for e in client.engines)  # the surviving engine stopped too
    finally:
        llm.shutdown()


def test_a_message_the_engine_cannot_read_ends_it_loudly(mp_llm):
    """A request the engine's decoder refuses (a frontend bug: a field of a type the IPC struct does not take) ended
    the engine's input thread alone, leaving the engine deaf and every later request waiting forever; now the
    engine dies, saying why, and the caller gets EngineDeadError at once."""
    from pagedllm.engine.protocol import EngineCoreRequestType

    client = mp_llm.llm_engine.engine_core._mp
    client._input_socket.send_multipart((EngineCoreRequestType.ADD.value, b"\x93not a request"))
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="could not read a message from the frontend"):
        mp_llm.generate("Hello", SamplingParams(max_tokens=4), use_tqdm=False)
    assert time.monotonic() - start < 10


@pytest.mark.timeout(240)
def test_an_engine_that_dies_idle_says_why_at_the_first_call(mp_llm):
    """An engine that dies before any request (here: a message it cannot read; a worker lost while idle is another)
    sends its last words as any other death does, but the first call after it raised a bare "died unexpectedly":
    the sync client's send saw the monitor's dead flag before the error that carries them existed, and an AsyncLLM
    made before its event loop had no output handler to take that error. Now every first call carries them."""
    import asyncio

    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine.protocol import EngineCoreRequestType

    # made before its loop runs: its output handler starts with its first request
    async_llm = AsyncLLM.from_engine_args(EngineArgs(dtype="float32", max_model_len=512, kv_cache_memory="64MiB"))
    try:
        for client in (mp_llm.llm_engine.engine_core._mp, async_llm.engine_core._mp):
            client._input_socket.send_multipart((EngineCoreRequestType.ADD.value, b"\x93not a request"))
            assert wait_until(lambda: client.dead, 10)
        last_words = "died: RuntimeError: The engine could not read a message from the frontend"
        with pytest.raises(EngineDeadError, match=last_words):
            mp_llm.generate("Hello", SamplingParams(max_tokens=4), use_tqdm=False)

        async def first_calls() -> None:
            with pytest.raises(EngineDeadError, match=last_words):
                await async_llm.check_health()
            with pytest.raises(EngineDeadError, match=last_words):
                async for _ in async_llm.generate("Hello", SamplingParams(max_tokens=4), "r"):
                    pass

        asyncio.run(first_calls())
    finally:
        async_llm.shutdown()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("data_parallel_size", [1, 2])
def test_shutdown_ends_a_generate_waiting_for_outputs(monkeypatch, data_parallel_size):
    """shutdown() while generate() waits for the engine's outputs (in another thread, or the thread a signal
    handler that shuts down interrupted): the engine's exit was a shutdown, not a death, so nothing told the waiting
    step, which waited for ever. Now it raises EngineDeadError, and the requests end."""
    monkeypatch.delenv("PAGEDLLM_ENABLE_MULTIPROCESSING", raising=False)
    llm = LLM(dtype="float32", max_model_len=512, kv_cache_memory="64MiB", data_parallel_size=data_parallel_size)
    errors = []

    def generate() -> None:
        try:
            llm.generate(["Hello", "Hi"], SamplingParams(max_tokens=400, ignore_eos=True), use_tqdm=False)
        except EngineDeadError as e:
            errors.append(e)

    thread = threading.Thread(target=generate, daemon=True)  # a step waiting for ever fails the test, not hangs it
    thread.start()
    assert wait_until(llm.llm_engine.has_unfinished_requests, 30)
    time.sleep(1)
    llm.shutdown()
    thread.join(timeout=20)
    assert not thread.is_alive(), "generate() still waits for the outputs of an engine shut down"
    assert len(errors) == 1 and "shut down" in str(errors[0])
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("end", ["the engine dies", "shutdown"])
def test_an_async_stream_ends_when_its_engine_dies_or_shuts_down(end):
    """A stream in flight through AsyncLLM ends, never hangs: with EngineDeadError when the engine process dies
    mid-stream, with a last "abort" output when the engine is shut down; the engine process is gone either way."""
    import asyncio

    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.sampling_params import RequestOutputKind

    async def run() -> None:
        engine = AsyncLLM.from_engine_args(EngineArgs(dtype="float32", max_model_len=512, kv_cache_memory="64MiB"))
        proc = psutil.Process(engine.engine_core.proc.pid)
        try:
            stream = engine.generate("Hello", SamplingParams(max_tokens=400, ignore_eos=True,
                                                             output_kind=RequestOutputKind.DELTA), "r")
            assert not (await asyncio.wait_for(stream.__anext__(), 60)).finished

            async def rest() -> list:
                return [output async for output in stream]

            if end == "shutdown":
                engine.shutdown()
                outputs = await asyncio.wait_for(rest(), 20)
                assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
            else:
                proc.kill()
                with pytest.raises(EngineDeadError):
                    await asyncio.wait_for(rest(), 20)
            assert not engine.output_processor.has_unfinished_requests()
        finally:
            engine.shutdown()
        assert not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE

    asyncio.run(run())


def test_an_llm_garbage_collected_stops_its_engine(monkeypatch):
    """As vLLM's client: an LLM dropped without shutdown() stops its engine process and removes its IPC directory
    when it is collected (and at the latest when the interpreter exits), not when the process ends."""
    monkeypatch.delenv("PAGEDLLM_ENABLE_MULTIPROCESSING", raising=False)
    llm = LLM(dtype="float32", max_model_len=512, kv_cache_memory="64MiB")
    client = llm.llm_engine.engine_core._mp
    proc, ipc_dir = psutil.Process(client.proc.pid), client._ipc_dir
    del llm, client
    gc.collect()
    assert not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    assert not os.path.exists(ipc_dir)


def test_an_async_llm_garbage_collected_stops_its_engine(monkeypatch):
    """As vLLM's AsyncLLM (its __del__): one dropped without shutdown() stops its engine process and removes its IPC
    directory when it is collected. Its output handler task held it, so the engine ran on until the interpreter
    exited, and the directory stayed behind even then."""
    import asyncio

    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM

    async def run() -> None:  # the checks while the event loop still runs (its end cancels the handler task)
        engine = AsyncLLM.from_engine_args(EngineArgs(dtype="float32", max_model_len=512, kv_cache_memory="64MiB"))
        async for output in engine.generate("Hello", SamplingParams(max_tokens=2), "r"):
            pass
        assert output.finished
        proc, ipc_dir = psutil.Process(engine.engine_core.proc.pid), engine.engine_core._mp._ipc_dir
        del engine, output
        gc.collect()
        assert not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
        assert not os.path.exists(ipc_dir)

    asyncio.run(run())


def test_async_llm_requests_may_share_an_id_and_aborting_it_stops_them_all():
    """As vLLM's AsyncLLM.generate: an id already running is taken (each request runs under a unique id of its own),
    each generate() gets its own request's outputs under the caller's id, and abort(id) ends every request running
    under it with an "abort" output, leaving no KV block held."""
    import asyncio

    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM

    async def last_output(engine: AsyncLLM, prompt_token_ids: list[int], max_tokens: int):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        async for output in engine.generate({"prompt_token_ids": prompt_token_ids}, params, "twin"):
            pass
        return output

    def summary(output) -> tuple:
        completion = output.outputs[0]
        return output.request_id, output.prompt_token_ids, len(completion.token_ids), completion.finish_reason

    async def run() -> None:
        engine = AsyncLLM.from_engine_args(EngineArgs(dtype="float32", max_model_len=512, kv_cache_memory="64MiB"))
        try:
            done = await asyncio.gather(last_output(engine, [1, 2, 3], 4), last_output(engine, [4, 5], 2))
            assert [summary(output) for output in done] == [("twin", [1, 2, 3], 4, "length"),
                                                            ("twin", [4, 5], 2, "length")]
            running = [asyncio.create_task(last_output(engine, ids, 400)) for ids in ([1, 2, 3], [4, 5])]
            await asyncio.sleep(0)  # both added
            await engine.abort("twin")
            aborted = await asyncio.gather(*running)
            assert [summary(output)[::3] for output in aborted] == [("twin", "abort")] * 2
            stats = await engine.get_stats()
            assert stats.num_running_reqs == stats.num_waiting_reqs == 0 and stats.kv_cache_usage == 0.0
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_async_llm_generate_takes_vllms_keyword_arguments():
    """vLLM's AsyncLLM.generate keywords: tokenization_kwargs reach the tokenizer (here truncating the prompt),
    trace_headers are dropped without tracing, data_parallel_rank names an engine (a rank out of range is a
    ValueError, before anything is added). And vLLM's from_vllm_config, reset_encoder_cache (nothing to reset),
    wait_for_requests_to_drain (until no request is in flight, else a TimeoutError) and add_request, whose collector
    gets the request's outputs."""
    import asyncio

    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM

    params = SamplingParams(max_tokens=2, ignore_eos=True)

    async def run() -> None:
        engine = AsyncLLM.from_vllm_config(EngineArgs(dtype="float32", max_model_len=512,
                                                      kv_cache_memory="64MiB").create_engine_config())
        try:
            async for output in engine.generate("One, two, three, four", params, "a", data_parallel_rank=0,
                                                tokenization_kwargs={"truncation": True, "max_length": 2},
                                                trace_headers={"traceparent": "00-0af7651916cd43dd-01"}):
                pass
            assert output.prompt_token_ids == engine.get_tokenizer().encode("One, two, three, four")[:2]
            assert len(output.outputs[0].token_ids) == 2
            with pytest.raises(ValueError, match=r"data_parallel_rank 1 is out of range \[0, 1\)"):
                async for output in engine.generate("Hi", params, "b", data_parallel_rank=1):
                    pass
            assert engine.get_num_unfinished_requests() == 0
            await engine.reset_encoder_cache()

            async def last_output(request_id: str, max_tokens: int):
                async for output in engine.generate("Hi", SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                                    request_id):
                    pass
                return output

            short = asyncio.create_task(last_output("short", 8))
            await asyncio.sleep(0)  # the task adds its request
            assert engine.get_num_unfinished_requests() == 1
            await engine.wait_for_requests_to_drain()
            assert engine.get_num_unfinished_requests() == 0
            # Drained means finished in the engine; the task may not have taken its last output from its queue yet.
            assert (await short).finished
            long = asyncio.create_task(last_output("long", 400))
            await asyncio.sleep(0)
            with pytest.raises(TimeoutError, match="waiting for requests to drain"):
                await engine.wait_for_requests_to_drain(drain_timeout=0.2)
            await engine.abort("long")
            assert (await long).outputs[0].finish_reason == "abort"

            collector = await engine.add_request("low", {"prompt_token_ids": [1, 2]},
                                                 SamplingParams(max_tokens=3, ignore_eos=True))
            outputs = [await collector.get()]
            while not outputs[-1].finished:
                outputs.append(await collector.get())
            # each holds everything so far (CUMULATIVE): one the consumer had not taken when the next came is replaced
            num_tokens = [len(o.outputs[0].token_ids) for o in outputs]
            assert num_tokens[-1] == 3 and num_tokens == sorted(set(num_tokens)) and collector.get_nowait() is None
            assert outputs[-1].request_id == "low" and engine.get_num_unfinished_requests() == 0
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_async_llm_made_before_its_event_loop_serves_in_the_loop_that_runs_later():
    """vLLM's AsyncLLM may be made with no event loop running (a script makes the engine, then asyncio.run()s what
    uses it; vLLM's from_engine_args takes start_engine_loop and usage_context positionally before stat_loggers):
    the engine's outputs then go to the loop of the first request."""
    import asyncio

    from pagedllm.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(EngineArgs(dtype="float32", max_model_len=512, kv_cache_memory="64MiB"),
                                       True, None, None)

    async def run() -> list[int]:
        async for output in engine.generate("One, two, three", SamplingParams(max_tokens=4, temperature=0), "a"):
            pass
        return output.outputs[0].token_ids

    try:
        token_ids = asyncio.run(run())
        with pytest.raises(RuntimeError, match="serves the event loop of its first request"):
            asyncio.run(asyncio.wait_for(run(), 60))  # vLLM's serves one loop too; a clear error, not a wait
    finally:
        engine.shutdown()
    llm = LLM(dtype="float32", max_model_len=512, kv_cache_memory="64MiB")
    try:
        expected = llm.generate("One, two, three", SamplingParams(max_tokens=4, temperature=0))[0].outputs[0]
    finally:
        llm.shutdown()
    assert token_ids == expected.token_ids and len(token_ids) == 4
    config = EngineArgs(dtype="float32", max_model_len=512, kv_cache_memory="64MiB").create_engine_config()
    with pytest.raises(ValueError, match="aggregate_engine_logging is not supported"):
        AsyncLLM.from_vllm_config(config, True, None, None, False, True)  # vLLM's positional order


def test_loop_queue_keeps_what_came_before_its_loop_in_order():
    """Outputs a client's thread delivers before any event loop takes them (an engine that died before the loop
    started) wait, in order, for the loop of the first get; later ones reach that loop from any thread."""
    import asyncio

    outputs = core_client.LoopQueue()
    for item in range(3):
        outputs.put(item)

    async def run() -> list[int]:
        got = [await outputs.get() for _ in range(3)]
        later = threading.Thread(target=lambda: [outputs.put(item) for item in (3, 4)])
        later.start()
        got += [await asyncio.wait_for(outputs.get(), 10), await asyncio.wait_for(outputs.get(), 10)]
        later.join()
        return got

    assert asyncio.run(run()) == [0, 1, 2, 3, 4]


def test_outputs_a_slow_consumer_has_not_taken_are_merged_as_vllms():
    """vLLM's RequestOutputCollector: outputs waiting for the consumer become one. DELTA ones are joined per
    sequence (text, tokens, logprobs; the last one's finish), a sequence not there yet (n > 1) added; a CUMULATIVE
    one replaces the one waiting; an error takes the place of what waits, and what comes after it is dropped."""
    import asyncio

    from pagedllm.engine.output_processor import RequestOutputCollector
    from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
    from pagedllm.sampling_params import RequestOutputKind

    def output(index: int, text: str, token_ids: list[int], finish_reason=None) -> RequestOutput:
        completion = CompletionOutput(index, text, token_ids, -float(token_ids[-1]),
                                      [{t: Logprob(-1.0)} for t in token_ids], finish_reason)
        return RequestOutput("r", "p", [1], None, [completion], finish_reason is not None, num_cached_tokens=2)

    delta = RequestOutputCollector(RequestOutputKind.DELTA, "r")
    for index, text, token_ids in ((0, "a", [1]), (1, "x", [9]), (0, "b", [2, 3])):
        delta.put(output(index, text, token_ids))
    delta.put(output(0, "c", [4], "length"))
    merged = delta.get_nowait()
    assert [(c.index, c.text, c.token_ids, len(c.logprobs), c.cumulative_logprob, c.finish_reason)
            for c in merged.outputs] == [(0, "abc", [1, 2, 3, 4], 4, -4.0, "length"), (1, "x", [9], 1, -9.0, None)]
    assert merged.finished and delta.get_nowait() is None
    delta.put(output(0, "d", [5]))
    assert asyncio.run(delta.get()).outputs[0].token_ids == [5]

    cumulative = RequestOutputCollector(RequestOutputKind.CUMULATIVE, "r")
    cumulative.put(output(0, "a", [1]))
    cumulative.put(output(0, "ab", [1, 2]))
    assert [(c.text, c.token_ids) for c in cumulative.get_nowait().outputs] == [("ab", [1, 2])]
    cumulative.put(output(0, "abc", [1, 2, 3]))
    cumulative.put(EngineDeadError("gone"))
    cumulative.put(output(0, "abcd", [1, 2, 3, 4], "abort"))
    with pytest.raises(EngineDeadError, match="gone"):
        cumulative.get_nowait()


def test_the_engine_core_fails_a_request_it_cannot_take_and_serves_on(tmp_path):
    """Driven directly (without a frontend's checks), the engine core answers a request whose id is already in flight,
    and one whose LoRA adapter cannot be loaded, each with an error output (vLLM's: the request fails, not the
    engine); the request in flight runs on, and the engine serves the next request."""
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.core_client import SyncMPClient
    from pagedllm.lora.request import LoRARequest

    config = EngineArgs(dtype="float32", max_model_len=512, kv_cache_memory="64MiB", enable_lora=True,
                        max_lora_rank=8).create_engine_config()
    client = SyncMPClient(config)

    def add(request_id: str, max_tokens: int, lora_request=None) -> None:
        client.add_request(EngineCoreRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=max_tokens,
                                                                                   ignore_eos=True),
                                             None, time.time(), lora_request=lora_request))

    def outputs_until(done) -> list[EngineCoreOutput]:
        seen: list[EngineCoreOutput] = []
        while not done(seen):
            seen += client.get_output().outputs
        return seen

    try:
        add("a", 400)
        add("a", 4)
        add("lora", 4, LoRARequest("gone", 1, str(tmp_path / "gone")))
        errors = outputs_until(lambda seen: sum(out.error is not None for out in seen) == 2)
        assert sorted((out.request_id, out.finished) for out in errors if out.error is not None) == \
            [("a", True), ("lora", True)]
        assert "already in the scheduler" in next(out.error for out in errors if out.request_id == "a" and out.error)
        assert any(out.request_id == "a" and out.error is None for out in errors)  # the first "a" runs on
        client.abort_requests(["a"])
        add("b", 4)
        served = outputs_until(lambda seen: any(out.request_id == "b" and out.finished for out in seen))
        assert sum(len(out.new_token_ids) for out in served if out.request_id == "b") == 4
    finally:
        client.shutdown()


def test_async_llm_abort_stops_a_beam_search_and_all_its_step_requests():
    """abort(id) of a beam search stops every step request it runs under that id, leaving no KV block held, and the
    search ends as vLLM's does on an aborted step: one finished output, its live beams' finish_reason "abort". The
    abort lands wherever the search is (a step's requests in flight, or between two steps): either way it ends."""
    import asyncio

    from pagedllm.sampling_params import BeamSearchParams
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM

    async def run() -> None:
        engine = AsyncLLM.from_engine_args(EngineArgs(dtype="float32", max_model_len=512, kv_cache_memory="64MiB"))
        try:
            params = BeamSearchParams(beam_width=2, max_tokens=400, ignore_eos=True)
            search = asyncio.create_task(anext(engine.beam_search({"prompt_token_ids": [1, 2, 3]}, "beams", params)))
            while engine.output_processor.get_num_unfinished_requests() < 2:  # a step of both beams under way
                await asyncio.sleep(0.001)
            await engine.abort("beams")
            output = await asyncio.wait_for(search, 60)  # without the abort the search runs 400 steps
            assert output.finished and [o.finish_reason for o in output.outputs] == ["abort"] * 2
            stats = await engine.get_stats()
            assert stats.num_running_reqs == stats.num_waiting_reqs == 0 and stats.kv_cache_usage == 0.0
            assert not engine.output_processor.has_unfinished_requests()
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_async_llm_from_engine_args_keeps_vllms_default_stats_and_logs_requests(caplog):
    """As vLLM's AsyncLLM made from AsyncEngineArgs without stat loggers: statistics kept (outputs carry their
    metrics), the pagedllm: metrics in prometheus_client's default registry (an engine made after another's takes
    them over), the log line when do_log_stats() asks, each request logged with enable_log_requests; is_running
    until shutdown, then is_stopped with its dead_error."""
    import asyncio
    import logging

    from prometheus_client import REGISTRY

    from pagedllm import AsyncEngineArgs, AsyncLLMEngine

    def generated_tokens() -> float:
        return REGISTRY.get_sample_value("pagedllm:generation_tokens_total", {"model_name": "smollm2-135m-instruct",
                                                                              "engine": "0"})

    async def run() -> None:
        for _ in range(2):
            engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
                dtype="float32", max_model_len=512, kv_cache_memory="64MiB", enable_log_requests=True))
            assert engine.is_running and not engine.is_stopped and engine.get_tokenizer() is engine.tokenizer
            async for output in engine.generate("Hello", SamplingParams(max_tokens=3, ignore_eos=True), "req-7"):
                pass
            assert output.finished and output.metrics is not None and output.metrics.num_generation_tokens == 3
            assert generated_tokens() == 3  # this engine's alone
            assert re.search(r"Added request req-7-[0-9a-f]{8}\.", caplog.text)  # vLLM's: the engine's unique id
            caplog.clear()
            await engine.do_log_stats()
            assert "Avg generation throughput" in caplog.text
            engine.shutdown()
            assert engine.is_stopped and isinstance(engine.dead_error, EngineDeadError)

    with caplog.at_level(logging.INFO):
        asyncio.run(run())


@pytest.mark.parametrize("value", ["false", "off", ""])
def test_enable_multiprocessing_takes_an_integer(monkeypatch, value):
    """PAGEDLLM_ENABLE_MULTIPROCESSING is read as vLLM reads VLLM_ENABLE_V1_MULTIPROCESSING, bool(int(...)): "false"
    turned multiprocessing ON; now it is an error naming the variable, before any process starts."""
    monkeypatch.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", value)
    with pytest.raises(ValueError, match="PAGEDLLM_ENABLE_MULTIPROCESSING"):
        LLM(max_model_len=64)
    for value, enabled in (("0", False), ("1", True)):
        monkeypatch.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", value)
        assert multiprocessing_enabled() is enabled


def test_ipc_types_are_msgspec_structs_that_round_trip():
    for cls in (EngineCoreRequest, EngineCoreOutput, EngineCoreOutputs, SchedulerStats, SamplingParams):
        assert issubclass(cls, msgspec.Struct)
        assert cls.__struct_config__.gc is False or cls is SamplingParams
    request = EngineCoreRequest("r1", [1, 2, 3], SamplingParams(temperature=0.5, stop=["x"]), 2, 1.5, priority=3)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest) == request
    outputs = EngineCoreOutputs([EngineCoreOutput("r1", [7], finish_reason=FinishReason.LENGTH)],
                                SchedulerStats(num_running_reqs=1))
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(outputs), type=EngineCoreOutputs)
    assert decoded.outputs[0].finish_reason == FinishReason.LENGTH and decoded.scheduler_stats.num_running_reqs == 1


def test_sampling_params_numbers_cross_to_the_engine_or_name_the_field():
    """The engine process decodes a request strictly typed, and a request it cannot decode never reaches the
    scheduler (nor does an error reach the caller, who waits on): so a bool is its int (vLLM's logprobs=True is 1),
    and a float where an integer belongs is a ValueError naming the field before the request is sent."""
    params = SamplingParams(logprobs=True, prompt_logprobs=False, n=True, seed=True, stop_token_ids=[True],
                            temperature=1, top_p=True)
    assert (params.logprobs, params.prompt_logprobs, params.n, params.seed, params.stop_token_ids) == (1, 0, 1, 1, [1])
    request = EngineCoreRequest("r1", [1, 2, 3], params, 2, 1.5)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest) == request
    for field, value in (("top_k", 2.5), ("max_tokens", 8.0), ("min_tokens", 1.5), ("logprobs", 1.5),
                         ("prompt_logprobs", "1"), ("temperature", "0.5")):
        with pytest.raises(ValueError, match=f"^{field} must be"):
            SamplingParams(**{field: value})


def test_sampling_params_bools_cross_to_the_engine_or_name_the_field():
    """The engine process decodes a bool field as a bool only: an int there is its truth (ignore_eos=1, which vLLM
    reads as Python does), anything else a ValueError naming the field, so that no request ends the engine, which
    cannot decode it."""
    fields = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
              "detokenize")
    params = SamplingParams(**dict.fromkeys(fields, 1))
    assert all(getattr(params, field) is True for field in fields)
    assert SamplingParams(ignore_eos=0).ignore_eos is False
    request = EngineCoreRequest("r1", [1, 2, 3], params, 2, 1.5)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest) == request
    for field in fields:
        with pytest.raises(ValueError, match=f"^{field} must be a boolean"):
            SamplingParams(**{field: "yes"})


def test_engine_and_worker_processes_import_no_frontend_libraries(tmp_path):
    """An engine or worker process imports its modules and unpickles the frontend's EngineConfig; neither may
    import transformers or xgrammar (seconds of every engine start): the HF config travels as plain values
    (config.HFConfigValues), the tokenizer and grammar library load when a first request needs a grammar."""
    import pickle
    import sys

    from pagedllm.engine.arg_utils import EngineArgs

    config = EngineArgs(dtype="float32", max_model_len=512, tensor_parallel_size=3).create_engine_config()
    (tmp_path / "config.pkl").write_bytes(pickle.dumps(config))
    script = ("import pickle, sys\n"
              "import pagedllm.engine.core_proc, pagedllm.executor.multiproc, pagedllm.executor.worker_proc\n"
              f"config = pickle.loads(open({str(tmp_path / 'config.pkl')!r}, 'rb').read())\n"
              "assert config.model_config.hf_config.num_key_value_heads == 3\n"
              "print(sorted(m for m in ('transformers', 'xgrammar') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_async_llm_sleep_keeps_or_aborts_the_requests_in_flight():
    """vLLM's AsyncLLM.sleep / wake_up / is_sleeping: with mode "keep" a request in flight waits while the engine
    sleeps (its KV cache dropped at level 1) and finishes whole after wake_up, recomputed; with "abort" (the
    default) its stream ends with an "abort" output, which the stat loggers count as finished (as vLLM's engine
    sends it). A request added while asleep waits for wake_up. So do pause_generation / resume_generation /
    is_paused."""
    import asyncio

    from prometheus_client import REGISTRY

    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.metrics.reader import get_metrics_snapshot

    def num_aborted() -> float:
        return sum(m.value for m in get_metrics_snapshot(REGISTRY)
                   if m.name == "pagedllm:request_success" and m.labels.get("finished_reason") == "abort")

    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)

    async def last_output(engine: AsyncLLM, request_id: str, started: asyncio.Event):
        async for output in engine.generate("One, two, three,", params, request_id):
            started.set()
        return output

    async def run() -> None:
        engine = AsyncLLM.from_engine_args(EngineArgs(dtype="float32", max_model_len=512, kv_cache_memory="64MiB"))
        try:
            alone = await last_output(engine, "alone", asyncio.Event())
            started = asyncio.Event()
            kept = asyncio.create_task(last_output(engine, "kept", started))
            await started.wait()
            await engine.sleep(level=1, mode="keep")
            assert await engine.is_sleeping()
            late = asyncio.create_task(last_output(engine, "late", asyncio.Event()))
            await asyncio.sleep(0.5)
            assert not kept.done() and not late.done() and engine.get_num_unfinished_requests() == 2
            assert await engine.get_supported_tasks() == ("generate",)
            assert await engine.wake_up() is True and not await engine.is_sleeping()
            for output in await asyncio.gather(kept, late):
                assert output.outputs[0].token_ids == alone.outputs[0].token_ids

            started = asyncio.Event()
            aborted = asyncio.create_task(last_output(engine, "aborted", started))
            await started.wait()
            await engine.sleep()
            assert (await aborted).outputs[0].finish_reason == "abort" and num_aborted() == 1
            assert await engine.wake_up()

            started = asyncio.Event()  # vLLM's pause_generation: sleep at level 0, its cache kept if asked
            paused = asyncio.create_task(last_output(engine, "paused", started))
            await started.wait()
            await engine.pause_generation(mode="keep", clear_cache=False)
            assert await engine.is_paused()
            await asyncio.sleep(0.3)
            assert not paused.done()
            await engine.resume_generation()
            assert (await paused).outputs[0].token_ids == alone.outputs[0].token_ids and not await engine.is_paused()

            # vLLM's mode "wait": the request in flight runs to its end, then the engine pauses; one added meanwhile
            # waits for resume_generation
            started = asyncio.Event()
            waited = asyncio.create_task(last_output(engine, "waited", started))
            await started.wait()
            pausing = asyncio.create_task(engine.pause_generation(mode="wait"))
            await asyncio.sleep(0)  # the pause sent, before the next request
            late = asyncio.create_task(last_output(engine, "late", asyncio.Event()))
            await pausing
            assert await engine.is_paused()
            assert (await waited).outputs[0].token_ids == alone.outputs[0].token_ids
            await asyncio.sleep(0.3)
            assert not late.done()
            await engine.resume_generation()
            assert (await late).outputs[0].token_ids == alone.outputs[0].token_ids
        finally:
            engine.shutdown()

    asyncio.run(run())


class VllmStatLogger:
    """A custom logger on vLLM's StatLoggerBase interface."""

    def __init__(self, vllm_config, engine_index: int = 0) -> None:
        self.records: list[tuple] = []
        self.initialized = False
        self.logs = 0

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        self.records.append((scheduler_stats, iteration_stats, mm_cache_stats, engine_idx))

    def log_engine_initialized(self) -> None:
        self.initialized = True

    def log(self) -> None:
        self.logs += 1


def test_llm_engine_and_async_llm_take_vllms_custom_stat_loggers(monkeypatch):
    """vLLM's stat_loggers (LLMEngine's and AsyncLLM's from_vllm_config and from_engine_args): each factory's logger
    is told the engine has started, records every step with the engine's index as vLLM's keyword engine_idx (its
    mm_cache_stats left None), and logs on do_log_stats(); vLLM's default loggers run beside it."""
    import asyncio

    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine.llm_engine import LLMEngine

    monkeypatch.setenv("PAGEDLLM_LOG_STATS_INTERVAL", "3600")  # no interval's log beside do_log_stats()'s

    def check(stat_logger: VllmStatLogger) -> None:
        assert stat_logger.initialized and stat_logger.logs == 1
        assert any(iteration_stats is not None for _, iteration_stats, _, _ in stat_logger.records)
        assert {(mm_cache_stats, engine_idx) for _, _, mm_cache_stats, engine_idx in stat_logger.records} == {(None, 0)}

    engine_args = EngineArgs(dtype="float32", max_model_len=512, kv_cache_memory="64MiB")
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine = LLMEngine.from_engine_args(engine_args, stat_loggers=[VllmStatLogger])
    try:
        engine.add_request("r", "Hi", params)
        while engine.has_unfinished_requests():
            engine.step()
        engine.do_log_stats()
        check(engine.stat_loggers[-1].loggers[0])  # the one engine's, made with (config, 0) as vLLM's
        assert engine.get_metrics()  # the default loggers' metrics
    finally:
        engine.shutdown()

    async def run() -> None:
        engine = AsyncLLM.from_engine_args(engine_args, stat_loggers=[VllmStatLogger])
        try:
            async for _ in engine.generate("Hi", params, "r"):
                pass
            await engine.do_log_stats()
            check(engine.stat_loggers[0].loggers[0])
            assert len(engine.stat_loggers) == 3  # vLLM's defaults: Prometheus and the log line
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_a_stat_logger_that_fails_stops_the_engine_it_was_to_watch():
    """A user's logger factory that raises fails the engine's construction and leaves no engine process (it was left
    running: the engine's finalizer came after the loggers)."""
    import asyncio

    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine.llm_engine import LLMEngine

    def failing(config, engine_index):
        raise RuntimeError("the logger failed")

    engine_args = EngineArgs(dtype="float32", max_model_len=512, kv_cache_memory="64MiB")
    before = {p.pid for p in engine_processes()}
    with pytest.raises(RuntimeError, match="the logger failed"):
        LLMEngine.from_engine_args(engine_args, stat_loggers=[failing])

    async def run() -> None:
        with pytest.raises(RuntimeError, match="the logger failed"):
            AsyncLLM.from_engine_args(engine_args, stat_loggers=[failing])

    asyncio.run(run())
    assert {p.pid for p in engine_processes()} <= before


def test_data_parallel_engines_are_stopped_together_within_one_timeout():
    """A data-parallel client's shutdown tells every engine process (SIGTERM) before it waits for any, as vLLM's
    engine manager does: it told engine k only once engine k-1 had exited, so a slow first engine spent the others'
    grace. Each engine's sockets close after."""
    from pagedllm.engine.dp_client import DPSyncMPClient

    events: list[tuple[str, str]] = []

    class Process:  # the parts of a Popen stop_processes uses
        def __init__(self, name: str) -> None:
            self.name, self.pid, self.returncode = name, 0, None

        def poll(self):
            return self.returncode

        def terminate(self) -> None:
            events.append(("SIGTERM", self.name))

        def wait(self, timeout=None) -> int:
            events.append(("exited", self.name))
            self.returncode = 0
            return 0

    class Engine:  # an MPClient's state that its shutdown reads
        def __init__(self, name: str) -> None:
            self._closing, self.proc = False, Process(name)

        def _close(self) -> None:
            events.append(("closed", self.proc.name))

    client = DPSyncMPClient.__new__(DPSyncMPClient)
    client.engines, client._outputs = [Engine("0"), Engine("1")], queue.Queue()
    client.shutdown(timeout=5)
    assert events == [("SIGTERM", "0"), ("SIGTERM", "1"), ("exited", "0"), ("exited", "1"), ("closed", "0"),
                      ("closed", "1")]
