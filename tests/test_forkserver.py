"""The fork server (pagedllm/forkserver.py): a child it forks is the process `python -m` would have started, seen
through a Popen's interface; a requester it may not serve gets a fresh interpreter; it goes with its owner."""
from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import tempfile

import psutil
import pytest

from pagedllm import LLM, forkserver
from pagedllm.forkserver import ForkedProcess, server_prestarted, start_process

CHILD = "tests.forkserver_child"


def _report(capfd) -> dict:
    return json.loads(capfd.readouterr().out.strip().splitlines()[-1])


def test_a_forked_child_is_the_module_run_as_python_m_with_the_requesters_arguments_and_streams(capfd):
    proc = start_process(CHILD, ["0", "3", "two words"])
    assert isinstance(proc, ForkedProcess)
    assert proc.wait(timeout=60) == 3 and proc.returncode == 3
    report = _report(capfd)  # its stdout was this process's (pytest's capture) when it was asked for
    assert report["argv"] == ["0", "3", "two words"] and report["cwd"] == os.getcwd()
    assert report["torch_imported"]  # forked from the server's imports, not a fresh interpreter
    assert report["command_line"] == [sys.executable, "-m", CHILD, "0", "3", "two", "words"]  # its title
    assert psutil.Process(os.getpid()).children(recursive=True)  # the server stays for the next request


def test_a_requester_whose_environment_differs_gets_a_fresh_interpreter(monkeypatch, capfd):
    """A module may read a variable at import: only a fresh interpreter sees a variable set since the server
    started."""
    monkeypatch.setenv("FORKSERVER_TEST_VARIABLE", "set since")
    proc = start_process(CHILD, ["0", "0"])
    assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=60) == 0
    report = _report(capfd)
    assert report["variable"] == "set since" and not report["torch_imported"]


def test_exit_codes_signals_and_waits_as_popen_gives_them(capfd):
    raising = start_process(CHILD, ["0", "raise"])
    assert raising.wait(timeout=60) == 1
    assert "RuntimeError: the child raised" in capfd.readouterr().err
    sleeping = start_process(CHILD, ["60", "0"])
    assert sleeping.poll() is None and sleeping.returncode is None
    with pytest.raises(subprocess.TimeoutExpired):
        sleeping.wait(timeout=0.2)
    sleeping.terminate()
    assert sleeping.wait(timeout=30) == -signal.SIGTERM
    sleeping.kill()  # gone already: nothing happens, as with a Popen
    killed = start_process(CHILD, ["60", "0"])
    killed.kill()
    assert killed.wait(timeout=30) == -signal.SIGKILL and killed.poll() == -signal.SIGKILL


def test_the_server_goes_with_a_block_that_forked_nothing_and_at_the_end_of_its_input(capfd):
    """An entry point's block that failed before starting an engine leaves no process; a server whose owner is gone
    (its input ended) leaves, and the children it forked live on (they watch their requesters)."""
    forkserver.stop_server()
    with server_prestarted():
        server = forkserver._owned
        assert server.poll() is None
    assert server.returncode is not None and forkserver._owned is None
    with server_prestarted():
        child = start_process(CHILD, ["60", "0"])
        server = forkserver._owned
    assert server.poll() is None  # it forked a child: it stays for the next ones
    forkserver.stop_server()
    assert server.returncode == 0 and child.poll() is None
    child.kill()  # through its pidfd, which still names it
    assert child.wait(timeout=30) == 255  # its exit code went with the server that would have reaped it


def test_spawn_starts_fresh_interpreters_and_a_bad_method_is_an_error_before_any_process(monkeypatch, capfd):
    """PAGEDLLM_WORKER_MULTIPROC_METHOD (vLLM's VLLM_WORKER_MULTIPROC_METHOD): "spawn" starts no fork server."""
    forkserver.stop_server()
    monkeypatch.setenv(forkserver.METHOD_ENV, "spawn")
    proc = start_process(CHILD, ["0", "0"])
    assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=60) == 0 and forkserver._owned is None
    monkeypatch.setenv(forkserver.METHOD_ENV, "thread")
    children = psutil.Process().children(recursive=True)
    with pytest.raises(ValueError, match="MULTIPROC_METHOD must be one of forkserver, fork, spawn; got 'thread'"):
        LLM(dtype="float32")
    assert psutil.Process().children(recursive=True) == children


def test_a_malformed_request_leaves_the_server_serving(capfd):
    """A request that is not what the server reads (here a pickled pair) gets no child, and the server serves the
    next one."""
    address, server = forkserver._server_address(), forkserver._owned
    bad = pickle.dumps(("a", "pair"))
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(address)
        socket.send_fds(conn, [struct.pack("!q", len(bad))], [0, 1, 2])
        conn.sendall(bad)
        assert conn.recv(8) == b""  # refused: the connection closed without an answer
    proc = start_process(CHILD, ["0", "0"])  # had the server died of it, this would be a fresh interpreter
    assert isinstance(proc, ForkedProcess) and proc.wait(timeout=60) == 0 and forkserver._owned is server


