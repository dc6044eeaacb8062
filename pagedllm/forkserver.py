"""The fork server: engine and worker processes forked from a process that has already imported their modules.

A fresh interpreter spends about a second of CPU importing torch, transformers and pagedllm before an engine or a
worker reads its config, and a process that starts several (data- and tensor-parallel ranks, a notebook or a test
session that builds engine after engine) pays it each time. The fork server is an interpreter that imports those
modules once (PRELOAD) and then forks a child per request that runs the requested module as ``python -m`` would:
the requester's arguments, environment, working directory and standard streams, its command line shown as the
fresh interpreter's would be (setproctitle). It is vLLM's fork start method without forking a process that holds
threads, models or sockets: fork is only safe from a process whose threads survive it (an OpenMP pool or a ZMQ
thread does not), so the server never starts a thread or runs a torch operation, and checks before each fork that
it has no thread but those its imports started.

Invariants:
- A forked child sees what a fresh interpreter would see, or it is not forked: a module may read a variable at import
  (torch's OpenMP settings, pagedllm's PAGEDLLM_* limits), so the server forks only for a requester whose environment
  is the one it imported under (the few variables no import reads aside, _IGNORED_ENV); anything else, and any
  failure to reach the server, starts a fresh interpreter instead (``start_process``), so the server only ever
  saves time.
- The server is reachable only by its user (a socket in a 0700 directory: a request names code to run).
- Nothing outlives its owner: the server leaves when the process that started it is gone (the end of its stdin);
  its children watch their requesters (the process their config names: core_proc.exit_when_parent_dies) and are no
  concern of its lifetime. It reaps each child and tells the requester its exit code, as a Popen would have got it.
"""
from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import pickle
import resource
import runpy
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from typing import Optional, Union

import setproctitle

from pagedllm.gc_utils import freeze_gc_heap, pause_gc_for_startup

# What an engine or worker process imports before it reads its config: imported once, by the server.
PRELOAD = ("pagedllm.engine.core_proc", "pagedllm.executor.worker_proc", "pagedllm.executor.uniproc",
           "pagedllm.worker.worker")
SOCKET_ENV = "PAGEDLLM_FORKSERVER_SOCKET"  # a forked child's way back to its server, for processes it starts

_HEADER = struct.Struct("!q")  # a request's payload length; the server's answer: the child's pid (or a close: refused)
_EXIT = struct.Struct("!i")  # the child's exit code, negative for a signal (Popen's returncode)

_STOP_WAIT_S = 1.0  # for a server told to stop to go, before it is killed
_SERVER_IO_TIMEOUT_S = 5.0  # the server's side of a request: a requester that stalls holds up no other
_REQUEST_TIMEOUT_S = 300  # a server that has not answered by then (its imports stuck) is passed over
# The server runs under the environment this process had when it imported pagedllm: what a caller sets later
# (a test's monkeypatch, a script's os.environ before one of its engines) gets that request a fresh interpreter
# without ending the server's use for the others.
_ENVIRONMENT_AT_IMPORT = dict(os.environ)

Process = Union["FreshProcess", "ForkedProcess"]


METHOD_ENV = "PAGEDLLM_WORKER_MULTIPROC_METHOD"  # vLLM's VLLM_WORKER_MULTIPROC_METHOD, with our methods
# spawn: every engine and worker a fresh interpreter; vLLM's fork: ours is the fork server's
METHODS = ("forkserver", "fork", "spawn")
# What may differ between the server's environment and a requester's: no import of the server's reads them
# (TORCHINDUCTOR_CACHE_DIR: torch's inductor writes its default there in a process that compiled).
_IGNORED_ENV = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", SOCKET_ENV, METHOD_ENV}


def multiproc_method() -> str:
    """How engine and worker processes start: PAGEDLLM_WORKER_MULTIPROC_METHOD, "forkserver" unless set ("fork",
    vLLM's default, means the same here: the engine's own process is never forked)."""
    method = os.environ.get(METHOD_ENV, "forkserver")
    if method not in METHODS:
        raise ValueError(f"{METHOD_ENV} must be one of {', '.join(METHODS)}; got {method!r}")
    return "forkserver" if method == "fork" else method


