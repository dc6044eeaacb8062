"""transformers runner for benchmarks/compare.py: ``model.generate`` on the whole batch at once, the naive baseline.

No prefix cache and static batching; EOS is ignored by clearing it from the model's generation config (generate
fills unset fields from there), so every row runs to exactly ``max_tokens``.
"""
from __future__ import annotations

import argparse
import time

from harness import main


class TimingStreamer:
    """Timestamps every generated token; generate's first ``put`` is the prompt."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.saw_prompt = False

    def put(self, value) -> None:
        if self.saw_prompt:
            self.times.append(time.perf_counter())
        self.saw_prompt = True

    def end(self) -> None:
        pass


class HFEngine:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from transformers import AutoModelForCausalLM
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
        config = self.model.generation_config
        config.eos_token_id = None
        config.pad_token_id = self.model.config.vocab_size - 1  # unused: no row can stop early
        config.do_sample, config.temperature, config.top_p, config.top_k = False, None, None, None

    def run(self, prompts: list[list[int]], max_tokens: int, stream: bool) -> dict:
        if len({len(p) for p in prompts}) != 1:
            raise ValueError("prompts of different lengths would need padding; the workloads have none")
        input_ids = self.torch.tensor(prompts, dtype=self.torch.long)
        streamer = TimingStreamer() if stream else None
        start = time.perf_counter()
        with self.torch.inference_mode():
            output = self.model.generate(input_ids=input_ids, attention_mask=self.torch.ones_like(input_ids),
                                         max_new_tokens=max_tokens, streamer=streamer)
        wall_s = time.perf_counter() - start
        generated = tuple(output[:, input_ids.shape[1]:].shape)
        if generated != (len(prompts), max_tokens):
            raise RuntimeError(f"generated shape {generated}, expected {(len(prompts), max_tokens)}")
        if streamer is None:
            return {"wall_s": wall_s}
        return {"wall_s": streamer.times[-1] - start, "ttft_s": streamer.times[0] - start}


if __name__ == "__main__":
    main(HFEngine, "transformers")
