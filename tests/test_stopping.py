"""engine/stopping.py: children that exit on SIGTERM are stopped at once and quietly; one that does not is named in
an error, writes its threads' stacks to its stderr, and is killed after the timeout."""
import logging
import signal
import subprocess
import sys
import time

from pagedllm.engine.stopping import stop_processes

CHILD = """
import signal, sys, time
from pagedllm.engine.stopping import dump_stacks_on_sigusr1
dump_stacks_on_sigusr1()
if sys.argv[1] == "stuck":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(60)
"""


def _child(kind: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, kind], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline() == "ready\n"
    return proc


def test_children_that_exit_on_sigterm_stop_at_once_without_an_error(caplog):
    children = [_child("plain"), _child("plain")]
    start = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="pagedllm.engine.stopping"):
        stop_processes(children, "Worker", timeout=5)
    assert time.monotonic() - start < 2
    assert [child.returncode for child in children] == [-signal.SIGTERM] * 2
    assert caplog.text == ""


def test_a_child_that_ignores_sigterm_has_its_stacks_dumped_and_is_killed(caplog):
    stuck, plain = _child("stuck"), _child("plain")
    start = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="pagedllm.engine.stopping"):
        stop_processes([stuck, plain], "EngineCore", timeout=0.5)
    assert time.monotonic() - start < 3
    assert stuck.returncode == -signal.SIGKILL and plain.returncode == -signal.SIGTERM
    assert f"EngineCore (pid {stuck.pid}) did not exit within 0.5 s of SIGTERM" in caplog.text
    stacks = stuck.stderr.read()
    assert "most recent call first" in stacks and 'File "<string>", line 8 in <module>' in stacks, stacks
