"""Chat templates: --chat-template as a file or inline, and OpenAI's content parts."""
from __future__ import annotations

import asyncio
import copy

import pytest
from tokenizers import processors

from pagedllm.entrypoints.openai.chat_utils import (chat_request_prompt, load_chat_template, render_chat_template,
                                                   resolve_chat_template_content_format)
from pagedllm.entrypoints.openai.errors import BadRequestError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessageParam, TokenizeChatRequest
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"


def apply_chat_template(tokenizer, messages: list[ChatMessageParam], template, **kwargs) -> list[int]:
    """render_chat_template's text as the server tokenizes it (no special tokens added: the template writes them)."""
    return tokenizer.encode(render_chat_template(tokenizer, messages, template, **kwargs), add_special_tokens=False)


def test_chat_template_from_a_file_or_inline(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="looks like a file path, but it failed to be opened"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_a_chat_template_is_the_text_given_when_it_has_a_brace_or_a_newline_as_vllms():
    """vLLM's _load_chat_template: text that opens no file is the template as given when it holds any of "{}\n",
    though it has no {{ or {% (a template of plain text, or of a brace alone); without them it is a path."""
    for template in ("You are a bot.\n", "answer in {json}", "}"):
        assert load_chat_template(template) == template
    with pytest.raises(ValueError, match=r"chat template \(plain words\) looks like a file path"):
        load_chat_template("plain words")


def test_a_chat_template_path_object_is_a_file_as_vllms(tmp_path):
    """vLLM's LLM(chat_template=Path(...)) reads the file; one that cannot be opened is its OSError, before any engine
    starts (it was a TypeError: a path is no text to look for Jinja in)."""
    from pagedllm import LLM

    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(path) == TEMPLATE
    with pytest.raises(FileNotFoundError):
        load_chat_template(tmp_path / "missing.jinja")
    with pytest.raises(FileNotFoundError):
        LLM(chat_template=tmp_path / "missing.jinja")


def test_custom_template_and_text_parts(tokenizer):
    messages = [ChatMessageParam(role="user", content=[{"type": "text", "text": "Hello"},
                                                        {"type": "text", "text": "there"}])]
    assert render_chat_template(tokenizer, messages, TEMPLATE) == "[user] Hello\nthere\n"


def test_empty_text_parts_add_no_line(tokenizer):
    """As vLLM's _parse_chat_message_content_parts: a text part with empty text is left out of the joined text."""
    messages = [ChatMessageParam(role="user", content=["Hello", "", {"type": "text", "text": ""}, "there"])]
    assert render_chat_template(tokenizer, messages, TEMPLATE) == "[user] Hello\nthere\n"


def test_non_text_parts_are_rejected(tokenizer):
    messages = [ChatMessageParam(role="user", content=[{"type": "image_url", "image_url": {"url": "x"}}])]
    with pytest.raises(ValueError, match="only text"):
        render_chat_template(tokenizer, messages, None)


def test_tokenize_counts_the_tools_as_chat_does(tokenizer):
    """/tokenize with messages gives the prompt a chat request with the same messages and tools gets: a template that
    describes the tools counts them (vLLM's TokenizeChatRequest takes tools for this)."""
    from pydantic import TypeAdapter

    from pagedllm.entrypoints.openai.protocol import TokenizeRequest

    template = "{% for t in tools or [] %}[tool] {{ t.function.name }}\n{% endfor %}" + TEMPLATE
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "Hi"}]
    tokenization = OpenAIServingTokenization(tokenizer, OpenAIServingModels(["m"], "m", 1024), template)
    request = TypeAdapter(TokenizeRequest).validate_python({"messages": messages, "tools": [tool]})
    tokens = tokenization.create_tokenize(request).tokens
    text = render_chat_template(tokenizer, [ChatMessageParam(**m) for m in messages], template, tools=[tool])
    assert tokens == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(tokens) == "[tool] get_weather\n[user] Hi\n"


# A template that writes each call's arguments out as JSON, as Hermes/Qwen and Llama 3.1 templates do.
TOOL_CALL_TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {% for call in m.tool_calls or [] %}"
                      "<call>{{ call.function.arguments | tojson }}</call>{% endfor %}{{ m.content }}\n{% endfor %}")


