"""A short chat with the default model through the offline LLM API (what `make run` runs)."""
from pagedllm import LLM, SamplingParams

llm = LLM()  # smollm2-135m-instruct, bfloat16 where the CPU supports it
conversation = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
output = llm.chat(conversation, SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)[0]
print(f"user: {conversation[0]['content']}")
print(f"assistant: {output.outputs[0].text}")
