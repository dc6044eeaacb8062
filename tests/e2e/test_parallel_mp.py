"""Tensor and pipeline parallelism on the multi-process executor hold the oracle: greedy float32 output token for
token equal to one rank's (the package's shared engine) for the 8 mixed-length prompts of test_llm_parity, under
chunked prefill and forced preemption at once. SmolLM2 has 9 attention heads and 3 KV heads: tp=3 splits both,
pp=2 splits its 30 layers. A rank killed mid-generation fails the engine within seconds, leaving no process and no
shared-memory segment behind."""
from __future__ import annotations

import contextlib
import gc
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.executor.multiproc import WorkerError
from tests.e2e.conftest import running_llm
from tests.e2e.parallel_helpers import command_line, engine_processes, shm_segments, wait_until, worker_processes
from pagedllm import LLM, SamplingParams
from tests.e2e.test_llm_parity import PROMPT_LENGTHS, make_prompts

# 64-token chunks and 26 blocks of 16, what the longest prompt and its output need, longest prompts first: a request
# is admitted once the free blocks hold its whole prompt (vLLM's scheduler_reserve_full_isl), which its prefix hit on
# the longer ones makes possible, and their outputs then outgrow the pool: chunked prefill and preemption.
STRESS = dict(dtype="float32", max_model_len=1024, max_num_batched_tokens=64, num_kv_blocks=26)
LENGTHS = PROMPT_LENGTHS[::-1]
MAX_TOKENS = 12  # enough decode steps to reach preemption; each tp=3 step is slow on 2 cores


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return make_prompts(tokenizer)[::-1]


@pytest.fixture(scope="module")
def expected(llm, prompts):
    return run(llm, prompts)


def assert_same(got, expected):
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} ({LENGTHS[i]} tokens) diverges at token " \
                       f"{next(k for k, (a, b) in enumerate(zip(g, e)) if a != b)}"


def test_pipeline_parallel_2(prompts, expected):
    with running_llm(pipeline_parallel_size=2, **STRESS) as llm:
        assert len(worker_processes()) == 2
        assert_same(run(llm, prompts), expected)
        assert llm.get_stats().num_preemptions > 0
    assert wait_until(lambda: not worker_processes(), 10)
    assert not shm_segments()


def test_tensor_parallel_3_then_a_rank_dies(prompts, expected):
    before = shm_segments()
    with running_llm(tensor_parallel_size=3, distributed_executor_backend="mp", **STRESS) as llm:
        workers = worker_processes()
        assert len(workers) == 3
        assert_same(run(llm, prompts), expected)
        assert llm.get_stats().num_preemptions > 0

        # Kill rank 1 while the engine generates: the call fails with a clear error, well within 10 s.
        victim = next(w for w in workers if command_line(w)[-1] == "1")
        threading.Timer(1.0, victim.kill).start()
        started = time.monotonic()
        with pytest.raises(EngineDeadError):
            run(llm, prompts * 4)
        assert time.monotonic() - started < 11
    assert wait_until(lambda: not worker_processes(), 10), "workers outlived their engine"
    assert shm_segments() <= before, "the broadcast queue's segment was left in /dev/shm"


def test_a_rank_that_dies_while_the_engine_is_idle_ends_it_then():
    """As vLLM's worker monitor: an idle engine looks at its workers at every idle wake, so a rank lost while
    nothing runs ends the engine then (a server's /health turns 503), not at the next request."""
    before = shm_segments()
    with running_llm(pipeline_parallel_size=2, dtype="float32", max_model_len=256, kv_cache_memory="32MiB") as llm:
        workers = worker_processes()
        next(w for w in workers if command_line(w)[-1] == "1").kill()
        assert wait_until(lambda: llm.llm_engine.engine_core._mp.dead, 10), "the idle engine did not notice"
        with pytest.raises(EngineDeadError):
            llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)
    assert wait_until(lambda: not worker_processes(), 10), "workers outlived their engine"
    assert shm_segments() <= before


