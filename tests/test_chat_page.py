"""The chat page at `/` in a real browser: Debian's headless Chromium driven by Playwright.

A real server runs on a free loopback port in a thread, with an API key, on the bundled model.
"""

import re
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
API_KEY = "page-test-key"
ANSWER_TIMEOUT_MS = 60_000

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM.exists(),
                       reason="needs Debian's chromium at /usr/bin/chromium (.ci/run installs it)"),
]

# Records every text the newest assistant message shows, so a test can see the answer grow.
RECORD_ANSWER_TEXTS = """() => {
  window.answerTexts = [];
  new MutationObserver(() => {
    const answers = document.querySelectorAll(".assistant");
    if (answers.length) window.answerTexts.push(answers[answers.length - 1].textContent);
  }).observe(document.getElementById("messages"), {childList: true, subtree: true, characterData: true});
}"""


@pytest.fixture(scope="module")
def server_url(engine):
    import uvicorn

    from tierflow.server.routes import ServerSettings, create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    settings = ServerSettings(host="127.0.0.1", port=port, api_key=API_KEY)
    server = uvicorn.Server(uvicorn.Config(create_app(engine, settings), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "the server did not start"
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=30)
    sock.close()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context()
    yield context.new_page()
    context.close()


def open_chat(page, url: str, query: str = "", api_key: str | None = API_KEY):
    page.goto(f"{url}/?{query}")
    if api_key is not None:
        page.fill("#api-key", api_key)
        page.locator("#api-key").dispatch_event("change")


def wait_until_answered(page):
    from playwright.sync_api import expect

    expect(page.locator("#send")).to_be_visible(timeout=ANSWER_TIMEOUT_MS)


def ask(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    wait_until_answered(page)


def last_answer(page) -> str:
    return page.locator(".assistant").last.text_content()


def server_reply(url: str, messages: list[dict], **sampling) -> dict:
    response = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, **sampling},
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    response.raise_for_status()
    return response.json()


def server_answer(url: str, messages: list[dict], **sampling) -> str:
    return server_reply(url, messages, **sampling)["choices"][0]["message"]["content"]


def rendered_html(page, markdown: str) -> str:
    """The HTML the page's own markdown renderer makes of `markdown`."""
    return page.evaluate("""(markdown) => {
      const box = document.createElement("div");
      box.append(renderMarkdown(markdown));
      return box.innerHTML;
    }""", markdown)


def saved_conversation(page) -> list[dict]:
    return page.evaluate("JSON.parse(localStorage.getItem('tierflow.conversation'))")


def save_conversation(page, conversation: list[dict]) -> None:
    page.evaluate("(saved) => localStorage.setItem('tierflow.conversation', JSON.stringify(saved))",
                  conversation)


def chat_request(request) -> bool:
    return request.url.endswith("/v1/chat/completions")


def test_page_streams_the_answer_the_server_gives(page, server_url):
    question = "What is the capital of France?"
    open_chat(page, server_url, "temperature=0&max_tokens=48")
    page.evaluate(RECORD_ANSWER_TEXTS)
    page.fill("#prompt", question)
    page.press("#prompt", "Enter")
    wait_until_answered(page)
    final = last_answer(page)
    partials = {text for text in page.evaluate("window.answerTexts") if text and text != final}
    assert len(partials) >= 2, "the answer appeared at once instead of streaming"
    answer = server_answer(server_url, [{"role": "user", "content": question}], temperature=0, max_tokens=48)
    assert saved_conversation(page)[-1]["content"] == answer
    assert page.locator(".assistant").last.inner_html() == rendered_html(page, answer)


def test_stop_button_ends_the_answer_and_the_page_stays_usable(page, server_url):
    open_chat(page, server_url, "max_tokens=900&seed=1")
    page.fill("#prompt", "Write a very long story about a dragon and a knight.")
    page.click("#send")
    page.wait_for_function("document.querySelector('.assistant').textContent.length > 20",
                           timeout=ANSWER_TIMEOUT_MS)
    page.click("#stop")
    wait_until_answered(page)
    stopped = last_answer(page)
    time.sleep(0.5)
    assert last_answer(page) == stopped, "the answer kept growing after Stop"
    assert page.locator(".note").text_content() == "stopped"

    page.evaluate("history.replaceState(null, '', '?max_tokens=16')")  # a short second answer
    page.fill("#prompt", "Say hello.")
    page.click("#send")
    wait_until_answered(page)
    assert page.locator(".assistant").count() == 2
    assert last_answer(page) and not page.locator(".error").count()


def test_page_shows_the_server_error_message(page, server_url):
    open_chat(page, server_url, api_key=None)
    page.fill("#prompt", "Hello")
    page.click("#send")
    wait_until_answered(page)
    expected = httpx.post(f"{server_url}/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "Hello"}]}).json()
    assert page.locator(".assistant.error").text_content() == expected["error"]["message"]


def test_page_remembers_the_api_key_and_sends_it(page, server_url):
    open_chat(page, server_url, "max_tokens=8")
    page.reload()
    assert page.input_value("#api-key") == API_KEY
    page.fill("#prompt", "Hello")
    page.click("#send")
    wait_until_answered(page)
    assert last_answer(page) and not page.locator(".error").count()


# -- markdown ---------------------------------------------------------------------------------

LINK = 'rel="noopener noreferrer" target="_blank"'
MARKDOWN_CASES = {
    "paragraphs": ("one line\nthe next line\n\nanother paragraph",
                   "<p>one line<br>the next line</p><p>another paragraph</p>"),
    "emphasis": ("**bold**, *italic*, _also_, ~~gone~~ and a snake_case_name",
                 "<p><strong>bold</strong>, <em>italic</em>, <em>also</em>, <del>gone</del> and a "
                 "snake_case_name</p>"),
    "inline-code": ("use `x < y` and `**`", "<p>use <code>x &lt; y</code> and <code>**</code></p>"),
    "fenced-code": ("```python\nif a < b:\n    print('<b>')\n```\nafter",
                    "<pre><code>if a &lt; b:\n    print('&lt;b&gt;')</code></pre><p>after</p>"),
    "unclosed-fence": ("```\nstill streaming", "<pre><code>still streaming</code></pre>"),
    "lists": ("Steps:\n- one\n- two\n  1. nested\n  2. more",
              "<p>Steps:</p><ul><li><p>one</p></li><li><p>two</p><ol><li><p>nested</p></li>"
              "<li><p>more</p></li></ol></li></ul>"),
    "numbered-list": ("3. three\n4. four", '<ol start="3"><li><p>three</p></li><li><p>four</p></li></ol>'),
    "heading-and-quote": ("## Title\n> quoted", "<h2>Title</h2><blockquote><p>quoted</p></blockquote>"),
    "link": ("[site](https://example.com/a?b=1)",
             f'<p><a href="https://example.com/a?b=1" {LINK}>site</a></p>'),
    "bare-url": ("see https://example.com/x.", f'<p>see <a href="https://example.com/x" {LINK}>'
                 "https://example.com/x</a>.</p>"),
    "image-as-link": ("![chart](https://example.com/c.png)",
                      f'<p><a href="https://example.com/c.png" {LINK}>chart</a></p>'),
}


@pytest.mark.parametrize("markdown, html", MARKDOWN_CASES.values(), ids=MARKDOWN_CASES.keys())
def test_renderer_builds_markdown_elements(page, server_url, markdown, html):
    open_chat(page, server_url)
    assert rendered_html(page, markdown) == html


# Each case: the model's text, and the part of it the page must show as text.
HOSTILE_CASES = {
    "img-onerror": ('<img src=x onerror="window.injected=1">', '<img src=x onerror="window.injected=1">'),
    "script": ("<script>window.injected = 1</script>", "<script>window.injected = 1</script>"),
    "svg-in-bold": ("**<svg onload=window.injected=1>**", "<svg onload=window.injected=1>"),
    "code-fence-breakout": ("```\n</code></pre><img src=x onerror=window.injected=1>\n```",
                            "</code></pre><img src=x onerror=window.injected=1>"),
    "html-link": ('<a href="javascript:window.injected=1">go</a>', '<a href="javascript:window.injected=1">'),
    "javascript-link": ("[go](javascript:window.injected=1)", "[go](javascript:window.injected=1)"),
    "mixed-case-scheme": ("[go](JaVaScRiPt:window.injected=1)", "[go](JaVaScRiPt:window.injected=1)"),
    "data-link": ("[go](data:text/html,<script>window.injected=1</script>)", "[go](data:text/html,"),
    "relative-link": ("[go](/v1/models)", "[go](/v1/models)"),
    "quote-in-url": ('[go](https://example.com/"onclick="window.injected=1)', "go"),
}
MARKDOWN_TAGS = {"p", "br", "strong", "em", "del", "code", "pre", "ul", "ol", "li", "blockquote", "hr", "a",
                 "h1", "h2", "h3", "h4", "h5", "h6"}
ELEMENTS_OF = """(markdown) => {
  const box = document.createElement("div");
  box.append(renderMarkdown(markdown));
  document.getElementById("messages").append(box);  // in the live page, where handlers would run
  const elements = [...box.querySelectorAll("*")].map((el) => ({
    tag: el.localName, attributes: el.getAttributeNames(), href: el.getAttribute("href") }));
  return { text: box.textContent, elements, injected: window.injected };
}"""


@pytest.mark.parametrize("markdown, shown", HOSTILE_CASES.values(), ids=HOSTILE_CASES.keys())
def test_renderer_shows_model_markup_as_text(page, server_url, markdown, shown):
    open_chat(page, server_url)
    result = page.evaluate(ELEMENTS_OF, markdown)
    assert shown in result["text"]
    for element in result["elements"]:
        assert element["tag"] in MARKDOWN_TAGS, element
        assert set(element["attributes"]) <= {"href", "rel", "target", "start"}, element
        assert element["href"] is None or re.match(r"https?://", element["href"]), element
    assert result["injected"] is None


def test_saved_answer_with_markup_shows_as_text(page, server_url):
    open_chat(page, server_url)
    markup = '<img src=x onerror="window.injected=1"><script>window.injected=1</script>'
    save_conversation(page, [{"role": "user", "content": markup}, {"role": "assistant", "content": markup}])
    page.reload()
    assert page.locator("#messages img, #messages script").count() == 0
    assert page.locator(".user").text_content() == markup
    assert page.locator(".assistant").text_content() == markup


# -- settings, speed, memory --------------------------------------------------------------------

SETTINGS = {"#system-prompt": "Answer in French.", "#temperature": "0.5", "#max-tokens": "6"}


def fill_settings(page) -> None:
    page.click("#settings-toggle")
    for selector, value in SETTINGS.items():
        page.fill(selector, value)


def test_settings_are_sent_with_the_request(page, server_url):
    open_chat(page, server_url)
    fill_settings(page)
    with page.expect_request(chat_request) as sent:
        ask(page, "Hello")
    body = sent.value.post_data_json
    assert body["messages"] == [{"role": "system", "content": "Answer in French."},
                                {"role": "user", "content": "Hello"}]
    assert (body["temperature"], body["max_tokens"]) == (0.5, 6)
    assert not page.locator(".error").count()


def test_settings_survive_a_reload(page, server_url):
    open_chat(page, server_url)
    fill_settings(page)
    page.reload()
    assert {selector: page.input_value(selector) for selector in SETTINGS} == SETTINGS


STATS = r"(\d+) tokens · ([\d.]+) tokens/s · first token after [\d.]+ s( · cut at max tokens)?"


def test_answer_shows_its_token_count_and_speed(page, server_url):
    question = "Name three colours."
    open_chat(page, server_url, "temperature=0&max_tokens=24")
    ask(page, question)
    stats = page.locator(".stats").text_content()
    match = re.fullmatch(STATS, stats)
    assert match, stats
    reply = server_reply(server_url, [{"role": "user", "content": question}], temperature=0, max_tokens=24)
    assert int(match[1]) == reply["usage"]["completion_tokens"]
    assert float(match[2]) > 0


def test_conversation_survives_a_reload_and_continues(page, server_url):
    open_chat(page, server_url, "temperature=0&max_tokens=12")
    ask(page, "Hello")
    shown, saved = page.inner_html("#messages"), saved_conversation(page)
    page.reload()
    assert page.inner_html("#messages") == shown
    with page.expect_request(chat_request) as sent:
        ask(page, "And again?")
    assert sent.value.post_data_json["messages"] == [
        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": saved[1]["content"]},
        {"role": "user", "content": "And again?"}]


def test_new_chat_forgets_the_saved_conversation(page, server_url):
    open_chat(page, server_url)
    save_conversation(page, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}])
    page.reload()
    assert page.locator(".message").count() == 2
    page.click("#new-chat")
    page.reload()
    assert page.locator(".message").count() == 0


