"""Starting the EngineCore process, early where the entry point knows it will need one.

The engine is a process of its own (core_proc.py) that reads its EngineConfig from a pickle file, forked by the fork
server (forkserver.py) where it can be, else a fresh interpreter. A server has no EngineConfig until it has imported
torch and transformers and read the model's config (most of its start-up before the engine exists), and a fresh
engine process then spends about as long on imports of its own before it even opens the file.
``engine_core_prestarted`` starts the fork server first thing, before the config exists: it imports the engine's
modules beside the frontend's (on another core), and forks each engine (`serve -dp N`: N) once its config exists.

A fork server started for a block that starts no engine (a bad flag's exit) goes with the block; one that forked an
engine lives as long as the process that started it, for the engines and workers it may start later.
"""
from __future__ import annotations

from pagedllm.forkserver import Process, server_prestarted, start_process


def start_engine_core(config_path: str) -> Process:
    """The engine process for the config pickled at ``config_path``."""
    return start_process("pagedllm.engine.core_proc", ["EngineCore", config_path])


def engine_core_prestarted(starts_engines: bool = True):
    """An entry point's block that will start engine processes (``starts_engines``): the fork server they will be
    forked from starts on entry (forkserver.server_prestarted)."""
    return server_prestarted(starts_engines)