def start_process(module: str, args: list[str]) -> Process:
    """``python -m module *args``, forked by this process's fork server where it can (see the module's
    invariants), else a fresh interpreter; either way in a session of its own (a Ctrl-C in the terminal reaches only
    the process the user started, which stops its children)."""
    server = _server_address() if multiproc_method() == "forkserver" else None
    if server is not None:
        proc = ForkedProcess.request(server, module, args)
        if proc is not None:
            return proc
    return FreshProcess([sys.executable, "-m", module, *args])


class FreshProcess(subprocess.Popen):
    """A fresh interpreter (start_process's where no fork server forks it) in a session of its own, signalled as a
    ForkedProcess is: through a pidfd, opened at its start, when it cannot have been reaped. Popen's send_signal
    polls, then kills by pid, and another thread's wait() (a client's monitor, blocked in it for the process's life)
    holds the lock that poll needs: once that wait has reaped the process, the kill may reach a later process given
    its pid."""

    def __init__(self, args: list[str]) -> None:
        super().__init__(args, start_new_session=True)
        try:
            self._pidfd: Optional[int] = os.pidfd_open(self.pid)
        except (AttributeError, OSError):  # no pidfds here (Linux before 5.3): Popen's signals, by pid
            self._pidfd = None
        else:
            weakref.finalize(self, os.close, self._pidfd)

    def send_signal(self, sig: int) -> None:
        if self._pidfd is None:
            super().send_signal(sig)
        else:
            _signal_through_pidfd(self, self._pidfd, sig)


def _signal_through_pidfd(process: Process, pidfd: int, sig: int) -> None:
    """``sig`` to ``process`` through its pidfd, unless it has exited (nothing then, as Popen's send_signal): a
    pidfd names its process only, never a later one given the same pid."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):  # it exited since
            signal.pidfd_send_signal(pidfd, sig)


def process_identity(pid: int) -> tuple[int, Optional[int]]:
    """``pid`` and when that process started (/proc's starttime, clock ticks after boot; None where it is gone or
    there is no /proc): a pid is given to a later process once its own has exited, the pair names one process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return pid, int(f.read().rsplit(b")", 1)[1].split()[19])  # after the name, which may hold ") "
    except OSError:
        return pid, None


class ForkedProcess:
    """A child of the fork server, seen through the parts of subprocess.Popen that pagedllm uses: pid,
    returncode, poll, wait, send_signal, terminate, kill. Its exit code comes from the server, which reaps it; its
    signals go through a pidfd, which cannot reach a later process given the same pid."""

    def __init__(self, args: list[str], pid: int, pidfd: int, conn: socket.socket) -> None:
        self.args, self.pid, self.returncode = args, pid, None
        self._pidfd, self._conn = pidfd, conn
        self._server_gone = False
        self._lock = threading.Lock()  # poll and wait may run in several threads (a client's monitor and shutdown)

    @classmethod
    def request(cls, address: str, module: str, args: list[str]) -> Optional["ForkedProcess"]:
        """The child the server at ``address`` forked for ``module``, or None where it refused or is gone."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(_REQUEST_TIMEOUT_S)
        try:
            conn.connect(address)
            payload = pickle.dumps((module, args, dict(os.environ), os.getcwd(), _process_settings()))
            socket.send_fds(conn, [_HEADER.pack(len(payload))], [0, 1, 2])
            conn.sendall(payload)
            answer, fds = _receive_with_fds(conn, _HEADER.size, 1)
        except OSError:
            conn.close()
            return None
        except BaseException:  # an interrupt while the server imports: it forks nothing for a connection closed
            conn.close()
            raise
        if len(answer) < _HEADER.size or not fds:  # refused (the server closes its side), or it died meanwhile
            for fd in fds:
                os.close(fd)
            conn.close()
            return None
        conn.settimeout(None)
        return cls([sys.executable, "-m", module, *args], _HEADER.unpack(answer)[0], fds[0], conn)

    def poll(self) -> Optional[int]:
        with self._lock:
            if self.returncode is None and not self._server_gone and select.select([self._conn], [], [], 0)[0]:
                data = self._conn.recv(_EXIT.size)
                if len(data) == _EXIT.size:
                    self.returncode = _EXIT.unpack(data)[0]
                else:  # the server went first (its owner did, or it was killed): the pidfd alone says when
                    self._server_gone = True
            if self.returncode is None and self._server_gone and select.select([self._pidfd], [], [], 0)[0]:
                self.returncode = 255  # its exit code went with the server that would have reaped it
            return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            # Bounded: another thread's poll may take what this select saw
            select.select([self._pidfd if self._server_gone else self._conn], [], [],
                          0.1 if remaining is None else min(remaining, 0.1))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        _signal_through_pidfd(self, self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __del__(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.close(self._pidfd)
            self._conn.close()


def _process_settings() -> tuple:
    """What a child inherits from its parent besides the environment, cwd and streams: the CPUs it may run on (the
    tensor-parallel ranks' cores are chosen among them), its umask, its open-files limit."""
    umask = int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("Umask:")), 8)
    return os.sched_getaffinity(0), umask, resource.getrlimit(resource.RLIMIT_NOFILE)


