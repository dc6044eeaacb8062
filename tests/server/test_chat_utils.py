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
