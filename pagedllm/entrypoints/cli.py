"""The `pagedllm` command: `serve` runs the OpenAI-compatible server, `run-batch` runs a batch file of its requests
in-process, `chat` talks to a server from the terminal, `bench` measures the engine or a server
(pagedllm.benchmarks)."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import urllib.error
import urllib.request
from typing import Iterator, Optional

from pagedllm.benchmarks.cli import add_bench_parser
from pagedllm.entrypoints.openai.api_server import run_server
from pagedllm.entrypoints.openai import run_batch as batch
from pagedllm.entrypoints.openai.cli_args import config_file_defaults, make_arg_parser


def serve(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        asyncio.run(run_server(args))
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled, once shut down
        pass


def run_batch(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(batch.run_batch(args))


def _post_stream(url: str, api_key: Optional[str], body: dict) -> Iterator[dict]:
    """The events of an OpenAI SSE stream, as they arrive."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request) as response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            yield event


def _first_model(url: str, api_key: Optional[str]) -> str:
    request = urllib.request.Request(f"{url}/models",
                                     headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(request) as response:
        return json.load(response)["data"][0]["id"]


def chat(args: argparse.Namespace) -> None:
    """Reads a line, streams the answer, keeps the history; ends on EOF or "exit"."""
    url = args.url.rstrip("/")
    try:
        model = args.model or _first_model(url, args.api_key)
    except urllib.error.URLError as e:
        sys.exit(f"Cannot reach {url}: {e}")
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    print(f"Chatting with {model} at {url}; type exit or press Ctrl-D to leave.", flush=True)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if line.strip() == "exit":
            return
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        body = {"model": model, "messages": messages, "stream": True}
        if args.max_tokens is not None:
            body["max_completion_tokens"] = args.max_tokens
        answer = []
        try:
            for event in _post_stream(f"{url}/chat/completions", args.api_key, body):
                for choice in event["choices"]:
                    piece = choice["delta"].get("content") or ""
                    answer.append(piece)
                    print(piece, end="", flush=True)
        except (urllib.error.URLError, RuntimeError) as e:
            messages.pop()
            print(f"\n[error] {e}", flush=True)
            continue
        print(flush=True)
        messages.append({"role": "assistant", "content": "".join(answer)})


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
    chat_parser = subparsers.add_parser("chat", help="chat in the terminal with a running server")
    chat_parser.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    chat_parser.add_argument("--model", default=None, help="model name (default: the server's first)")
    chat_parser.add_argument("--api-key", default=None)
    chat_parser.add_argument("--system-prompt", default=None)
    chat_parser.add_argument("--max-tokens", type=int, default=None, help="longest answer in tokens")
    chat_parser.set_defaults(func=chat)
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
    (args.bench_func if args.command == "bench" else args.func)(args)


if __name__ == "__main__":
    main()
