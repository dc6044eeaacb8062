"""Starting the EngineCore process, early where the entry point knows it will need one.

The engine is a fresh interpreter (core_proc.py) that reads its EngineConfig from a pickle file. A server has no
EngineConfig until it has imported torch and transformers and read the model's config (most of its start-up before
the engine exists), and the engine process then spends about as long on imports of its own before it even opens the
file. ``engine_core_prestarted`` starts the engine's interpreter first thing, before the config exists: it imports
the engine's modules beside the frontend's (on another core) and then waits on its stdin for the config's path, so
the engine is ready that much sooner.

A prestarted process holds nothing until it has the path: the entry point's block kills one it did not use (a bad
flag's exit included), and one whose frontend dies reads the end of its input and leaves. It runs in a session of
its own (so in a process group of its own, on every Python the package supports), so that a Ctrl-C in the terminal
reaches only the frontend, which stops the engine as it always does.
"""
from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from typing import Optional

CONFIG_ON_STDIN = "-"  # core_proc's config path argument of a prestarted engine
_waiting: Optional[subprocess.Popen] = None  # the prestarted engine no start_engine_core has taken yet


def _engine_command(config_path: str) -> list[str]:
    return [sys.executable, "-m", "pagedllm.engine.core_proc", "EngineCore", config_path]


def waiting_engine_core() -> Optional[subprocess.Popen]:
    """The prestarted engine process no ``start_engine_core`` has taken yet, if any."""
    return _waiting


def start_engine_core(config_path: str) -> subprocess.Popen:
    """The engine process for the config pickled at ``config_path``: the prestarted one where one waits, else a new
    one."""
    global _waiting
    proc, _waiting = _waiting, None
    if proc is not None:
        try:
            proc.stdin.write(config_path.encode() + b"\n")
            proc.stdin.close()
            return proc
        except BrokenPipeError:  # it died waiting (killed from outside): a new one says why if it fails too
            _kill(proc)
    return subprocess.Popen(_engine_command(config_path))


@contextlib.contextmanager
def engine_core_prestarted(wanted: bool = True) -> Iterator[None]:
    """An entry point's block that will start an engine (if ``wanted``): the engine's interpreter starts on entry,
    for the block's ``start_engine_core``, and one the block did not take (it failed before its engine started) is
    killed on exit."""
    global _waiting
    if wanted and _waiting is None:
        _waiting = subprocess.Popen(_engine_command(CONFIG_ON_STDIN), stdin=subprocess.PIPE, start_new_session=True)
    try:
        yield
    finally:
        proc, _waiting = _waiting, None
        if proc is not None:
            _kill(proc)


def _kill(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()
