"""Reader side of tests/distributed/test_shm_broadcast.py, run as a fresh interpreter:

    python tests/distributed/shm_reader.py '<json spec>'

It loads pagedllm/distributed/shm_broadcast.py by path rather than importing the package, so that a reader starts
in a fraction of a second instead of importing torch through pagedllm/__init__. The spec holds the handle's fields,
the reader's rank, a mode, and the parameters of `make_message`, which the test uses too, so that the reader checks
what it receives against what was sent. The result is one JSON line on stdout.

Modes:
  collect       dequeue `count` messages (after sleeping `sleep_before` s) and check each against make_message(i)
  hold          connect, print "ready", then read nothing until stdin closes
  idle          connect, print "ready", then wait (blocked) for one message and check it
  spawn_writer  be the writer instead, with one `collect` reader started by multiprocessing's spawn context (which
                shares this process's resource tracker), send it `count` messages, close
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import multiprocessing
import os
import random
import sys
import time

MODULE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "pagedllm", "distributed",
                           "shm_broadcast.py")


def make_message(i: int, large_every: int = 0, large_size: int = 0, edge_bytes: int = 0):
    """Message i of a test: a mix of types and sizes, fully determined by its arguments.

    large_every: every large_every-th message is `large_size` random bytes. edge_bytes: one message in seven is a
    bytes object whose pickle is within 64 bytes either side of edge_bytes (a slot's size).
    """
    rng = random.Random(i)
    if large_every and i % large_every == large_every - 1:
        return ("large", i, rng.randbytes(large_size))
    if edge_bytes and i % 7 == 3:
        return ("edge", i, rng.randbytes(max(0, edge_bytes - 96 + (i * 13) % 128)))
    kind = i % 5
    if kind == 0:
        return i
    if kind == 1:
        return ("str", i, "x" * rng.randrange(0, 200))
    if kind == 2:
        return {"i": i, "ids": list(range(rng.randrange(0, 500)))}
    if kind == 3:
        return rng.randbytes(rng.randrange(0, 3000))
    return None if i % 2 else [i] * rng.randrange(0, 50)


def _load_module():
    spec = importlib.util.spec_from_file_location("shm_broadcast_under_test", MODULE_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def main(spec: dict) -> dict:
    sb = _load_module()
    mq = sb.MessageQueue.create_from_handle(sb.Handle(**spec["handle"]), spec["rank"])
    result: dict = {"rank": spec["rank"], "received": 0, "mismatch": None, "error": None}
    try:
        mq.wait_until_ready(10)
        mode = spec["mode"]
        gen = spec.get("gen", {})
        if mode in ("hold", "idle"):
            print("ready", flush=True)
        if mode == "hold":
            sys.stdin.read()
            return result
        time.sleep(spec.get("sleep_before", 0))
        for i in range(spec.get("count", 1)):
            got = mq.dequeue(timeout=spec.get("timeout", 10))
            result["received"] += 1
            if got != make_message(i, **gen) and result["mismatch"] is None:
                result["mismatch"] = i
    except Exception as exc:  # reported to the test, which shows it
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        mq.close()
    return result


def spawned_reader(spec: dict) -> None:
    result = main(spec)
    if result["error"] or result["mismatch"] is not None or result["received"] != spec["count"]:
        raise RuntimeError(f"spawned reader: {result}")


def spawn_writer_main(spec: dict) -> dict:
    sb = _load_module()
    mq = sb.MessageQueue(n_reader=1, max_chunk_bytes=4096, max_chunks=4)
    handle = mq.export_handle()
    count, gen = spec["count"], spec.get("gen", {})
    reader_spec = {"handle": dataclasses.asdict(handle), "rank": 0, "mode": "collect", "count": count, "gen": gen}
    proc = multiprocessing.get_context("spawn").Process(target=spawned_reader, args=(reader_spec,))
    proc.start()
    try:
        mq.wait_until_ready(10)
        for i in range(count):
            mq.enqueue(make_message(i, **gen), timeout=10)
        proc.join(10)
    finally:
        mq.close()
        if proc.is_alive():
            proc.kill()
    return {"reader_exitcode": proc.exitcode, "shm_left": os.path.exists(f"/dev/shm/{handle.shm_name}")}


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    print(json.dumps(spawn_writer_main(args) if args["mode"] == "spawn_writer" else main(args)), flush=True)
