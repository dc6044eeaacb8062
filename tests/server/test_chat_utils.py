"""Chat templates: --chat-template as a file or inline, and OpenAI's content parts."""
from __future__ import annotations

import pytest

from pagedllm.entrypoints.openai.chat_utils import apply_chat_template, load_chat_template
from pagedllm.entrypoints.openai.protocol import ChatMessageParam

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"


def test_chat_template_from_a_file_or_inline(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="chat-template"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_custom_template_and_text_parts(tokenizer):
    messages = [ChatMessageParam(role="user", content=[{"type": "text", "text": "Hello"},
                                                        {"type": "text", "text": "there"}])]
    token_ids = apply_chat_template(tokenizer, messages, TEMPLATE)
    assert tokenizer.decode(token_ids) == "[user] Hello\nthere\n"


def test_non_text_parts_are_rejected(tokenizer):
    messages = [ChatMessageParam(role="user", content=[{"type": "image_url", "image_url": {"url": "x"}}])]
    with pytest.raises(ValueError, match="only text"):
        apply_chat_template(tokenizer, messages, None)


def test_tokenize_counts_the_tools_as_chat_does(tokenizer):
    """/tokenize with messages gives the prompt a chat request with the same messages and tools gets: a template that
    describes the tools counts them (vLLM's TokenizeChatRequest takes tools for this)."""
    from pydantic import TypeAdapter

    from pagedllm.entrypoints.openai.protocol import TokenizeRequest
    from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
    from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

    template = "{% for t in tools or [] %}[tool] {{ t.function.name }}\n{% endfor %}" + TEMPLATE
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "Hi"}]
    tokenization = OpenAIServingTokenization(tokenizer, OpenAIServingModels(["m"], "m", 1024), template)
    request = TypeAdapter(TokenizeRequest).validate_python({"messages": messages, "tools": [tool]})
    tokens = tokenization.create_tokenize(request).tokens
    assert tokens == apply_chat_template(tokenizer, [ChatMessageParam(**m) for m in messages], template, tools=[tool])
    assert tokenizer.decode(tokens) == "[tool] get_weather\n[user] Hi\n"
