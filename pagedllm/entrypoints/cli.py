"""The `pagedllm` command: `serve` runs the OpenAI-compatible server, `run-batch` runs a batch file of its requests
in-process, `chat` and `complete` talk to a server from the terminal (chat_cli.py), `bench` measures the engine or a
server (pagedllm.benchmarks)."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import re
import sys
from typing import Optional

from pagedllm.engine.launch import engine_core_prestarted
from pagedllm.forkserver import multiproc_method
from pagedllm.gc_utils import gc_paused

# The commands that start an engine process: theirs starts before this module's other imports (launch.py), which
# are therefore made inside the functions below.
ENGINE_COMMANDS = ("serve", "run-batch")
# The commands that only talk to a server: parsed without the engine's flags, whose defaults import torch (seconds
# of start-up for a one-line question).
CLIENT_COMMANDS = ("chat", "complete")


def serve(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.openai.api_server import run_server
    from pagedllm.entrypoints.openai.shutdown import sigterm_interrupts

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        with sigterm_interrupts():
            asyncio.run(run_server(args))
    except KeyboardInterrupt:  # uvicorn re-raises the exit signal it handled, once shut down
        pass


def run_batch(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.openai import run_batch as batch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(batch.run_batch(args))


def doctor(args: argparse.Namespace) -> None:
    from pagedllm.native.doctor import main as doctor_main

    sys.exit(doctor_main())


def make_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``pagedllm`` parser, and the parsers of its subcommands that read ``--config`` files, by command."""
    from pagedllm.benchmarks.cli import add_bench_parser
    from pagedllm.entrypoints.chat_cli import add_chat_parser, add_complete_parser
    from pagedllm.entrypoints.openai import run_batch as batch
    from pagedllm.entrypoints.openai.cli_args import make_arg_parser

    parser, subparsers = _command_parser()
    serve_parser = subparsers.add_parser("serve", help="run the OpenAI-compatible API server")
    make_arg_parser(serve_parser).set_defaults(func=serve)
    batch_parser = subparsers.add_parser("run-batch", help="run a file of requests in OpenAI's batch format")
    batch.make_arg_parser(batch_parser).set_defaults(func=run_batch)
    add_chat_parser(subparsers)  # as _client_parser's, for `pagedllm --help`
    add_complete_parser(subparsers)
    add_bench_parser(subparsers)
    doctor_parser = subparsers.add_parser("doctor", help="the CPU features seen and each native kernel's build")
    doctor_parser.set_defaults(func=doctor)
    return parser, {"serve": serve_parser, "run-batch": batch_parser}


def _config_path(argv: list[str]) -> Optional[str]:
    """The --config a command line gives, read ahead of the full parse (which the file's flags must precede)."""
    finder = argparse.ArgumentParser(add_help=False)  # abbreviations as the full parse takes them
    finder.add_argument("--config")
    return finder.parse_known_args(argv)[0].config


def _starts_engines(argv: list[str]) -> bool:
    """Whether the command will start engine processes (ENGINE_COMMANDS), read from its arguments before they are
    parsed, so that the fork server they are forked from starts first thing (launch.py). A wrong guess costs only
    start-up time."""
    return bool(argv) and argv[0] in ENGINE_COMMANDS


# vLLM's dotted form of a JSON flag's fields (--speculative-config.method ngram, -cc.cudagraph_mode=NONE): the
# flag, and the path of the field within its object.
_DOTTED_FLAG = re.compile(r"(--[A-Za-z][\w-]*|-cc)\.(.+)")


def vllm_argv(argv: list[str]) -> list[str]:
    """The command line as vLLM's FlexibleArgumentParser.parse_args reads it, in the form our parser takes: a flag's
    name may spell its dashes as underscores (``--max_model_len=2048``; the value is left alone); a JSON flag's
    fields may be given one by one, ``--flag.field[.field] VALUE`` (the value JSON, else a human-readable integer,
    else text; ``field+`` takes a comma-separated list), gathered into one object given after the other flags; and
    `serve` takes its model as ``--model M`` too (moved to the positional argument). Nothing after ``--`` is a
    flag."""
    converted: list[str] = []
    dotted: dict[str, dict] = {}
    index = 0
    while index < len(argv) and argv[index] != "--":
        arg = argv[index]
        index += 1
        name, sep, value = arg.partition("=")
        match = _DOTTED_FLAG.fullmatch(name)
        if match:
            if not sep and index < len(argv):
                value, index = argv[index], index + 1
            _set_field(dotted.setdefault(match[1].replace("_", "-"), {}), match[2], value)
        else:
            converted.append(name.replace("_", "-") + sep + value if arg.startswith("--") else arg)
    for flag, fields in dotted.items():
        converted += [flag, json.dumps(fields)]
    converted += argv[index:]
    if converted[:1] == ["serve"]:
        for index, arg in enumerate(converted):
            if arg == "--":
                break
            if arg == "--model" and index + 1 < len(converted):
                return ["serve", converted[index + 1], *converted[1:index], *converted[index + 2:]]
            if arg.startswith("--model="):
                return ["serve", arg.removeprefix("--model="), *converted[1:index], *converted[index + 1:]]
    return converted