def test_assistant_tool_call_arguments_reach_the_template_as_objects(tokenizer):
    """OpenAI sends an earlier call's arguments as JSON text; the template gets the object (vLLM's
    _postprocess_messages), so tojson writes it once, not as a quoted string; text that is no JSON object is {}."""
    messages = [ChatMessageParam(role="user", content="Weather?"),
                ChatMessageParam(role="assistant", content=None, tool_calls=[
                    {"id": "a", "type": "function", "function": {"name": "w", "arguments": '{"city": "Paris"}'}},
                    {"id": "b", "type": "function", "function": {"name": "w", "arguments": "not json"}}]),
                ChatMessageParam(role="tool", tool_call_id="a", content="sunny")]
    token_ids = apply_chat_template(tokenizer, messages, TOOL_CALL_TEMPLATE, add_generation_prompt=False)
    assert tokenizer.decode(token_ids) == ('[user] Weather?\n[assistant] <call>{"city": "Paris"}</call>'
                                           '<call>{}</call>\n[tool] sunny\n')
    assert messages[1].tool_calls[0]["function"]["arguments"] == '{"city": "Paris"}'  # the request is left as it was
    with pytest.raises(ValueError, match=r"messages\[0\].tool_calls\[0\]"):
        apply_chat_template(tokenizer, [ChatMessageParam(role="assistant", tool_calls=["call"])], TOOL_CALL_TEMPLATE)


def test_every_text_part_type_is_read(tokenizer):
    """As vLLM's TEXT_PART_TYPES: an assistant's refusal parts (OpenAI's), the Responses API's input_text and
    output_text parts, and thinking parts are text too; and so are plain strings among the parts."""
    messages = [ChatMessageParam(role="user", content=[{"type": "input_text", "text": "Hello"}, "there"]),
                ChatMessageParam(role="assistant", content=[{"type": "output_text", "text": "Hi"},
                                                            {"type": "refusal", "refusal": "No."}])]
    token_ids = apply_chat_template(tokenizer, messages, TEMPLATE, add_generation_prompt=False)
    assert tokenizer.decode(token_ids) == "[user] Hello\nthere\n[assistant] Hi\nNo.\n"
    with pytest.raises(ValueError, match=r"content\[0\].refusal must be a string"):
        apply_chat_template(tokenizer, [ChatMessageParam(role="assistant", content=[{"type": "refusal"}])], TEMPLATE)
    for part_type in (["text"], {"text": "Hi"}):  # no part type's name: a 400 like any other (not a TypeError's 500)
        with pytest.raises(ValueError, match=r"content\[0\]: only text parts are supported"):
            apply_chat_template(tokenizer, [ChatMessageParam(role="user", content=[{"type": part_type, "text": "Hi"}])],
                                TEMPLATE)


def test_chat_template_kwargs_reach_the_template_and_a_requests_own_template_is_refused(tokenizer):
    """vLLM's chat_template_kwargs (Qwen3's enable_thinking, ...) are variables of the server's chat template; a
    template of the request's own is a 400, as vLLM answers without --trust-request-chat-template."""
    template = "{% if enable_thinking is false %}/no_think {% endif %}" + TEMPLATE
    serving = OpenAIServingTokenization(tokenizer, OpenAIServingModels(["m"], "m", 1024), template)
    hi = [{"role": "user", "content": "Hi"}]
    for kwargs, text in [(None, "[user] Hi\n"), ({"enable_thinking": False}, "/no_think [user] Hi\n"),
                         ({"truncation": True, "max_length": 1}, "[user] Hi\n")]:  # no say in the tokens
        request = TokenizeChatRequest.model_validate({"messages": hi, "chat_template_kwargs": kwargs})
        assert tokenizer.decode(serving.create_tokenize(request).tokens) == text
    for body, param in [({"chat_template": "{{ messages }}"}, "chat_template"),
                        ({"chat_template_kwargs": {"chat_template": "{{ messages }}"}}, "chat_template_kwargs")]:
        with pytest.raises(BadRequestError) as refused:
            serving.create_tokenize(TokenizeChatRequest.model_validate({"messages": hi, **body}))
        assert refused.value.param == param


