"""A tiny Llama that answers one chat prompt with a fixed chain of tokens, for the server's parsers of what models
write (reasoning, tool calls): every layer's output is zeroed, so each next token is the LM head's pick for the last
token's embedding alone, and those picks are set as a chain from the generation prompt's last token through the
answer's tokens to EOS."""
from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def save_chain_model(path, tokenizer, messages: list[dict], new_tokens: list[str], answer: list[str]) -> None:
    """Saves to ``path`` the model (and ``tokenizer`` with ``new_tokens`` added, one token each, as a model family's
    tags are in its vocabulary) that answers ``messages`` with ``answer``, each piece of which is one token."""
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_tokens(new_tokens)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    generation_prompt_end = tokenizer.encode(prompt, add_special_tokens=False)[-1]
    pieces = [tokenizer.encode(piece, add_special_tokens=False) for piece in answer]
    assert all(len(ids) == 1 for ids in pieces), pieces
    chain = [generation_prompt_end, *(ids[0] for ids in pieces), tokenizer.eos_token_id]
    assert len(set(chain)) == len(chain)  # a token's successor is all the model knows of it
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, bos_token_id=1,
                         pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        for i, (token, next_token) in enumerate(zip(chain, chain[1:])):
            model.model.embed_tokens.weight[token] = torch.nn.functional.one_hot(torch.tensor(i), 64).float()
            model.lm_head.weight[next_token] = 10.0 * torch.nn.functional.one_hot(torch.tensor(i), 64).float()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


THOUGHT, ANSWER = [" Let", " me", " see"], [" Paris", " is", " big"]
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def save_thinking_model(path, tokenizer) -> None:
    """A thinking model: it answers MESSAGES with "<think> Let me see</think> Paris is big"."""
    save_chain_model(path, tokenizer, MESSAGES, ["<think>", "</think>"], ["<think>", *THOUGHT, "</think>", *ANSWER])
