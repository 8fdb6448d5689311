"""The chat page (`/`) in a real headless Chromium against a real server on a loopback port.

Each test drives the page as a user does (typing, clicking) and checks both what the page shows
and what the server saw: the request's fields, its token counts, and that a stopped reply left
nothing running in the engine.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.server.web.pages import CHAT_PAGE_CSP

from support.server import SERVED, make_engine, metric_value, pace, serve, wait_idle

pytestmark = [pytest.mark.browser, pytest.mark.slow]

API_KEY = "sekret-test-key"
Page = Any  # playwright.sync_api.Page (the package is imported only where a browser exists)


@pytest.fixture
def url(server: tuple[str, FastAPI]) -> Iterator[str]:
    """The base URL; after each test the engine must hold nothing and the KV pool be free."""
    yield server[0]
    wait_idle(server[1])


@pytest.fixture(scope="module")
def keyed_engine(demo_dir: Path) -> LLMEngine:
    return make_engine(demo_dir, max_num_seqs=1)


@pytest.fixture(scope="module")
def keyed_server(keyed_engine: LLMEngine) -> Iterator[tuple[str, FastAPI]]:
    """A server with an API key that runs one sequence at a time and queues at most one more."""
    with serve(keyed_engine, api_key=API_KEY, max_queued_requests=1) as served:
        yield served


def open_chat(page: Page, url: str) -> None:
    page.goto(f"{url}/")
    page.get_by_test_id("model").filter(has_text=SERVED).wait_for()


def set_settings(page: Page, **fields: str) -> None:
    """Fills the settings panel: system_prompt, temperature, top_p, max_tokens, seed."""
    if page.get_by_test_id("settings").is_hidden():
        page.get_by_test_id("settings-toggle").click()
    for name, value in fields.items():
        page.get_by_test_id(name.replace("_", "-")).fill(value)


def send(page: Page, text: str) -> None:
    page.get_by_test_id("input").fill(text)
    page.get_by_test_id("input").press("Enter")


def last_reply(page: Page) -> Any:
    return page.locator('[data-testid="message"][data-role="assistant"]').last


def wait_reply(page: Page, state: str = "done") -> Any:
    reply = last_reply(page)
    page.locator(f'[data-testid="message"][data-role="assistant"][data-state="{state}"]').last.wait_for()
    return reply


def stored_conversations(page: Page) -> list[dict[str, Any]]:
    return json.loads(page.evaluate("localStorage.getItem('nanoserve.chat.conversations')"))


def aborted(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    try:
        return metric_value(text, 'nanoserve:request_finished_total{finished_reason="abort"}')
    except AssertionError:
        return 0.0


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_static_files_are_served_with_their_types_and_nothing_else(url: str) -> None:
    page = httpx.get(f"{url}/")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.headers["content-security-policy"] == CHAT_PAGE_CSP
    assert 'src="/static/chat.js"' in page.text
    for name, kind in [("chat.js", "text/javascript"), ("markdown.js", "text/javascript"), ("chat.css", "text/css")]:
        r = httpx.get(f"{url}/static/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind), name
        assert r.headers["x-content-type-options"] == "nosniff"
    for bad in ["nope.js", "..%2Fpages.py", "..%2F..%2Fapp.py", "%2Fetc%2Fpasswd", "../pages.py", "chat.html%00.js"]:
        r = httpx.get(f"{url}/static/{bad}")
        assert r.status_code == 404, bad
        assert r.json()["error"]["type"] == "invalid_request_error", bad


def test_the_page_loads_shows_the_model_and_streams_a_reply(browser_page: Page, url: str, engine: LLMEngine,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    page = browser_page
    pace(engine, monkeypatch, 0.03)
    open_chat(page, url)
    set_settings(page, temperature="0", max_tokens="24")
    # Record the reply's visible length at every change of the message list.
    page.evaluate("""() => {
        window.lengths = [];
        new MutationObserver(() => {
            const el = document.querySelector('[data-role="assistant"] [data-testid="content"]');
            if (el) window.lengths.push(el.textContent.length);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
    }""")
    send(page, "Tell me about the sea.")
    page.locator('[data-role="assistant"][data-state="streaming"]').wait_for()
    reply = wait_reply(page)
    lengths = page.evaluate("window.lengths")
    growing = sorted(set(n for n in lengths if n > 0))
    assert len(growing) >= 3, f"the reply did not stream: {lengths}"
    # The page shows and keeps exactly what the API answers to the same (greedy) request.
    expected = httpx.post(f"{url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Tell me about the sea."}], "temperature": 0, "max_tokens": 24,
    }).json()
    tokens = expected["usage"]["completion_tokens"]
    stats = reply.get_by_test_id("stats")
    assert stats.get_attribute("data-completion-tokens") == str(tokens)
    assert f"{tokens} tokens" in stats.inner_text() and "tok/s" in stats.inner_text() and "TTFT" in stats.inner_text()
    [conv] = stored_conversations(page)
    assert conv["title"] == "Tell me about the sea."
    assert [m["role"] for m in conv["messages"]] == ["user", "assistant"]
    assert conv["messages"][1]["content"] == expected["choices"][0]["message"]["content"]
    assert stats.get_attribute("data-prompt-tokens") == str(expected["usage"]["prompt_tokens"])


def test_stop_ends_the_reply_and_the_server_aborts_the_request(browser_page: Page, url: str,
                                                               server: tuple[str, FastAPI], engine: LLMEngine,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    page = browser_page
    pace(engine, monkeypatch, 0.1)
    open_chat(page, url)
    set_settings(page, max_tokens="90")
    before = aborted(url)
    send(page, "Write a long story.")
    page.locator('[data-role="assistant"][data-state="streaming"] [data-testid="content"]:not(:empty)').wait_for()
    assert page.get_by_test_id("send").is_hidden()
    page.get_by_test_id("stop").click()
    reply = wait_reply(page, "stopped")
    assert page.get_by_test_id("stop").is_hidden() and page.get_by_test_id("send").is_visible()
    assert "stopped" in reply.get_by_test_id("stats").inner_text()
    wait_idle(server[1], timeout=5)
    assert aborted(url) == before + 1
    kept = stored_conversations(page)[0]["messages"][1]
    assert kept["stopped"] and kept["content"] and kept["stats"]["usage"] is None
    shown = reply.get_by_test_id("content").inner_text()
    page.wait_for_timeout(300)
    assert reply.get_by_test_id("content").inner_text() == shown  # nothing arrives after the stop


def test_settings_reach_the_request_and_regenerate_repeats_a_seeded_reply(browser_page: Page, url: str) -> None:
    page = browser_page
    open_chat(page, url)
    set_settings(page, system_prompt="You are terse.", temperature="0.9", top_p="0.8", max_tokens="5", seed="7")
    with page.expect_request("**/v1/chat/completions") as request:
        send(page, "Hello!")
    body = request.value.post_data_json
    assert body["messages"] == [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello!"}]
    assert (body["temperature"], body["top_p"], body["max_tokens"], body["seed"]) == (0.9, 0.8, 5, 7)
    assert body["model"] == SERVED and body["stream"] is True and body["stream_options"] == {"include_usage": True}
    reply = wait_reply(page)
    assert reply.get_by_test_id("stats").get_attribute("data-completion-tokens") == "5"
    prompt = httpx.post(f"{url}/tokenize", json={"messages": body["messages"]}).json()["count"]
    assert reply.get_by_test_id("stats").get_attribute("data-prompt-tokens") == str(prompt)
    first = stored_conversations(page)[0]["messages"][1]["content"]

    with page.expect_request("**/v1/chat/completions") as request:
        reply.get_by_test_id("regenerate").click()
    assert request.value.post_data_json["messages"] == body["messages"]  # the old reply is not sent back
    wait_reply(page)
    messages = stored_conversations(page)[0]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[1]["content"] == first and first  # same seed, same sampled reply
    assert page.get_by_test_id("message").count() == 2


def test_server_errors_are_shown_with_their_message(browser_page: Page, url: str) -> None:
    page = browser_page
    open_chat(page, url)
    set_settings(page, max_tokens="100000")
    send(page, "Hi")
    reply = wait_reply(page, "error")
    expected = httpx.post(f"{url}/v1/chat/completions", json={
        "model": SERVED, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 100000, "stream": True,
    })
    assert expected.status_code == 400
    shown = reply.get_by_test_id("message-error").inner_text()
    assert shown == f"{expected.json()['error']['message']} [HTTP 400]"
    assert "context" in shown or "max_model_len" in shown, shown
    # The user can fix the setting and try again: the failed reply is not sent back as history.
    set_settings(page, max_tokens="3")
    with page.expect_request("**/v1/chat/completions") as request:
        reply.get_by_test_id("regenerate").click()
    assert request.value.post_data_json["messages"] == [{"role": "user", "content": "Hi"}]
    wait_reply(page)


def test_the_api_key_is_asked_for_kept_and_sent(browser_page: Page, keyed_server: tuple[str, FastAPI]) -> None:
    page, url = browser_page, keyed_server[0]
    page.goto(f"{url}/")
    dialog = page.get_by_test_id("key-dialog")
    dialog.wait_for()
    page.get_by_test_id("key-input").fill("wrong")
    page.get_by_test_id("key-save").click()
    page.locator("#key-reason", has_text="invalid or missing API key").wait_for()
    assert dialog.is_visible()  # asked again
    page.get_by_test_id("key-input").fill(API_KEY)
    page.get_by_test_id("key-save").click()
    page.get_by_test_id("model").filter(has_text=SERVED).wait_for()
    assert dialog.is_hidden()
    assert page.evaluate("localStorage.getItem('nanoserve.apiKey')") == API_KEY
    set_settings(page, max_tokens="3")
    with page.expect_request("**/v1/chat/completions") as request:
        send(page, "Hi")
    assert request.value.headers["authorization"] == f"Bearer {API_KEY}"
    wait_reply(page)
    page.reload()  # the key is remembered
    page.get_by_test_id("model").filter(has_text=SERVED).wait_for()
    assert dialog.is_hidden()
    wait_idle(keyed_server[1])


def test_a_full_queue_is_shown_with_retry_after(browser_page: Page, keyed_server: tuple[str, FastAPI],
                                                keyed_engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    page, url = browser_page, keyed_server[0]
    page.add_init_script(f"localStorage.setItem('nanoserve.apiKey', {json.dumps(API_KEY)})")
    pace(keyed_engine, monkeypatch, 0.05)
    open_chat(page, url)
    busy = {"messages": [{"role": "user", "content": "Go on"}], "max_tokens": 60, "stream": True}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}) as client, ExitStack() as held:
        for _ in range(2):  # one running (max_num_seqs=1), then one waiting (max_queued_requests=1)
            r = held.enter_context(client.stream("POST", "/v1/chat/completions", json=busy))
            assert r.status_code == 200
            wait_for(lambda: keyed_server[1].state.engine.snapshot.num_running == 1)
        send(page, "Hi")
        shown = wait_reply(page, "error").get_by_test_id("message-error").inner_text()
    assert "overloaded" in shown and "(retry after 1 s) [HTTP 429]" in shown, shown
    wait_idle(keyed_server[1])


MALICIOUS = """# Title <img src=x onerror="window.pwned=1">

Some **bold**, _em_, `<script>window.pwned=1</script>` and [a link](https://example.com/a_b_c).
[bad](javascript:window.pwned=1) <a href="javascript:window.pwned=1">raw</a>

- one
- two <b>not bold</b>

```python
def f(x):  # comment
    return "<script>"
```
"""


def test_markdown_is_rendered_and_html_in_model_output_is_escaped(browser_page: Page, url: str) -> None:
    page = browser_page
    convs = [
        {"id": "a", "title": "first", "updated": 2, "messages": [
            {"role": "user", "content": "<b>hi</b>"},
            {"role": "assistant", "content": "<think>I should be <i>careful</i>.</think>" + MALICIOUS}]},
        {"id": "b", "title": "second", "updated": 1, "messages": [
            {"role": "user", "content": "x"}, {"role": "assistant", "content": "plain"}]},
    ]
    page.add_init_script(f"""if (!sessionStorage.getItem('seeded')) {{
        sessionStorage.setItem('seeded', '1');
        localStorage.setItem('nanoserve.chat.conversations', {json.dumps(json.dumps(convs))});
        localStorage.setItem('nanoserve.chat.current', '"a"');
    }}""")
    open_chat(page, url)
    content = last_reply(page).get_by_test_id("content")
    assert content.locator("h1").inner_text() == 'Title <img src=x onerror="window.pwned=1">'
    assert content.locator("strong").inner_text() == "bold" and content.locator("em").inner_text() == "em"
    assert content.locator("p code").inner_text() == "<script>window.pwned=1</script>"
    links = content.locator("a")
    assert links.count() == 1 and links.get_attribute("href") == "https://example.com/a_b_c"
    assert content.locator("li").all_inner_texts() == ["one", "two <b>not bold</b>"]
    code = content.locator("pre code.lang-python")
    assert code.inner_text() == 'def f(x):  # comment\n    return "<script>"'
    assert code.locator(".tok-kw").all_inner_texts() == ["def", "return"]
    assert code.locator(".tok-com").inner_text() == "# comment"
    assert page.locator("#messages img, #messages script, #messages b, #messages i").count() == 0
    assert page.evaluate("window.pwned") is None
    assert page.locator('[data-role="user"] [data-testid="content"]').inner_text() == "<b>hi</b>"
    reasoning = last_reply(page).get_by_test_id("reasoning")
    assert reasoning.get_attribute("open") is None  # folded
    assert reasoning.locator(".reasoning-body").text_content() == "I should be <i>careful</i>."

    # Conversations: switch, delete, and the choice survives a reload.
    items = page.get_by_test_id("conversation")
    assert items.locator(".open").all_inner_texts() == ["first", "second"]
    items.filter(has_text="second").locator(".open").click()
    assert last_reply(page).get_by_test_id("content").inner_text() == "plain"
    first = items.filter(has_text="first")
    first.hover()  # the delete button shows on hover
    first.get_by_test_id("delete-conversation").click()
    assert [c["id"] for c in stored_conversations(page)] == ["b"]
    page.reload()
    assert page.get_by_test_id("conversation").count() == 1
    assert last_reply(page).get_by_test_id("content").inner_text() == "plain"
    page.get_by_test_id("new-chat").click()
    assert page.get_by_test_id("conversation").count() == 2
    assert page.get_by_test_id("message").count() == 0


def test_reasoning_content_deltas_are_folded_apart_from_the_answer(browser_page: Page, url: str) -> None:
    """A server that streams `reasoning_content` (as reasoning parsers do; the demo model has none):
    the page's SSE reading is fed those bytes through the browser's own request routing."""
    page = browser_page
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"reasoning_content": "First, think"}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"reasoning_content": " hard."}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"content": "The **answer**."}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
              {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 6, "total_tokens": 15}}]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    page.route("**/v1/chat/completions",
               lambda route: route.fulfill(status=200, content_type="text/event-stream", body=body))
    open_chat(page, url)
    send(page, "Why?")
    reply = wait_reply(page)
    reasoning = reply.get_by_test_id("reasoning")
    assert reasoning.get_attribute("open") is None
    assert reasoning.locator(".reasoning-body").text_content() == "First, think hard."
    assert reply.get_by_test_id("content").inner_text() == "The answer."
    assert reply.get_by_test_id("content").locator("strong").inner_text() == "answer"
    assert reply.get_by_test_id("stats").get_attribute("data-completion-tokens") == "6"
    reasoning.locator("summary").click()  # unfolds on demand
    assert reasoning.locator(".reasoning-body").is_visible()