def test_add_special_tokens_adds_the_tokenizers_own_to_the_templates(tokenizer):
    """vLLM's add_special_tokens, of chat requests and /tokenize's messages form: off by default, the prompt is the
    template's tokens alone; on, the tokenizer's own special tokens (here a BOS) are added to them."""
    bos_tokenizer = copy.deepcopy(tokenizer)  # SmolLM2's adds none: one that adds a BOS, as Llama's
    bos_tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tokenizer.bos_token} $A", special_tokens=[(tokenizer.bos_token, tokenizer.bos_token_id)])
    serving = OpenAIServingTokenization(bos_tokenizer, OpenAIServingModels(["m"], "m", 1024), TEMPLATE)
    hi = [{"role": "user", "content": "Hi"}]
    plain, added = (serving.create_tokenize(TokenizeChatRequest.model_validate({"messages": hi, **extra})).tokens
                    for extra in ({}, {"add_special_tokens": True}))
    assert bos_tokenizer.decode(plain) == "[user] Hi\n" and added == [tokenizer.bos_token_id, *plain]
    chat = ChatCompletionRequest.model_validate({"messages": hi, "add_special_tokens": True})
    assert chat_request_prompt(bos_tokenizer, chat, TEMPLATE) == added


def test_reasoning_effort_and_documents_reach_the_template(tokenizer):
    """As vLLM's build_chat_params: a chat request's reasoning_effort and documents are variables of the template,
    and reasoning_effort "none" turns thinking off (any other value on) for templates that read enable_thinking,
    unless chat_template_kwargs say otherwise."""
    template = ("{% if enable_thinking is defined %}thinking={{ enable_thinking }} {% endif %}{{ reasoning_effort }}"
                "{% for d in documents or [] %} [doc] {{ d.title }}{% endfor %}|" + TEMPLATE)
    hi = [{"role": "user", "content": "Hi"}]
    for body, text in [({}, ""), ({"reasoning_effort": "none"}, "thinking=False none"),
                       ({"reasoning_effort": "low"}, "thinking=True low"),
                       ({"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}},
                        "thinking=False high"),
                       ({"documents": [{"title": "Paris", "text": "The capital."}]}, " [doc] Paris")]:
        request = ChatCompletionRequest.model_validate({"messages": hi, **body})
        assert tokenizer.decode(chat_request_prompt(tokenizer, request, template)) == text + "|[user] Hi\n", body


def test_an_answers_reasoning_reaches_the_template_under_both_names(tokenizer):
    """An assistant message's reasoning, sent back as "reasoning" (the field answers carry it in) or as
    "reasoning_content", reaches the template under both names, as vLLM's (Qwen3's template reads
    reasoning_content); "reasoning" wins where both are sent."""
    template = "{% for m in messages %}[{{ m.role }}] {{ m.reasoning_content }}/{{ m.reasoning }}|{{ m.content }}\n" \
               "{% endfor %}"
    for fields in ({"reasoning": "Think."}, {"reasoning_content": "Think."},
                   {"reasoning": "Think.", "reasoning_content": "Other."}):
        messages = [ChatMessageParam(role="user", content="Hi"), ChatMessageParam(role="assistant", content="Hello",
                                                                                 **fields)]
        token_ids = apply_chat_template(tokenizer, messages, template, add_generation_prompt=False)
        assert tokenizer.decode(token_ids) == "[user] /|Hi\n[assistant] Think./Think.|Hello\n", fields


def test_a_tools_fields_left_out_reach_the_template_as_null(tokenizer):
    """A tool's description or parameters the client left out are null to the template, as vLLM gives them (its
    model_dump()), and its strict is there where the client sent it, so a template that writes the tools out as JSON
    (Qwen's, Hermes') writes vLLM's prompt."""
    template = "{% for t in tools %}{{ t | tojson }}{% endfor %}|" + TEMPLATE
    tools = [{"type": "function", "function": {"name": "f"}},
             {"type": "function", "function": {"name": "g", "strict": True}}]
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], "tools": tools})
    assert tokenizer.decode(chat_request_prompt(tokenizer, request, template)) == \
        '{"type": "function", "function": {"name": "f", "description": null, "parameters": null}}' \
        '{"type": "function", "function": {"name": "g", "description": null, "parameters": null, "strict": true}}' \
        '|[user] Hi\n'


# A template that loops over each message's content parts, as multimodal models' (Llama 4's, Gemma 3's) do.
PARTS_TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{% for part in m['content'] %} <{{ part.type }}:"
                  "{{ part.text }}>{% endfor %}{{ '\\n' }}{% endfor %}")


