"""Multi-LoRA serving: many PEFT adapters of one base model, batched together (vLLM's vllm/lora).

request.py: LoRARequest, what a caller names an adapter by. peft_helper.py: an adapter directory's
adapter_config.json read and checked. lora_model.py: its weights loaded and mapped onto the model's fused layers.
punica.py: the per-step rows of each adapter slot and the shrink/expand that adds x·A·B·scale to them.
layers.py: the slot tensors a LoRA'd linear layer holds. worker_manager.py: the worker's slots and its LRU of
loaded adapters.
"""
