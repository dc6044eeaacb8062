"""`pagedllm chat` through a real terminal (a pty), against the shared server: the line naming the sampling
settings, a greedy answer from --temperature 0, and a second turn that sees the first."""
from __future__ import annotations

import argparse
import os
import pty
import select
import subprocess
import sys
import time

from pagedllm.entrypoints.chat_cli import sampling_settings
from tests.server.conftest import API_KEY

PROMPT = "\n> "


class Terminal:
    """A command on a pseudo-terminal, read until a text shows up (as a user would wait for it)."""

    def __init__(self, args: list[str]) -> None:
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
        os.close(slave)
        self.output = ""

    def expect(self, text: str, timeout: float = 120) -> str:
        """Everything printed up to and including ``text`` since the last expect."""
        deadline = time.monotonic() + timeout
        while text not in self.output:
            ready, _, _ = select.select([self.master], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"{text!r} not seen within {timeout} s; the terminal shows:\n{self.output}")
            try:
                self.output += os.read(self.master, 4096).decode(errors="replace").replace("\r\n", "\n")
            except OSError:  # the command ended
                raise AssertionError(f"{text!r} not seen before the command ended:\n{self.output}") from None
        seen, _, self.output = self.output.partition(text)
        return seen + text

    def type(self, line: str) -> None:
        os.write(self.master, (line + "\n").encode())

    def close(self) -> int:
        os.write(self.master, b"\x04")  # Ctrl-D at the prompt
        try:
            return self.proc.wait(30)
        finally:
            os.close(self.master)


def test_chat_answers_greedily_and_keeps_the_conversation(server):
    terminal = Terminal([sys.executable, "-m", "pagedllm.entrypoints.cli", "chat", "--url", server.url_for("v1"),
                         "--api-key", API_KEY, "--temperature", "0", "--max-tokens", "40"])
    try:
        greeting = terminal.expect(PROMPT)
        # The server has no generation config (a GGUF model): top_p is the client's default.
        assert "Sampling: temperature=0.0, top_p=0.9, max_tokens=40 (from flags and pagedllm chat's defaults" in \
            greeting
        terminal.type("What is the capital of France?")
        assert "Paris" in terminal.expect(PROMPT)
        terminal.type("What about Germany?")  # alone, the model talks about German food
        assert "Berlin" in terminal.expect(PROMPT)
    finally:
        assert terminal.close() == 0


def test_sampling_settings_prefer_flags_then_the_servers_defaults():
    def args(**flags):
        return argparse.Namespace(**{"temperature": None, "top_p": None, "max_tokens": None, **flags})

    assert sampling_settings(args(), {}) == (
        {"temperature": 0.7, "top_p": 0.9},
        "Sampling: temperature=0.7, top_p=0.9 (from pagedllm chat's defaults (the model has no generation config)).")
    # With the server's defaults the client sends only its flags: the server fills in the rest.
    sent, line = sampling_settings(args(temperature=0.0), {"temperature": 0.6, "top_p": 0.95})
    assert sent == {"temperature": 0.0}
    assert line == ("Sampling: temperature=0.0, top_p=0.95 (from flags and the server's defaults from the model's "
                    "generation config).")
    assert sampling_settings(args(temperature=1.0, top_p=1.0), {}) == (
        {"temperature": 1.0, "top_p": 1.0}, "Sampling: temperature=1.0, top_p=1.0 (from flags).")


def _client_command(*argv: str, api_key: str = API_KEY) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", *argv], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OPENAI_API_KEY": api_key})


def test_quick_chat_and_complete_as_vllms(server):
    """vLLM's `chat -q MESSAGE` and `complete --quick PROMPT`: one request, its answer printed, and the command ends
    (no prompt); --model-name is vLLM's spelling of --model, and OPENAI_API_KEY the key where --api-key is not
    given, as in vLLM."""
    with server.http() as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
    url = server.url_for("v1")
    chat = _client_command("chat", "--url", url, "--temperature", "0", "--max-tokens", "20", "-q",
                           "What is the capital of France?")
    assert chat.returncode == 0 and "Paris" in chat.stdout and "> " not in chat.stdout, chat
    complete = _client_command("complete", "--url", url, "--model-name", model, "--max-tokens", "8", "--quick",
                               "The capital of France is")
    assert complete.returncode == 0 and complete.stdout.strip() and "> " not in complete.stdout, complete
    refused = _client_command("complete", "--url", url, "--model-name", "no-such-model", "-q", "Hi")
    assert refused.returncode == 1 and "[error]" in refused.stderr and "no-such-model" in refused.stderr
    assert _client_command("chat", "--url", url, "-q", "Hi", api_key="wrong").returncode != 0


def test_the_client_commands_start_without_the_engines_imports():
    """`pagedllm chat` and `complete` only talk to a server: their command line is read without the engine's flags,
    whose defaults import torch (seconds before a one-line question is asked)."""
    probe = ("import sys\nfrom pagedllm.entrypoints.cli import main\nfor command in ('chat', 'complete'):\n"
             "    try:\n        main([command, '--help'])\n    except SystemExit:\n        pass\n"
             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.splitlines()[-1] == "[]", result.stdout + result.stderr
    assert "--quick" in result.stdout