@pytest.mark.timeout(300)
def test_a_tp2_llm_dropped_leaves_nothing_and_a_rank_killed_mid_step_fails_it(tmp_path, tokenizer):
    """Tensor parallelism on the tiny model: an LLM dropped without shutdown() (its __del__) leaves nothing, no
    engine, no worker, no queue segment in /dev/shm; a rank killed while the engine steps fails the generate() with
    an error naming it, within seconds, and leaves nothing either."""
    from tests.e2e.test_parallel_tiny_models import save_tiny_model

    save_tiny_model(tmp_path, tokenizer, "llama")
    before, engines_before = shm_segments(), {p.pid for p in engine_processes()}

    def assert_nothing_left() -> None:
        assert wait_until(lambda: not worker_processes(), 10), "workers outlived their engine"
        assert wait_until(lambda: not {p.pid for p in engine_processes()} - engines_before, 10), "an engine is left"
        assert shm_segments() <= before, "the broadcast queue's segment was left in /dev/shm"

    for kill in (False, True):
        llm = LLM(str(tmp_path), dtype="float32", max_model_len=512, kv_cache_memory="32MiB", tensor_parallel_size=2,
                  distributed_executor_backend="mp")
        workers = worker_processes()
        assert len(workers) == 2 and len(shm_segments() - before) == 1
        prompts = [{"prompt_token_ids": [1, 50 + i]} for i in range(8)]
        if kill:
            threading.Timer(1.0, next(w for w in workers if command_line(w)[-1] == "1").kill).start()
            started = time.monotonic()
            with pytest.raises(EngineDeadError, match="worker rank 1 died"):
                llm.generate(prompts, SamplingParams(max_tokens=500, ignore_eos=True), use_tqdm=False)
            assert time.monotonic() - started < 15
        else:
            assert len(llm.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)) == 8
        del llm
        gc.collect()
        assert_nothing_left()


def test_a_rank_that_raises_is_named_with_its_exception_not_its_traceback(monkeypatch):
    """A rank's exception ends the engine with an error naming the rank and the exception, which a server's
    clients read in their 503s; the traceback stays in the rank's log (it was in the error too: file paths, code)."""
    monkeypatch.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")  # the executor in this process, to call it
    with running_llm(pipeline_parallel_size=2, dtype="float32", max_model_len=256, kv_cache_memory="32MiB") as llm:
        with pytest.raises(WorkerError) as error:
            llm.llm_engine.engine_core.engine_core.executor.collective_rpc("no_such_method")
    assert re.fullmatch(r"worker rank [01] raised: AttributeError: 'Worker' object has no attribute 'no_such_method'",
                        str(error.value))
    assert wait_until(lambda: not worker_processes(), 10), "workers outlived their engine"


@pytest.mark.parametrize("interruption", ["ctrl-c in the caller", "sigterm to the engine"])
def test_a_start_up_interrupted_leaves_no_engine_or_worker(interruption):
    """Ctrl-C while LLM(...) waits for its engine (a notebook's interrupt), or the engine told to stop (SIGTERM, what
    the client's shutdown sends) while its workers load: the engine and every worker are gone by the time the
    error reaches the caller, and the caller lives on (vLLM's MPClient shuts down on any exception)."""
    before, engines_before = shm_segments(), {p.pid for p in engine_processes()}
    engines = []  # the engine process whose workers were seen loading

    def interrupt() -> None:
        if not wait_until(lambda: len(worker_processes()) == 2, 60, interval=0.02):
            return
        engines.extend(p for p in engine_processes() if p.pid not in engines_before)
        if interruption == "ctrl-c in the caller":
            os.kill(os.getpid(), signal.SIGINT)
        else:
            engines[0].terminate()

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises((KeyboardInterrupt, RuntimeError)):
        LLM(pipeline_parallel_size=2, dtype="float32", max_model_len=256, kv_cache_memory="32MiB")
    [engine] = engines
    assert not worker_processes()
    assert not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE
    assert shm_segments() <= before


def test_a_hung_rank_fails_the_step_after_the_timeout(monkeypatch):
    """A rank alive but not answering (stopped here; a deadlocked collective alike) fails the engine once a step
    has waited PAGEDLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (vLLM's VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS), naming the rank,
    instead of blocking every request forever."""
    monkeypatch.setenv("PAGEDLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3")
    with running_llm(pipeline_parallel_size=2, dtype="float32", max_model_len=256, kv_cache_memory="32MiB") as llm:
        hung = next(w for w in worker_processes() if command_line(w)[-1] == "1")
        hung.suspend()
        try:
            started = time.monotonic()
            with pytest.raises(EngineDeadError, match=r"worker rank\(s\) \[1\] did not answer within 3.0 s"):
                llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)
            assert time.monotonic() - started < 30
        finally:
            with contextlib.suppress(psutil.NoSuchProcess):  # the engine's failure stops it
                hung.resume()
    assert wait_until(lambda: not worker_processes(), 10), "workers outlived their engine"


def _fail_on_rank_1(worker) -> None:
    if worker.rank.rank == 1:
        raise ValueError("rank one says no")


