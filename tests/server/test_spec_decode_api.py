"""`pagedllm serve --speculative-config` answers greedy requests, streamed or not, exactly as the plain server
does, counts its drafts in vLLM's spec_decode metrics and its periodic log line, and a bad config fails the command
before any engine."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.server.conftest import RemoteServer

CODE = "def area(width, height):\n    result = width * height\n    return result\n"
PROMPTS = [f"Copy this code exactly.\n{CODE}\nCopy:\n", "Count: one, two, three, four, five, six,",
           "The capital of France is"]


def completions(server: RemoteServer, stream: bool) -> list[str]:
    client = server.get_client()
    model = client.models.list().data[0].id
    if not stream:
        response = client.completions.create(model=model, prompt=PROMPTS, max_tokens=30, temperature=0,
                                             stop=["return"])
        return [c.text for c in sorted(response.choices, key=lambda c: c.index)]
    texts = []
    for prompt in PROMPTS:
        chunks = client.completions.create(model=model, prompt=prompt, max_tokens=30, temperature=0,
                                           stop=["return"], stream=True)
        texts.append("".join(chunk.choices[0].text for chunk in chunks if chunk.choices))
    return texts


def test_greedy_completions_equal_the_plain_servers_streamed_or_not(server, spec_server):
    expected = completions(server, stream=False)
    assert completions(spec_server, stream=False) == expected
    assert completions(spec_server, stream=True) == expected
    metrics = spec_server.metrics()
    drafts = metrics["pagedllm:spec_decode_num_draft_tokens_total"]
    accepted = metrics["pagedllm:spec_decode_num_accepted_tokens_total"]
    assert metrics["pagedllm:spec_decode_num_drafts_total"] > 0 and 0 < accepted <= drafts
    assert sum(metrics[f"pagedllm:spec_decode_num_accepted_tokens_per_pos_total{{position={pos}}}"]
               for pos in range(4)) == accepted
    assert "SpecDecoding metrics: Mean acceptance length: " in spec_server.log()  # the periodic log line


def test_a_bad_speculative_config_fails_the_command_naming_the_field():
    result = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--speculative-config",
                             '{"method": "eagle", "num_speculative_tokens": 2}'], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0
    assert "speculative_config method must be one of ngram, draft_model, suffix, got 'eagle'" in result.stderr
