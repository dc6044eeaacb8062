"""`pagedllm chat`: an interactive terminal chat with a running OpenAI-compatible server.

Sampling: a flag (--temperature, --top-p, --max-tokens) is sent with every request. What the flags leave out is
the server's to choose when it has defaults from the model's generation config (its /v1/models card lists them);
otherwise this client sends temperature 0.7 and top_p 0.9, as common chat clients do, since the server's own
defaults (temperature 1.0, no top-p) make small models ramble. The whole conversation is sent each turn, so the
model sees the earlier turns.
"""
from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Iterator, Optional

# Sent when neither a flag nor the server's generation config sets them.
CHAT_DEFAULTS = {"temperature": 0.7, "top_p": 0.9}


def add_chat_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("chat", help="chat in the terminal with a running server")
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    parser.add_argument("--model", default=None, help="model name (default: the server's first)")
    parser.add_argument("--api-key", default=None)
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
    """The events of an OpenAI SSE stream, as they arrive."""
    with urllib.request.urlopen(_request(url, api_key, body)) as response:
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


def chat(args: argparse.Namespace) -> None:
    """Reads a line, streams the answer, keeps the history; ends on EOF or "exit"."""
    url = args.url.rstrip("/")
    try:
        card = _model_card(url, args.api_key, args.model)
    except urllib.error.URLError as e:
        sys.exit(f"Cannot reach {url}: {e}")
    model = card["id"]
    sampling, settings_line = sampling_settings(args, card.get("default_sampling_params") or {})
    if "max_tokens" in sampling:
        sampling["max_completion_tokens"] = sampling.pop("max_tokens")
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    print(f"Chatting with {model} at {url}; type exit or press Ctrl-D to leave.", flush=True)
    print(settings_line, flush=True)
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
        answer = []
        try:
            body = {"model": model, "messages": messages, "stream": True, **sampling}
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