def test_the_child_imports_from_the_requesters_directory(tmp_path, monkeypatch, capfd):
    """`python -m` puts the directory it was started in first on sys.path: so does a forked child, whose server
    started elsewhere."""
    (tmp_path / "forkserver_local_child.py").write_text("import os, sys\nprint(os.getcwd(), sys.path[0])\n")
    monkeypatch.chdir(tmp_path)
    proc = start_process("forkserver_local_child", [])
    assert isinstance(proc, ForkedProcess) and proc.wait(timeout=60) == 0
    assert capfd.readouterr().out.split() == [str(tmp_path), str(tmp_path)]


def test_a_process_forked_from_the_owner_leaves_its_server_alone(capfd):
    """A child of the owner (os.fork, multiprocessing's fork) neither stops nor takes its server."""
    address = forkserver._server_address()
    pid = os.fork()
    if pid == 0:
        os._exit(0 if forkserver._owned is None else 1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert os.path.exists(address) and forkserver._owned.poll() is None
    assert isinstance(start_process(CHILD, ["0", "0"]), ForkedProcess)


def test_a_deep_temporary_directory_puts_the_socket_under_tmp(tmp_path, monkeypatch, capfd):
    """AF_UNIX paths end at 107 bytes: a server whose temporary directory is deeper still starts, under /tmp."""
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    forkserver.stop_server()
    proc = start_process(CHILD, ["0", "0"])
    assert isinstance(proc, ForkedProcess) and proc.wait(timeout=60) == 0
    assert forkserver._owned_dir.startswith("/tmp/pagedllm-fs-")


def test_a_stalled_requester_holds_up_no_other_and_passed_descriptors_are_not_inherited(capfd):
    """A requester that connected and sent nothing (stopped, say) is dropped after the server's I/O timeout, so the
    next request is served; the pidfd a requester receives does not leak into the processes it starts."""
    address = forkserver._server_address()
    with socket.socket(socket.AF_UNIX) as stalled:
        stalled.connect(address)
        proc = start_process(CHILD, ["0", "0"])
        assert isinstance(proc, ForkedProcess) and proc.wait(timeout=60) == 0
        assert not os.get_inheritable(proc._pidfd)


def test_a_child_runs_on_the_requesters_cpus_with_its_umask(capfd):
    """What a fresh interpreter inherits besides the environment: the CPUs (a tensor-parallel rank's cores are
    chosen among them) and the umask, the requester's at the request, not the server's at its start."""
    forkserver._server_address()
    cpus, umask = os.sched_getaffinity(0), os.umask(0o077)
    os.sched_setaffinity(0, {min(cpus)})
    try:
        proc = start_process(CHILD, ["0", "0"])
    finally:
        os.sched_setaffinity(0, cpus)
        os.umask(umask)
    assert isinstance(proc, ForkedProcess) and proc.wait(timeout=60) == 0
    report = _report(capfd)
    assert report["cpus"] == [min(cpus)] and report["umask"] == 0o077


@pytest.mark.timeout(180)
def test_a_child_whose_requesters_pid_now_names_another_process_leaves():
    """exit_when_parent_dies: a requester (a frontend, an engine) that died before its child opened a pidfd on its
    pid, the pid since given to another process, left the child watching that stranger: an engine or a worker
    orphaned for as long as the stranger lived. The requester's start time tells them apart: here the test process's
    pid named with another start time is such a stranger's (the child leaves at once, exit code 1), and named with
    its own it is the requester (the child stays until it ends itself)."""
    script = ("import os, sys, threading, time\n"
              "from pagedllm.engine.core_proc import exit_when_parent_dies\n"
              "from pagedllm.forkserver import process_identity\n"
              "pid, started = process_identity(os.getppid())\n"
              "threading.Thread(target=exit_when_parent_dies, args=((pid, started + int(sys.argv[1])), []),\n"
              "                 daemon=True).start()\n"
              "time.sleep(3)\n")
    codes = [subprocess.run([sys.executable, "-c", script, shift], timeout=120).returncode for shift in ("1", "0")]
    assert codes == [1, 0]


@pytest.mark.timeout(120)
def test_a_fresh_interpreter_reaped_by_another_thread_is_never_signalled_by_its_pid(monkeypatch, capfd):
    """A Popen's send_signal polls, then kills by pid. Another thread blocked in its wait() (a client's monitor
    always is) holds the Popen's waitpid lock, so that the poll learns nothing; once that wait has reaped the
    process, the kill goes to its pid, which may name a later process by then. A fresh interpreter start_process
    starts is signalled through the pidfd opened at its start, as a forked child is: never by a pid."""
    monkeypatch.setenv(forkserver.METHOD_ENV, "spawn")
    proc = start_process(CHILD, ["0", "0"])
    os.waitpid(proc.pid, 0)  # reaped by the other thread's wait, whose returncode is not yet set
    kills = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: kills.append((pid, sig)))
    with proc._waitpid_lock:  # held by that wait
        proc.terminate()
    assert kills == []
    proc.returncode = 0  # what that wait sets
