"""The web page at / in a real headless browser (Debian's chromium driven by Playwright), against the shared server,
which has an API key: the page asks for it, then chats (streamed) and shows the engine at work. /engine/view's
JSON is checked directly too. A screenshot goes to $PAGEDLLM_SCREENSHOT_DIR (default: the test's tmp dir).
"""
from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import API_KEY

MODEL = "smollm2-135m-instruct"
# Over one KV block (16 tokens) that all 8 requests of the engine-view test start with: shared blocks on the map.
SHARED_PREFIX = "You are a storyteller. Tell short, happy stories about animals in a forest, one paragraph each."

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (make install puts it there)")


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


def test_engine_view_json_needs_the_key_and_shows_the_cache(server):
    assert httpx.get(server.url_for("engine", "view")).status_code == 401
    view = httpx.get(server.url_for("engine", "view"), headers=server.headers).json()
    (engine,) = view["engines"]
    assert view["model"] == MODEL
    assert len(engine["block_map"]) > 0 and set(engine["block_map"]) <= set(".cus")
    assert engine["block_size"] == 16 and engine["num_running_reqs"] == 0 and engine["running"] == []


def test_page_chats_and_shows_the_engine_at_work(server, browser, tmp_path):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("response", lambda r: problems.append(f"{r.status} {r.url}") if r.status >= 400 else None)

    page.goto(server.url_for(""))
    page.wait_for_selector("#key-form:not([hidden])")  # the key is asked for before anything else works
    page.fill("#key-input", API_KEY)
    page.click("#key-form button")
    page.wait_for_function("document.getElementById('model-name').textContent !== 'connecting…'")
    assert page.inner_text("#model-name") == MODEL
    # The model has no generation config: the page's defaults, said so.
    assert page.inner_text("#settings-line").startswith("settings: temperature 0.7, top_p 0.9 · defaults: this page's")

    # A chat message gets a streamed answer: the answer's text is seen growing before it finishes.
    page.click("#settings summary")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "48")
    page.evaluate("""() => {
        window.answerLengths = [];
        new MutationObserver(() => {
            const answers = document.querySelectorAll('.message.assistant');
            if (answers.length) window.answerLengths.push(answers[answers.length - 1].textContent.length);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
    }""")
    page.fill("#chat-input", "What is the capital of France?")
    page.press("#chat-input", "Enter")
    page.wait_for_selector(".message.assistant .meta", timeout=60_000)
    answer = page.inner_text(".message.assistant")
    assert "Paris" in answer and "finish: " in answer
    lengths = page.evaluate("window.answerLengths")
    assert len({n for n in lengths if n > 0}) > 3, lengths  # many partial texts, not one whole answer

    # The engine view while 8 requests run: running rows appear and the block map changes as they grow.
    def run_requests():
        with httpx.Client(timeout=120, headers=server.headers) as client:
            threads = [threading.Thread(target=client.post, args=(server.url_for("v1", "completions"),),
                                        kwargs={"json": {"model": MODEL, "prompt": f"{SHARED_PREFIX} Story {i}:",
                                                         "max_tokens": 480, "temperature": 0,
                                                         "ignore_eos": True}}) for i in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    load = threading.Thread(target=run_requests)
    load.start()
    try:
        page.wait_for_selector("#requests tbody tr[data-status=running]", timeout=60_000)
        in_use, shared, steps_per_s, running_rows = [], [], [], []
        deadline = time.monotonic() + 30
        while True:  # the first sample right away, while the row just seen is still on the page
            shared.append(int(page.inner_text("#count-shared")))
            in_use.append(int(page.inner_text("#count-in-use")) + shared[-1])
            steps_per_s.append(float(page.inner_text("#stat-steps").replace("–", "0")))
            running_rows.append(page.locator("#requests tbody tr[data-status=running]").count())
            if time.monotonic() > deadline or len(set(in_use)) >= 3 or not load.is_alive():
                break
            page.wait_for_timeout(700)
        screenshot = Path(os.environ.get("PAGEDLLM_SCREENSHOT_DIR", tmp_path)) / "web_ui.png"
        page.screenshot(path=str(screenshot), full_page=True)
    finally:
        load.join()
    assert max(running_rows) >= 1, running_rows  # sampled while the requests ran: a fast machine ends them early
    assert len(set(in_use)) >= 3 and max(in_use) > 0, in_use  # the map changed while they ran
    assert max(shared) > 0, shared  # the common prefix's blocks, held by several requests at once
    assert max(steps_per_s) > 0, steps_per_s
    assert not problems, problems
    page.close()


def test_new_chat_while_an_answer_streams_starts_empty(server, browser):
    """"New chat" during a streamed answer: the next request carries none of the old conversation (the stopped
    answer used to land in the new one, unseen)."""
    page = browser.new_page()
    page.goto(server.url_for(""))
    page.evaluate(f"localStorage.setItem('pagedllm-api-key', '{API_KEY}')")
    page.reload()
    page.wait_for_function("document.getElementById('model-name').textContent !== 'connecting…'")
    page.click("#settings summary")
    page.fill("#max-tokens", "400")
    page.fill("#chat-input", "Tell me a long story about a cat.")
    page.press("#chat-input", "Enter")
    page.wait_for_function("document.querySelector('.message.assistant')?.textContent.length > 20", timeout=60_000)
    page.click("#clear")
    page.wait_for_function("!document.getElementById('stop') || document.getElementById('stop').disabled")
    with page.expect_request(lambda r: r.url.endswith("v1/chat/completions")) as sent:
        page.fill("#chat-input", "hello")
        page.press("#chat-input", "Enter")
    assert [m["content"] for m in sent.value.post_data_json["messages"] if m["role"] != "system"] == ["hello"]
    page.close()