def _check_collective_rpc_on_two_ranks(rpc) -> None:
    """``rpc(method, timeout, args, kwargs)``: a frontend's collective_rpc over an engine of two tensor-parallel ranks.
    Every rank runs the method (a lambda crosses to the workers with cloudpickle); one rank's exception fails the
    call naming that rank, and so does a timeout (vLLM's TimeoutError), and the engine serves on."""
    assert rpc(lambda worker, tag: (worker.rank.rank, tag), None, ("t",), None) == [(0, "t"), (1, "t")]
    with pytest.raises(RuntimeError, match=r"_fail_on_rank_1 failed: worker rank 1 raised ValueError: rank one "
                                           r"says no$"):
        rpc(_fail_on_rank_1, None, (), None)
    with pytest.raises((TimeoutError, RuntimeError), match=r"worker rank\(s\) \[0, 1\] did not answer within 0.5 s"):
        rpc(lambda worker: time.sleep(2), 0.5, (), None)
    assert rpc("check_health", None, (), None) == [True, True]


def test_collective_rpc_on_tensor_parallel_ranks_with_the_engine_core_in_process(tmp_path, tokenizer, monkeypatch):
    """vLLM's LLM.collective_rpc and apply_model with the engine core in this process and two workers in theirs."""
    from tests.e2e.test_parallel_tiny_models import save_tiny_model

    save_tiny_model(tmp_path, tokenizer, "llama")
    monkeypatch.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
    with running_llm(str(tmp_path), tensor_parallel_size=2, distributed_executor_backend="mp", dtype="float32",
                     max_model_len=256, kv_cache_memory="16MiB") as llm:
        _check_collective_rpc_on_two_ranks(llm.collective_rpc)
        assert llm.apply_model(lambda model: model.model.layers[0].self_attn.num_heads) == [2, 2]  # 4 heads split
        assert len(llm.generate("Hi", SamplingParams(max_tokens=3, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0].token_ids) == 3
    assert wait_until(lambda: not worker_processes(), 10), "workers outlived their engine"


def test_async_llm_collective_rpc_on_tensor_parallel_ranks(tmp_path, tokenizer):
    """vLLM's AsyncLLM.collective_rpc: through the engine process (the call pickled there and back) to its two
    workers."""
    import asyncio

    from pagedllm.engine.async_llm import AsyncLLM
    from tests.e2e.test_parallel_tiny_models import save_tiny_model

    save_tiny_model(tmp_path, tokenizer, "llama")

    async def run() -> None:
        engine = AsyncLLM.from_engine_args(EngineArgs(str(tmp_path), tensor_parallel_size=2, dtype="float32",
                                                      distributed_executor_backend="mp", max_model_len=256,
                                                      kv_cache_memory="16MiB"))
        loop = asyncio.get_running_loop()
        def rpc(*call):  # from the checks' thread, awaited on this loop
            return asyncio.run_coroutine_threadsafe(engine.collective_rpc(*call), loop).result()

        try:
            await loop.run_in_executor(None, _check_collective_rpc_on_two_ranks, rpc)
            async for output in engine.generate("Hi", SamplingParams(max_tokens=3, ignore_eos=True), "r"):
                pass
            assert len(output.outputs[0].token_ids) == 3
        finally:
            engine.shutdown()

    asyncio.run(run())
    assert wait_until(lambda: not worker_processes(), 10), "workers outlived their engine"


def test_a_worker_ends_on_sigterm_inside_a_blocking_call(tmp_path):
    """The executor's stop (SIGTERM) ends a worker at once wherever it is: here rank 1 waits inside torch.distributed's
    rendezvous for a store that accepted its connection and never answers (a master rank that died), a C++ call that
    a Python signal handler would wait for (the group's 600 s timeout): under load the stop then took the 5 s grace
    and a kill, and the engine's own stop behind it outlasted its grace too, leaving its shared-memory segment."""
    config = EngineArgs(dtype="float32", max_model_len=256, kv_cache_memory="32MiB",
                        pipeline_parallel_size=2).create_engine_config()
    with socket.socket() as store:
        store.bind(("127.0.0.1", 0))
        store.listen(1)
        store.settimeout(120)
        startup = tmp_path / "startup.pkl"
        startup.write_bytes(pickle.dumps((config, f"tcp://127.0.0.1:{store.getsockname()[1]}", None,
                                          f"ipc://{tmp_path}/replies", os.getpid())))
        worker = subprocess.Popen([sys.executable, "-m", "pagedllm.executor.worker_proc", str(startup), "1"])
        try:
            connection, _ = store.accept()  # rank 1 is in the rendezvous, waiting for the store's answer
            worker.terminate()
            assert worker.wait(timeout=10) == -signal.SIGTERM
            connection.close()
        finally:
            worker.kill()