def _may_apply(settings: tuple) -> bool:
    """Whether a child of this server can take a requester's settings: a hard limit above this process's cannot be
    set without privilege."""
    wanted, own = settings[2][1], resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return own == resource.RLIM_INFINITY or wanted != resource.RLIM_INFINITY and wanted <= own


def _apply_process_settings(settings: tuple) -> None:
    """In a forked child: its requester's settings (_process_settings), as a fresh interpreter would inherit them."""
    cpus, umask, open_files = settings
    os.sched_setaffinity(0, cpus)
    os.umask(umask)
    resource.setrlimit(resource.RLIMIT_NOFILE, open_files)


def _receive_with_fds(conn: socket.socket, size: int, max_fds: int) -> tuple[bytes, list[int]]:
    """socket.recv_fds, its descriptors not inherited by the processes this one starts (Python 3.11's recv_fds drops
    the MSG_CMSG_CLOEXEC flag it is given)."""
    data, fds, _, _ = socket.recv_fds(conn, size, max_fds)
    for fd in fds:
        os.set_inheritable(fd, False)
    return data, fds


# The requester's side: which server to ask.

_owned: Optional[subprocess.Popen] = None  # the server this process started, if any
_owned_dir: Optional[str] = None
_owned_forked = False  # whether it has been asked for a child yet (server_prestarted's exit)
_owned_failed = False  # one failed to start (its error is on stderr): fresh interpreters from then on
_owned_lock = threading.Lock()
_SOCKET_PATH_MAX = 100  # AF_UNIX's limit is 107 bytes
_STARTUP_WAIT_S = 60.0  # for the server's socket to appear (its interpreter's start, before any heavy import)


def _forget_owned_server() -> None:
    """In a child forked from this process (a user's os.fork, multiprocessing's fork): the server is the parent's,
    not to be stopped or reused here; its input's write end, which would keep it alive, is closed here."""
    global _owned, _owned_dir
    if _owned is not None:
        with contextlib.suppress(OSError):
            _owned.stdin.close()
        _owned.returncode = 0  # not this process's child: no Popen method may wait for it here
    _owned, _owned_dir = None, None


os.register_at_fork(after_in_child=_forget_owned_server)


def _server_address() -> Optional[str]:
    """The server a forked child came from, else the one this process started (started now if none runs), else
    None where fork servers cannot work here (start_server's)."""
    inherited = os.environ.get(SOCKET_ENV)
    if inherited and os.path.exists(inherited):
        return inherited
    address = start_server()
    # Its socket appears once its interpreter is up (well before its imports are done, which a request waits for).
    deadline = time.monotonic() + _STARTUP_WAIT_S
    while address is not None and not os.path.exists(address):
        server = _owned
        if server is None or server.poll() is not None or time.monotonic() > deadline:
            _note_failed_start()
            return None
        time.sleep(0.01)
    return address


def _note_failed_start() -> None:
    global _owned_failed
    with _owned_lock:
        _owned_failed = True
        _stop_owned(at_once=True)


def start_server() -> Optional[str]:
    """This process's fork server, started now if it has none running: its imports run beside the caller's work,
    so a process that knows it will start engines starts it first thing. Its socket's path; None where fork servers
    cannot work here (no pidfd: Linux before 5.3) or one failed to start."""
    global _owned, _owned_dir, _owned_forked
    if not hasattr(os, "pidfd_open") or _owned_failed:
        return None
    with _owned_lock:
        if _owned is not None and _owned.poll() is None:
            _owned_forked = True  # asked for a child: whoever started it keeps it
            return os.path.join(_owned_dir, "socket")
        _stop_owned()
        _owned_dir = _socket_directory()
        atexit.register(shutil.rmtree, _owned_dir, ignore_errors=True)  # where the server was killed, so cannot
        _owned = subprocess.Popen([sys.executable, "-m", "pagedllm.forkserver", _owned_dir], stdin=subprocess.PIPE,
                                  start_new_session=True, env=_ENVIRONMENT_AT_IMPORT)
        _owned_forked = False
        return os.path.join(_owned_dir, "socket")


