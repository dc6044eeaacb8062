"""Starting the EngineCore process, early where the entry point knows it will need one.

The engine is a fresh interpreter (core_proc.py) that reads its EngineConfig from a pickle file. A server has no
EngineConfig until it has imported torch and transformers and read the model's config (most of its start-up before
the engine exists), and the engine process then spends about as long on imports of its own before it even opens the
file. ``engine_core_prestarted`` starts the engine's interpreter first thing, before the config exists: it imports
the engine's modules beside the frontend's (on another core) and then waits on its stdin for the config's path, so
the engine is ready that much sooner.

`serve -dp N` prestarts one for each data-parallel engine. A prestarted process holds nothing until it has the path:
the entry point's block kills one it did not use (a bad flag's exit included), and one whose frontend dies reads the
end of its input and leaves. It runs in a session of its own (so in a process group of its own, on every Python the
package supports), so that a Ctrl-C in the terminal reaches only the frontend, which stops the engine as it always
does.
"""
from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

CONFIG_ON_STDIN = "-"  # core_proc's config path argument of a prestarted engine
_waiting: list[subprocess.Popen] = []  # prestarted engines no start_engine_core has taken yet, oldest first


def _engine_command(config_path: str) -> list[str]:
    return [sys.executable, "-m", "pagedllm.engine.core_proc", "EngineCore", config_path]


def waiting_engine_cores() -> list[subprocess.Popen]:
    """The prestarted engine processes no ``start_engine_core`` has taken yet."""
    return list(_waiting)


def start_engine_core(config_path: str) -> subprocess.Popen:
    """The engine process for the config pickled at ``config_path``: a prestarted one where one waits, else a new
    one."""
    while _waiting:
        proc = _waiting.pop(0)
        try:
            proc.stdin.write(config_path.encode() + b"\n")
            proc.stdin.close()
            return proc
        except BrokenPipeError:  # it died waiting (killed from outside): a new one says why if it fails too
            _kill(proc)
    return subprocess.Popen(_engine_command(config_path))


@contextlib.contextmanager
def engine_core_prestarted(engines: int = 1) -> Iterator[None]:
    """An entry point's block that will start ``engines`` engines (data-parallel ones: several; 0: none): their
    interpreters start on entry, for the block's ``start_engine_core`` calls, and those the block did not take (it
    failed before its engines started, or started fewer) are killed on exit."""
    while len(_waiting) < engines:
        _waiting.append(subprocess.Popen(_engine_command(CONFIG_ON_STDIN), stdin=subprocess.PIPE,
                                         start_new_session=True))
    try:
        yield
    finally:
        while _waiting:
            _kill(_waiting.pop())


def _kill(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()
