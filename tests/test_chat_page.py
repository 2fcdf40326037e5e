"""The chat page at `/` in a real browser: Debian's headless Chromium driven by Playwright.

A real server runs on a free loopback port in a thread, with an API key, on the bundled model.
"""

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

    from tierflow.cli.server import ServerSettings, create_app

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


def last_answer(page) -> str:
    return page.locator(".assistant").last.text_content()


def server_answer(url: str, messages: list[dict], **sampling) -> str:
    response = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, **sampling},
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


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
    messages = [{"role": "user", "content": question}]
    assert final == server_answer(server_url, messages, temperature=0, max_tokens=48)


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
