"""Reasoning parsers (vLLM's --reasoning-parser): a thinking model's answer split into its reasoning and its content."""
from pagedllm.reasoning.parsers import (REASONING_PARSERS, DeepSeekR1ReasoningParser, Qwen3ReasoningParser,
                                        ReasoningStream, get_reasoning_parser)

__all__ = ["REASONING_PARSERS", "DeepSeekR1ReasoningParser", "Qwen3ReasoningParser", "ReasoningStream",
           "get_reasoning_parser"]