@pytest.mark.parametrize("saved", ["{not json", '{"role": "user", "content": "a"}', "[null]",
                                   '[{"role": "system", "content": "a"}]',
                                   '[{"role": "user", "content": 5}]'])
def test_unreadable_saved_conversation_starts_an_empty_chat(page, server_url, saved):
    errors = []
    page.on("pageerror", lambda error: errors.append(error))
    open_chat(page, server_url)
    page.evaluate("(saved) => localStorage.setItem('tierflow.conversation', saved)", saved)
    page.reload()
    assert page.locator(".message").count() == 0
    assert not errors


# -- layout -------------------------------------------------------------------------------------

LONG_ANSWER = """## A long answer

Some text with a very long word: Donaudampfschifffahrtsgesellschaftskapitänswitwenrentenversicherung.

- a list item with `inline code` and https://example.com/a/very/long/path/that/does/not/wrap/easily/at/all
- another item

```python
print("a code line much longer than a phone is wide, which must scroll inside its block, not the page")
```
"""
LONG_ANSWER_STATS = "75 tokens · 21.4 tokens/s · first token after 0.38 s"
REACHABLE = ["#api-key", "#settings-toggle", "#new-chat", "#system-prompt", "#temperature", "#max-tokens",
             "#prompt", "#send"]


