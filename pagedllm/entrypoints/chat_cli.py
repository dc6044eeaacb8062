"""`pagedllm chat`: an interactive terminal chat with a running OpenAI-compatible server (and vLLM's `complete`, its
prompts completed).

Sampling: a flag (--temperature, --top-p, --max-tokens) is sent with every request. What the flags leave out is
the server's to choose when it has defaults from the model's generation config (its /v1/models card lists them);
otherwise this client sends temperature 0.7 and top_p 0.9, as common chat clients do, since the server's own
defaults (temperature 1.0, no top-p) make small models ramble. The whole conversation is sent each turn, so the
model sees the earlier turns.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Callable, Iterator, Optional

# Sent when neither a flag nor the server's generation config sets them.
CHAT_DEFAULTS = {"temperature": 0.7, "top_p": 0.9}


def _add_query_parser(subparsers: argparse._SubParsersAction, name: str, help: str) -> argparse.ArgumentParser:
    """A client command's parser with vLLM's query options (its `chat` and `complete`): the server, the model, the key
    (default: $OPENAI_API_KEY, as vLLM's), and -q/--quick MESSAGE for one request and no prompt."""
    parser = subparsers.add_parser(name, help=help)
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    parser.add_argument("--model", "--model-name", dest="model", default=None,
                        help="model name (default: the server's first)")
    parser.add_argument("--api-key", default=None, help="the server's API key (default: $OPENAI_API_KEY)")
    parser.add_argument("-q", "--quick", metavar="MESSAGE", default=None,
                        help="send this one message, print the answer and exit")
    return parser


def add_chat_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = _add_query_parser(subparsers, "chat", "chat in the terminal with a running server")
    parser.add_argument("--system", "--system-prompt", dest="system_prompt", default=None,
                        help="a system message that starts the conversation")
    parser.add_argument("--temperature", type=float, default=None,
                        help="0 answers greedily (default: the model's generation config's, else 0.7)")
    parser.add_argument("--top-p", type=float, default=None,
                        help="default: the model's generation config's, else 0.9")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="longest answer in tokens (default: the server's)")
    parser.set_defaults(func=chat)


def _request(url: str, api_key: Optional[str], body: Optional[dict] = None) -> urllib.request.Request:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return urllib.request.Request(url, json.dumps(body).encode() if body is not None else None, headers)


def _post_stream(url: str, api_key: Optional[str], body: dict) -> Iterator[dict]:
    """The events of an OpenAI SSE stream, as they arrive; a refused request is a RuntimeError with the server's
    message."""
    try:
        response = urllib.request.urlopen(_request(url, api_key, body))
    except urllib.error.HTTPError as e:
        try:
            message = json.load(e)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = str(e)
        raise RuntimeError(f"{e.code}: {message}") from None
    with response:
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


def _model_card(url: str, api_key: Optional[str], model: Optional[str]) -> dict:
    """The /v1/models card of ``model`` (the server's first when None; an empty card for a name not listed)."""
    with urllib.request.urlopen(_request(f"{url}/models", api_key)) as response:
        cards = json.load(response)["data"]
    if model is None:
        return cards[0]
    return next((card for card in cards if card["id"] == model), {"id": model})


def sampling_settings(args: argparse.Namespace, server_defaults: dict) -> tuple[dict, str]:
    """The sampling fields to send with every request (SamplingParams names), and the line telling the user which
    settings are in use and where they come from."""
    flags = {name: value for name, value in (("temperature", args.temperature), ("top_p", args.top_p),
                                             ("max_tokens", args.max_tokens)) if value is not None}
    sources = ["flags"] if flags else []
    if server_defaults:
        sent = flags
        in_use = {**server_defaults, **flags}
        if set(server_defaults) - set(flags):
            sources.append("the server's defaults from the model's generation config")
    else:
        sent = in_use = {**CHAT_DEFAULTS, **flags}
        if set(CHAT_DEFAULTS) - set(flags):
            sources.append("pagedllm chat's defaults (the model has no generation config)")
    shown = ", ".join(f"{name}={value}" for name, value in in_use.items())
    return sent, f"Sampling: {shown} (from {' and '.join(sources)})."


def _connect(args: argparse.Namespace) -> tuple[str, Optional[str], dict]:
    """The server's URL, the API key, and the model's /v1/models card; exits where the server cannot be reached."""
    url = args.url.rstrip("/")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    try:
        return url, api_key, _model_card(url, api_key, args.model)
    except urllib.error.URLError as e:
        sys.exit(f"Cannot reach {url}: {e}")


def _user_lines(quick: Optional[str]) -> Iterator[str]:
    """What the user sends: --quick's message alone, else each line typed, until EOF or "exit"."""
    if quick is not None:
        yield quick
        return
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if line.strip() == "exit":
            return
        if line.strip():
            yield line


def _print_answer(url: str, api_key: Optional[str], body: dict, text_of: Callable[[dict], str],
                  quick: Optional[str]) -> Optional[str]:
    """Streams a request's answer to the terminal, each choice's text by ``text_of``, and returns it; a failure is
    printed and None returned, or with --quick (no next turn) the command's exit."""
    answer = []
    try:
        for event in _post_stream(url, api_key, body):
            for choice in event["choices"]:
                answer.append(text_of(choice) or "")
                print(answer[-1], end="", flush=True)
    except (urllib.error.URLError, RuntimeError) as e:
        if quick is not None:
            sys.exit(f"\n[error] {e}")
        print(f"\n[error] {e}", flush=True)
        return None
    print(flush=True)
    return "".join(answer)


def chat(args: argparse.Namespace) -> None:
    """Reads a line, streams the answer, keeps the history; ends on EOF or "exit" (with --quick, after its answer)."""
    url, api_key, card = _connect(args)
    model = card["id"]
    sampling, settings_line = sampling_settings(args, card.get("default_sampling_params") or {})
    if "max_tokens" in sampling:
        sampling["max_completion_tokens"] = sampling.pop("max_tokens")
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    if args.quick is None:
        print(f"Chatting with {model} at {url}; type exit or press Ctrl-D to leave.", flush=True)
        print(settings_line, flush=True)
    for line in _user_lines(args.quick):
        messages.append({"role": "user", "content": line})
        body = {"model": model, "messages": messages, "stream": True, **sampling}
        answer = _print_answer(f"{url}/chat/completions", api_key, body, lambda choice: choice["delta"].get("content"),
                               args.quick)
        if answer is None:
            messages.pop()
        else:
            messages.append({"role": "assistant", "content": answer})


def add_complete_parser(subparsers: argparse._SubParsersAction) -> None:
    """vLLM's `complete`: each line a prompt, its completion streamed (the server's sampling defaults)."""
    parser = _add_query_parser(subparsers, "complete", "complete prompts in the terminal with a running server")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="longest completion in tokens (default: the server's)")
    parser.set_defaults(func=complete)


def complete(args: argparse.Namespace) -> None:
    url, api_key, card = _connect(args)
    if args.quick is None:
        print(f"Completing with {card['id']} at {url}; type exit or press Ctrl-D to leave.", flush=True)
    max_tokens = {} if args.max_tokens is None else {"max_tokens": args.max_tokens}
    for prompt in _user_lines(args.quick):
        body = {"model": card["id"], "prompt": prompt, "stream": True, **max_tokens}
        _print_answer(f"{url}/completions", api_key, body, lambda choice: choice.get("text"), args.quick)