def _socket_directory() -> str:
    """A new 0700 directory (only this user may ask for code to run) whose socket path fits AF_UNIX's limit: under
    the temporary directory, else under /tmp where that is too deep."""
    directory = tempfile.mkdtemp(prefix="pagedllm-fs-")
    if len(os.path.join(directory, "socket")) > _SOCKET_PATH_MAX:
        os.rmdir(directory)
        directory = tempfile.mkdtemp(prefix="pagedllm-fs-", dir="/tmp")
    return directory


def stop_server() -> None:
    """Stops this process's fork server (its children live on: they watch their requesters)."""
    with _owned_lock:
        _stop_owned()


def _stop_owned(at_once: bool = False) -> None:
    """``at_once``: killed rather than told (it answers the end of its input only once its imports are done)."""
    global _owned, _owned_dir
    if _owned is not None:
        _owned.stdin.close()  # the end of its input: it leaves
        if at_once:
            _owned.kill()
        try:
            _owned.wait(timeout=_STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            _owned.kill()
            _owned.wait()
        _owned = None
    if _owned_dir is not None:
        shutil.rmtree(_owned_dir, ignore_errors=True)
        _owned_dir = None


def _method_is_forkserver() -> bool:
    """Whether multiproc_method() is the fork server's; a bad method is not (the engine's start names it: a
    ValueError before any process)."""
    try:
        return multiproc_method() == "forkserver"
    except ValueError:
        return False


@contextlib.contextmanager
def server_prestarted(wanted: bool = True) -> Iterator[None]:
    """An entry point's block that will start engine processes: the fork server starts on entry (its imports beside
    the entry point's), and where the block leaves without having forked anything from a server it started (a bad
    argument), the server goes with it."""
    started = (wanted and _method_is_forkserver() and (_owned is None or _owned.poll() is not None)
               and start_server() is not None)
    try:
        yield
    finally:
        if started and not _owned_forked:
            with _owned_lock:
                _stop_owned(at_once=True)  # it forked nothing: nothing of it is worth its imports' wait


# The server's side.

def _serve(directory: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.path.join(directory, "socket"))  # requests queue from here on, while the imports run
    listener.listen(64)
    environment = _comparable(os.environ)  # as the owner started us, before any import could change it
    for module in PRELOAD:
        importlib.import_module(module)
    # What the imports set in the environment (a fresh interpreter's imports would set it too), for the children.
    set_by_imports = {key: value for key, value in os.environ.items() if environment.get(key) != value}
    freeze_gc_heap()  # the children start from a collected heap, as a fresh one's first collection would leave it
    # The imports' own threads (numpy's OpenBLAS pool, which its fork handlers stop at the first fork and start again
    # only when used): any thread beyond these would be one that does not survive a fork.
    threads = len(os.listdir("/proc/self/task"))
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler (the default ignores it), so the wake-up fd hears it
    children: dict[int, socket.socket] = {}  # pid -> its requester's connection, for its exit code
    own_fds = [listener.fileno(), wake_r, wake_w, sys.stdin.fileno()]
    while True:
        readable = select.select([listener, wake_r, sys.stdin], [], [])[0]
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1024):
            shutil.rmtree(directory, ignore_errors=True)
            return  # the owner is gone (or stopped us)
        if wake_r in readable:
            os.read(wake_r, 1024)
            _reap(children)
        if listener in readable:
            try:
                conn = listener.accept()[0]
            except OSError:  # out of descriptors, say: that requester starts a fresh interpreter
                continue
            conn.settimeout(_SERVER_IO_TIMEOUT_S)  # a requester that stalls mid-request holds up no other
            pid = _fork_for(conn, environment, set_by_imports, threads,
                            own_fds + [c.fileno() for c in children.values()])
            if pid is None:
                conn.close()
            else:
                children[pid] = conn


def _comparable(environ) -> dict[str, str]:
    return {key: value for key, value in environ.items() if key not in _IGNORED_ENV}


