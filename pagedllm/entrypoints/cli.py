"""The `pagedllm` command: `serve` runs the OpenAI-compatible server, `run-batch` runs a batch file of its requests
in-process, `chat` talks to a server from the terminal (chat_cli.py), `bench` measures the engine or a server
(pagedllm.benchmarks)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Optional

from pagedllm.benchmarks.cli import add_bench_parser
from pagedllm.entrypoints.chat_cli import add_chat_parser
from pagedllm.entrypoints.openai.api_server import run_server
from pagedllm.entrypoints.openai import run_batch as batch
from pagedllm.entrypoints.openai.cli_args import config_file_defaults, make_arg_parser, validate_parsed_serve_args


def serve(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        asyncio.run(run_server(args))
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled, once shut down
        pass


def run_batch(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(batch.run_batch(args))


def doctor(args: argparse.Namespace) -> None:
    from pagedllm.native.doctor import main as doctor_main

    sys.exit(doctor_main())


def make_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The ``pagedllm`` parser, and its ``serve`` subcommand's (which reads ``--config`` files)."""
    parser = argparse.ArgumentParser(prog="pagedllm", description="pagedllm: LLM inference and serving")
    subparsers = parser.add_subparsers(dest="command", required=True)
    serve_parser = subparsers.add_parser("serve", help="run the OpenAI-compatible API server")
    make_arg_parser(serve_parser).set_defaults(func=serve)
    batch_parser = subparsers.add_parser("run-batch", help="run a file of requests in OpenAI's batch format")
    batch.make_arg_parser(batch_parser).set_defaults(func=run_batch)
    add_chat_parser(subparsers)
    add_bench_parser(subparsers)
    doctor_parser = subparsers.add_parser("doctor", help="the CPU features seen and each native kernel's build")
    doctor_parser.set_defaults(func=doctor)
    return parser, serve_parser


def main(argv: Optional[list[str]] = None) -> None:
    parser, serve_parser = make_parser()
    args = parser.parse_args(argv)
    if args.command == "serve" and args.config:  # the file's flags as defaults: the command line's win
        serve_parser.set_defaults(**config_file_defaults(serve_parser, args.config))
        args = parser.parse_args(argv)
    if args.command == "serve":
        try:
            validate_parsed_serve_args(args)  # before the model loads
        except ValueError as e:
            serve_parser.error(str(e))
    (args.bench_func if args.command == "bench" else args.func)(args)


if __name__ == "__main__":
    main()