def _set_field(fields: dict, path: str, text: str) -> None:
    """One dotted flag's value in its object, at ``path`` (``a.b``: fields["a"]["b"]), read as vLLM reads it."""
    from pagedllm.entrypoints.openai.cli_args import human_readable_int

    *parents, key = path.split(".")
    for parent in parents:
        fields = fields.setdefault(parent, {})
    if key.endswith("+"):
        fields[key[:-1]] = text.split(",")
        return
    try:
        fields[key] = json.loads(text)
    except json.JSONDecodeError:
        try:
            fields[key] = human_readable_int(text)
        except (ValueError, argparse.ArgumentTypeError):
            fields[key] = text


def _model_after_served_names(argv: list[str]) -> bool:
    """vLLM's check of `serve`'s command line (FlexibleArgumentParser.parse_args): --served-model-name takes every
    word after it, so a model given after it would be served as one more name, and the default model under them. It
    must come first (it is not there where a flag comes first), unless a --config file may name it."""
    return (argv[:1] == ["serve"] and len(argv) > 1 and argv[1].startswith("-")
            and any(re.match(r"--served-model-name(=|$)", arg) for arg in argv))


def main(argv: Optional[list[str]] = None) -> None:
    argv = vllm_argv(sys.argv[1:] if argv is None else argv)
    # A server collects no garbage until it is up (gc_utils.py; its lifespan freezes the start-up heap)
    with gc_paused() if argv[:1] == ["serve"] else contextlib.nullcontext():
        with engine_core_prestarted(_starts_engines(argv)):
            _run_command(argv)


def _client_parser() -> argparse.ArgumentParser:
    """`pagedllm chat` and `pagedllm complete` alone (CLIENT_COMMANDS)."""
    from pagedllm.entrypoints.chat_cli import add_chat_parser, add_complete_parser

    parser, subparsers = _command_parser()
    add_chat_parser(subparsers)
    add_complete_parser(subparsers)
    return parser


def _command_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The ``pagedllm`` parser, and the action its subcommands are added to."""
    parser = argparse.ArgumentParser(prog="pagedllm", description="pagedllm: LLM inference and serving")
    return parser, parser.add_subparsers(dest="command", required=True)


def _run_command(argv: list[str]) -> None:
    if argv[:1] and argv[0] in CLIENT_COMMANDS:
        args = _client_parser().parse_args(argv)
        args.func(args)
        return
    from pagedllm.entrypoints.openai.cli_args import (config_file_defaults, validate_parsed_serve_args,
                                                      validate_serving_args)

    parser, config_parsers = make_parser()
    command_parser = config_parsers.get(argv[0]) if argv else None
    config = _config_path(argv[1:]) if command_parser is not None else None
    if config:  # the file's flags as defaults: the command line's win
        defaults = config_file_defaults(command_parser, config)
        if argv[0] == "serve":  # vLLM's: with a file, the model is the command line's or the file's, never the default
            defaults.setdefault("model", None)
        command_parser.set_defaults(**defaults)
    elif _model_after_served_names(argv):
        command_parser.error("the model must be the first argument of serve when --served-model-name is given, as "
                             "in vLLM: pagedllm serve <model> --served-model-name <name> ...")
    args = parser.parse_args(argv)
    if args.command == "serve" and args.model is None:
        command_parser.error(f"no model specified: give it as serve's first argument or as `model:` in {config} "
                             f"(vLLM's rule with --config)")
    if args.command in ("serve", "run-batch"):
        try:  # before the model loads
            (validate_parsed_serve_args if args.command == "serve" else validate_serving_args)(args)
            multiproc_method()  # a bad PAGEDLLM_WORKER_MULTIPROC_METHOD, named before any process starts
        except ValueError as e:
            config_parsers[args.command].error(str(e))
    (args.bench_func if args.command == "bench" else args.func)(args)


if __name__ == "__main__":
    main()