@pytest.mark.parametrize("width, height", [(390, 844), (1280, 800)])
def test_layout_fits_the_width_with_every_control_in_reach(page, server_url, tmp_path, width, height):
    page.set_viewport_size({"width": width, "height": height})
    open_chat(page, server_url)
    save_conversation(page, [{"role": "user", "content": "Tell me something long."},
                             {"role": "assistant", "content": LONG_ANSWER, "stats": LONG_ANSWER_STATS}] * 2)
    page.reload()
    page.click("#settings-toggle")
    page.screenshot(path=tmp_path / f"chat-{width}.png")  # to look at: the test cannot judge looks
    assert page.evaluate("document.documentElement.scrollWidth") <= width, "the page scrolls sideways"
    for selector in REACHABLE:
        box = page.locator(selector).bounding_box()
        assert box["x"] >= 0 and box["x"] + box["width"] <= width, selector
        assert box["y"] >= 0 and box["y"] + box["height"] <= height, selector


def test_the_model_picker_lists_the_served_models_and_sends_the_chosen_one(page, model_path, f32_model_path):
    from tests.support.live_server import serve_command

    with serve_command("-m", f"q41={model_path}", "-m", f"f32={f32_model_path}", "--ctx", "256",
                       "--threads", "1") as base:
        open_chat(page, base, "max_tokens=4", api_key=None)
        picker = page.locator("#model")
        page.wait_for_function("document.querySelectorAll('#model option').length == 2")
        assert picker.evaluate("select => [...select.options].map(option => option.value)") == ["q41", "f32"]
        picker.select_option("f32")
        with page.expect_request(chat_request) as sent:
            ask(page, "Hello")
        assert sent.value.post_data_json["model"] == "f32"
        assert not page.locator(".error").count()


def test_one_served_model_shows_its_name_in_a_picker_that_cannot_change(page, server_url, engine):
    open_chat(page, server_url)
    page.wait_for_function("document.querySelectorAll('#model option').length == 1")
    assert page.locator("#model").input_value() == engine.path.stem and page.locator("#model").is_disabled()
