"""The worker's persistent batch through the engine: a running request that a step leaves out (the token budget ran
out before it) keeps its row, and comes back into the next step it is scheduled in without being added again;
the tokens stay transformers' greedy tokens."""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.worker.input_batch import InputBatch
from tests.e2e.conftest import assert_transformers_greedy, caller_id


def test_requests_left_out_of_a_step_keep_their_rows(tmp_path, tokenizer, monkeypatch):
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.5, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config).eval()
    reference.save_pretrained(tmp_path, safe_serialization=True)
    tokenizer.save_pretrained(tmp_path)
    prompts = [[1, 50, 60, 70], list(range(200, 211)), list(range(1000, 1030, 3)), [5, 6]]

    added, removed = [], []
    add, remove = InputBatch.add_request, InputBatch.remove_request
    monkeypatch.setattr(InputBatch, "add_request", lambda self, state: (added.append(state.req_id), add(self, state)))
    monkeypatch.setattr(InputBatch, "remove_request", lambda self, req_id: (removed.append(req_id),
                                                                            remove(self, req_id)))
    monkeypatch.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")  # the spies above are in this process
    # Two tokens a step for four requests: most steps leave running requests out.
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=2,
              enforce_eager=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    assert_transformers_greedy(reference, prompts, [o.outputs[0].token_ids for o in outputs], 12)
    # Each request joined the batch once; rows left only as requests finished (the last one's finish reaches the
    # worker with the next step, which never came).
    assert sorted(added) == sorted(set(added))
    assert sorted(map(caller_id, added)) == sorted(o.request_id for o in outputs)
    assert len(removed) == len(set(removed)) and set(removed) < set(added)
