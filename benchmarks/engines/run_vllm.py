"""vLLM runner for benchmarks/compare.py; runs with the vLLM venv's python, which has no pagedllm.

Batches go through ``LLM.generate`` (vLLM's offline path); a stream is driven through ``add_request``/``step`` so
the time its first token reaches the caller is visible.
"""
from __future__ import annotations

import argparse
import itertools
import time

from harness import main


class VLLMEngine:
    def __init__(self, args: argparse.Namespace) -> None:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        self.sampling_params, self.tokens_prompt = SamplingParams, TokensPrompt
        self.llm = LLM(model=args.model, dtype=args.dtype, seed=0, enable_prefix_caching=not args.no_prefix_caching,
                            speculative_config=args.speculative_config)
        self.request_ids = itertools.count()

    def run(self, prompts: list[list[int]], max_tokens: int, stream: bool) -> dict:
        params = self.sampling_params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.llm.reset_prefix_cache()
        return self._stream(prompts, params) if stream else self._batch(prompts, params)

    def _batch(self, prompts: list[list[int]], params) -> dict:
        start = time.perf_counter()
        outputs = self.llm.generate([self.tokens_prompt(prompt_token_ids=p) for p in prompts], params,
                                    use_tqdm=False)
        wall_s = time.perf_counter() - start
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        if lengths != [params.max_tokens] * len(prompts):
            raise RuntimeError(f"output lengths {lengths}, expected {params.max_tokens} each")
        return {"wall_s": wall_s}

    def _stream(self, prompts: list[list[int]], params) -> dict:
        (prompt,) = prompts
        engine, request_id = self.llm.llm_engine, f"compare-{next(self.request_ids)}"
        ttft_s, num_tokens = None, 0
        start = time.perf_counter()
        engine.add_request(request_id, self.tokens_prompt(prompt_token_ids=prompt), params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                num_tokens = len(out.outputs[0].token_ids)  # cumulative outputs
                if ttft_s is None and num_tokens:
                    ttft_s = time.perf_counter() - start
        wall_s = time.perf_counter() - start
        if num_tokens != params.max_tokens:
            raise RuntimeError(f"{num_tokens} output tokens, expected {params.max_tokens}")
        return {"wall_s": wall_s, "ttft_s": ttft_s}


if __name__ == "__main__":
    main(VLLMEngine, "vllm-cpu")