@pytest.mark.parametrize("template, content_format", [
    (TEMPLATE, "string"),
    (PARTS_TEMPLATE, "openai"),
    ("{% set turns = messages[1:] %}{% for m in turns | reverse %}{% for p in m.content | list %}{{ p.text }}"
     "{% endfor %}{% endfor %}", "openai"),  # the messages through a variable, filters and a slice
    ("{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}{{ p.text }}"
     "{% endfor %}{% endif %}{% endfor %}", "openai"),  # either, as Qwen's templates
    ("{% for m in messages %}{% set content = m.content %}{% for p in content %}{{ p.text }}{% endfor %}{% endfor %}",
     "openai"),
    ("{% macro render(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
     "{% for m in messages %}{{ render(m.content) }}{% endfor %}", "openai"),  # a macro given the content
    ("{% macro render(c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}{{ render(tools) }}" + TEMPLATE, "string"),
    ("{% for m in messages %", "string"),  # no template: rendering says why
])
def test_content_format_auto_is_told_from_the_template(tokenizer, template, content_format):
    """As vLLM's _detect_content_format: a template that loops over a message's content gets it as OpenAI's list of
    parts, any other as text."""
    assert resolve_chat_template_content_format(tokenizer, template, None, "auto") == content_format
    assert resolve_chat_template_content_format(tokenizer, template, None, "string") == "string"


def test_a_template_looping_over_the_parts_gets_them(tokenizer):
    """vLLM's --chat-template-content-format auto: a template that loops over the content parts gets the list of
    them, a string content as one text part, each part's own keys kept; "openai" gives any template the list, "string"
    the text. A tool message's content stays text, as vLLM gives it."""
    messages = [ChatMessageParam(role="user", content="Hi"),
                ChatMessageParam(role="user", content=["a", {"type": "input_text", "text": "b", "cache_control": {}}])]
    assert tokenizer.decode(apply_chat_template(tokenizer, messages, PARTS_TEMPLATE, add_generation_prompt=False)) == \
        "[user] <text:Hi>\n[user] <text:a> <text:b>\n"
    as_json = "{% for m in messages %}{{ m.content | tojson }}\n{% endfor %}"
    messages.append(ChatMessageParam(role="tool", content=[{"type": "text", "text": "sunny"}]))
    rendered = {content_format: tokenizer.decode(apply_chat_template(tokenizer, messages, as_json,
                                                                     content_format=content_format))
                for content_format in ("auto", "string", "openai")}
    assert rendered["auto"] == rendered["string"] == '"Hi"\n"a\\nb"\n"sunny"\n'
    assert rendered["openai"] == '[{"type": "text", "text": "Hi"}]\n[{"type": "text", "text": "a"}, {"type": "text", ' \
                                 '"text": "b", "cache_control": {}}]\n"sunny"\n'


def test_chat_template_content_format_flag_and_llm_chat_argument(tokenizer):
    """The server's --chat-template-content-format (/tokenize's messages render as chat's), and LLM.chat's
    chat_template_content_format, vLLM's, which a value it has not refuses."""
    import argparse

    from pagedllm.entrypoints.llm import LLM
    from pagedllm.entrypoints.openai.cli_args import make_arg_parser

    as_json = "{{ messages[0].content | tojson }}"
    hi = [{"role": "user", "content": "Hi"}]
    args = make_arg_parser(argparse.ArgumentParser()).parse_args(["--chat-template-content-format", "openai"])
    serving = OpenAIServingTokenization(tokenizer, OpenAIServingModels(["m"], "m", 1024), as_json, None,
                                        args.chat_template_content_format)
    tokens = serving.create_tokenize(TokenizeChatRequest.model_validate({"messages": hi})).tokens
    assert tokenizer.decode(tokens) == '[{"type": "text", "text": "Hi"}]'

    class RenderingLLM:  # LLM.chat without an engine: generate() returns the rendered prompts
        chat, _chat, chat_template = LLM.chat, LLM._chat, None

        def get_tokenizer(self):
            return tokenizer

        def generate(self, prompts, *args, **kwargs):
            return [p["prompt"] for p in prompts]

    llm = RenderingLLM()
    assert llm.chat(hi, chat_template=PARTS_TEMPLATE) == ["[user] <text:Hi>\n"]
    assert llm.chat(hi, chat_template=as_json, chat_template_content_format="openai") == \
        ['[{"type": "text", "text": "Hi"}]']
    with pytest.raises(ValueError, match="chat_template_content_format"):
        llm.chat(hi, chat_template=as_json, chat_template_content_format="list")