def _same_environment(env: dict[str, str], environment: dict[str, str], set_by_imports: dict[str, str]) -> bool:
    """Whether a requester's ``env`` is the server's ``environment``, where a variable the imports set may have
    either value (a forked child's requests carry what its imports set)."""
    env = _comparable(env)
    for key, value in set_by_imports.items():
        if env.get(key) in (environment.get(key), value):
            env.pop(key, None)
    return env == {key: value for key, value in environment.items() if key not in set_by_imports}


def _fork_for(conn: socket.socket, environment: dict[str, str], set_by_imports: dict[str, str], threads: int,
              own_fds: list[int]) -> Optional[int]:
    """Forks the child ``conn`` asks for (where its requester's ``environment`` is the server's) and answers its pid
    and pidfd; None (and no child) where it may not or the request is malformed (that requester then starts a fresh
    interpreter; the server serves on)."""
    fds: list[int] = []
    try:
        header, fds = _receive_with_fds(conn, _HEADER.size, 3)
        length = _HEADER.unpack(header)[0]
        payload = b""
        while len(payload) < length:
            chunk = conn.recv(length - len(payload))
            if not chunk:
                return None
            payload += chunk
        module, args, env, cwd, settings = pickle.loads(payload)
        # A thread that holds a lock at the fork (a Python thread, an OpenMP pool) deadlocks the child.
        if (len(fds) != 3 or not _same_environment(env, environment, set_by_imports) or threading.active_count() != 1
                or len(os.listdir("/proc/self/task")) > threads or not _may_apply(settings) or _peer_closed(conn)):
            return None
        pid = os.fork()
        if pid == 0:
            _run_child(module, args, {**env, **set_by_imports}, cwd, settings, fds, own_fds + [conn.fileno()])
    except Exception:  # any malformed request; a fork out of processes or memory
        return None
    finally:
        for fd in fds:  # the requester's streams, the child's now (never reached in the child, which exits)
            os.close(fd)
    try:
        pidfd = os.pidfd_open(pid)  # before we reap it: the pid is this child's until then
        try:
            socket.send_fds(conn, [_HEADER.pack(pid)], [pidfd])
        finally:
            os.close(pidfd)
    except OSError:  # the requester went (an interrupt while it waited): a child nobody owns must not run
        os.kill(pid, signal.SIGKILL)
    return pid


def _peer_closed(conn: socket.socket) -> bool:
    """Whether the requester has gone (an interrupt while it waited for the server's imports)."""
    return bool(select.select([conn], [], [], 0)[0]) and conn.recv(1, socket.MSG_PEEK) == b""


def _reap(children: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(_EXIT.pack(os.waitstatus_to_exitcode(status)))
            conn.close()


def _run_child(module: str, args: list[str], env: dict[str, str], cwd: str, settings: tuple, fds: list[int],
               server_fds: list[int]) -> None:
    """In the forked child: become ``python -m module *args`` started by the requester, run it, exit. The server's
    descriptors are closed here; the socket objects that held them stay referenced by the server's frames, which
    this process never returns to (os._exit), so no collection closes a number it has since reused."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in server_fds:
            os.close(fd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.setsid()
        os.chdir(cwd)
        _apply_process_settings(settings)
        os.environ.clear()
        os.environ.update(env)
        os.environ[SOCKET_ENV] = _server_socket
        setproctitle.setproctitle(" ".join([sys.executable, "-m", module, *args]))
        sys.argv = [module, *args]
        sys.path[0] = cwd  # `python -m`'s first entry: the directory it was started in
        # runpy warns that the module it runs as __main__ is imported already: here that is the point
        warnings.filterwarnings("ignore", "'.*' found in sys.modules after import of package", RuntimeWarning)
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        try:
            import atexit
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


_server_socket = ""  # the server's own socket path, which its children inherit (set in main)


def main() -> None:
    global _server_socket
    pause_gc_for_startup()
    # setproctitle takes over the memory of the command line and the environment the first time it sets a title,
    # which it can only do before the environment is changed: now, for the children's titles.
    setproctitle.setproctitle(setproctitle.getproctitle())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the owner stops us (the end of our input)
    _server_socket = os.path.join(sys.argv[1], "socket")
    _serve(sys.argv[1])


if __name__ == "__main__":
    main()