def test_llm_chat_and_enqueue_chat_take_the_same_arguments_and_hand_them_on_alike(tokenizer):
    """vLLM's LLM.chat and enqueue_chat take the same arguments (names, order, defaults): both come to LLM._chat,
    whose parameters are these, so that one cannot gain or read a keyword the other lacks. Given the same ones,
    both render the same prompts and hand them on with the same request arguments; the progress bar is chat()'s of
    the requests running (generate's), enqueue_chat()'s of the conversations rendering (enqueue's shows none)."""
    import inspect

    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    chat, enqueue_chat = (list(inspect.signature(method).parameters.values())
                          for method in (LLM.chat, LLM.enqueue_chat))
    assert chat == enqueue_chat
    assert [p.name for p in inspect.signature(LLM._chat).parameters.values()] == [p.name for p in chat] + ["enqueue"]

    class QueueingLLM:  # LLM.chat and enqueue_chat without an engine: the calls they hand the prompts on with
        chat, enqueue_chat, _chat, chat_template = LLM.chat, LLM.enqueue_chat, LLM._chat, None
        calls: list[tuple] = []

        def get_tokenizer(self):
            return tokenizer

        def generate(self, prompts, sampling_params, *, use_tqdm, priority, lora_request, mm_processor_kwargs):
            self.calls.append((prompts, sampling_params, lora_request, priority, mm_processor_kwargs, use_tqdm))

        def enqueue(self, prompts, sampling_params, lora_request, priority, *, use_tqdm, mm_processor_kwargs):
            self.calls.append((prompts, sampling_params, lora_request, priority, mm_processor_kwargs, use_tqdm))

    bars: list[str] = []

    def progress(items, desc, total, dynamic_ncols):
        bars.append(desc)
        return items

    llm, params = QueueingLLM(), SamplingParams(max_tokens=1)
    arguments = dict(sampling_params=params, use_tqdm=progress, lora_request=None, priority=[3, 4],
                     chat_template=TEMPLATE, add_generation_prompt=False, continue_final_message=True,
                     chat_template_kwargs={"x": 1}, tokenization_kwargs={"max_length": 4, "truncation": True},
                     mm_processor_kwargs={})
    conversations = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Hello there, friend"}]]
    llm.chat(conversations, **arguments)
    assert bars == []
    llm.enqueue_chat(conversations, **arguments)
    assert bars == ["Rendering conversations"]
    (*chatted, chat_bar), (*enqueued, enqueue_bar) = llm.calls
    assert chatted == enqueued and (chat_bar, enqueue_bar) == (progress, False)
    assert [p["prompt"] for p in chatted[0]] == ["[user] Hi", "[user] Hello there, friend"]  # the last left open
    assert [len(p["prompt_token_ids"]) for p in chatted[0]] == [4, 4]


@pytest.mark.parametrize("exclude, tool_choice, rendered_tools", [
    (False, "none", True), (True, "none", False), (True, None, True), (True, "required", True)])
def test_exclude_tools_when_tool_choice_none(tokenizer, monkeypatch, exclude, tool_choice, rendered_tools):
    """vLLM's --exclude-tools-when-tool-choice-none: a chat request with tool_choice "none" is rendered without its
    tools; without the flag, or with another tool_choice, the template gets them."""
    from types import SimpleNamespace

    from pagedllm.entrypoints.openai import chat_utils, serving_chat

    class Rendered(Exception):
        pass

    def render(*args, **kwargs):
        raise Rendered(chat_utils.render_chat_request(*args, **kwargs))

    monkeypatch.setattr(serving_chat, "render_chat_request", render)
    engine = SimpleNamespace(tokenizer=tokenizer, model_config=SimpleNamespace(
        max_model_len=1024, get_diff_sampling_param=dict, generation_config="auto"))
    chat = serving_chat.OpenAIServingChat(engine, OpenAIServingModels(["m"], "m", 1024),
                                          "{% for t in tools or [] %}[tool] {{ t.function.name }}\n{% endfor %}" +
                                          TEMPLATE, "hermes", exclude_tools_when_tool_choice_none=exclude)
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], tool_choice=tool_choice,
                                    tools=[{"type": "function", "function": {"name": "f"}}])
    with pytest.raises(Rendered) as rendered:
        asyncio.run(chat.create_chat_completion(request))
    assert str(rendered.value) == ("[tool] f\n" if rendered_tools else "") + "[user] Hi\n"
