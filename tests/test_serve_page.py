"""The chat page at ``/``: served from the package, loading nothing from elsewhere, and working
in a real headless browser (Debian's chromium, driven by selenium: ``tox -e browser``).

The browser test's oracle is :func:`portable_llm.generate` on each conversation alone (greedy):
the answer the page shows is its text, streamed in pieces; a stopped answer is a prefix of it.
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from conftest import skip_reason

if skip_reason("numpy") is not None:  # the server runs the model on NumPy
    pytest.skip(skip_reason("numpy"), allow_module_level=True)
pytest.importorskip("starlette", reason="the serve extra (starlette) is not installed")
pytest.importorskip("uvicorn", reason="the serve extra (uvicorn) is not installed")
httpx = pytest.importorskip("httpx2", reason="the openai client's HTTP library")

import portable_llm as pl  # noqa: E402
from portable_llm.serve import create_app  # noqa: E402
from servers import alone, chat_ids, serving, tiny_model  # noqa: E402

KEY = "page-key"
STEP_DELAY = 0.02  # seconds added to each engine step: answers stream slowly enough to stop


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> pl.Model:
    return tiny_model(tmp_path_factory.mktemp("page"))


def test_page_is_served_and_self_contained(model: pl.Model) -> None:
    """``GET /`` (no key needed) is the package's file, with a CSP that allows this server
    only; the file names no other host and loads no script, style or image by URL."""
    page = resources.files("portable_llm.serve").joinpath("static/chat.html").read_text()
    app = create_app(model, model_name="tiny", api_key=KEY, pool_pages=8)
    with serving(app) as url:
        r = httpx.get(url + "/")
        assert httpx.get(url + "/v1/models").status_code == 401  # the API itself needs the key
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/html; charset=utf-8"
    assert r.text == page
    csp = dict(
        part.strip().split(" ", 1) for part in r.headers["content-security-policy"].split(";")
    )
    assert csp["default-src"] == "'none'" and csp["connect-src"] == "'self'"
    assert csp["script-src"].startswith("'sha256-") and "unsafe" not in csp["script-src"]
    assert r.headers["x-content-type-options"] == "nosniff"
    assert not re.search(r"(?i)\b(https?:)?//[a-z0-9.-]+\.[a-z]", page), "a URL of another host"
    assert not re.search(r"(?i)<(script|img|iframe)[^>]*\bsrc=", page)
    assert not re.search(r"(?i)<link[^>]*\bhref=(?!\"data:)", page)
    assert not re.search(r"(?i)@import|url\(", page)
    # what the server requires of a browser's POST (issue 33's guard): a JSON content type
    assert '"Content-Type"] = "application/json"' in page


def test_the_pages_own_origin_may_post(model: pl.Model) -> None:
    """A browser sends ``Origin`` with the page's same-origin POSTs: the server's own origin
    (scheme and the ``Host`` it was reached by) passes the guard; another port or another name
    of the same machine is another origin, refused (docs/security.md)."""
    app = create_app(model, model_name="tiny", pool_pages=16)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    with serving(app) as url:
        port = int(url.rsplit(":", 1)[1])

        def post(origin: str) -> int:
            r = httpx.post(url + "/v1/chat/completions", json=body, headers={"Origin": origin})
            return r.status_code

        assert post(url) == 200
        assert post(f"http://127.0.0.1:{port + 1}") == 403
        assert post(f"http://localhost:{port}") == 403
        assert post(f"ftp://127.0.0.1:{port}") == 403


# -- in a real browser --------------------------------------------------------------------------

CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--no-first-run", "--window-size=1200,800",
)  # fmt: skip


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    webdriver = pytest.importorskip("selenium.webdriver", reason="the browser extra (selenium)")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        pytest.skip("Debian's chromium and chromium-driver are not installed (apt-get install)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(driver_path))
    try:
        yield driver
    finally:
        driver.quit()


def _recording(app: Any, posts: list[dict[str, str]]) -> Any:
    """``app`` behind an ASGI layer that keeps the headers of every POST."""

    async def wrapped(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            posts.append({k.decode().lower(): v.decode() for k, v in scope["headers"]})
        await app(scope, receive, send)

    return wrapped


def _slowed(app: Any) -> None:
    """Each engine step takes :data:`STEP_DELAY` more: the answers stream token by token."""
    gen = app.state.engine.generator
    step = gen.step

    def slow_step() -> Any:
        time.sleep(STEP_DELAY)
        return step()

    gen.step = slow_step


def _wait(driver: Any, condition: str, timeout: float = 60.0) -> Any:
    """Poll the page's JavaScript expression ``condition`` until it is truthy; its value."""
    deadline = time.monotonic() + timeout
    while True:
        value = driver.execute_script(f"return {condition};")
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {condition}"
        time.sleep(0.02)


def _set(driver: Any, field: str, value: str) -> None:
    element = driver.find_element("id", field)
    element.clear()
    element.send_keys(value)


def _ask(driver: Any, question: str) -> Any:
    """Type ``question`` and press Enter; the new answer's element."""
    before = len(driver.find_elements("css selector", ".msg.assistant"))
    field = driver.find_element("id", "input")
    field.send_keys(question)
    field.send_keys("\n")
    _wait(driver, f"document.querySelectorAll('.msg.assistant').length > {before}")
    return driver.find_elements("css selector", ".msg.assistant")[-1]


def _text(element: Any) -> str:
    return element.find_element("css selector", ".content").get_property("textContent")


@pytest.mark.browser
def test_chat_in_a_browser(model: pl.Model, browser: Any, tmp_path: Path) -> None:
    posts: list[dict[str, str]] = []
    app = create_app(model, model_name="tiny", api_key=KEY, pool_pages=256)
    _slowed(app)
    engine = app.state.engine
    with serving(_recording(app, posts)) as url:
        browser.get(url + "/")
        # the server wants a key: the page shows its field and says so
        _wait(browser, "!document.getElementById('key-field').hidden")
        assert "API key" in browser.find_element("id", "status").text
        _set(browser, "key", KEY)
        browser.find_element("id", "system").click()  # the key field's change event
        _wait(browser, "document.getElementById('model').textContent === 'tiny'")
        _set(browser, "system", "You are terse.")
        _set(browser, "temperature", "0")
        _set(browser, "max_tokens", "24")

        # a question: the answer streams in pieces and is generate's text
        browser.execute_script("""
            window.lengths = [];
            new MutationObserver(() => {
              const all = document.querySelectorAll('.msg.assistant .content');
              if (all.length) window.lengths.push(all[all.length - 1].textContent.length);
            }).observe(document.getElementById('messages'),
                       {childList: true, subtree: true, characterData: true});
        """)
        history = [{"role": "system", "content": "You are terse."},
                   {"role": "user", "content": "What does the cache keep?"}]  # fmt: skip
        first = _ask(browser, history[-1]["content"])
        _wait(browser, "document.querySelector('.msg.assistant:last-child').dataset.done")
        want, drawn = alone(model, chat_ids(model, history), 24)
        assert first.get_attribute("data-done") == "finished", first.text
        assert _text(first) == want
        assert len(set(browser.execute_script("return window.lengths;"))) > 3  # streamed
        stats = first.find_element("css selector", ".stats").text
        assert re.fullmatch(
            rf"{drawn} tokens · [0-9.]+ tok/s · first token after [0-9.]+ s · finish: "
            rf"{'length' if drawn == 24 else 'stop'}", stats,
        ), stats  # fmt: skip

        # a long one, stopped: the stream ends, the server drops the request
        history.append({"role": "assistant", "content": want})
        _set(browser, "max_tokens", "900")
        cancelled = engine.cancelled
        long = _ask(browser, "Tell me a long story.")
        history.append({"role": "user", "content": "Tell me a long story."})
        _wait(browser, "document.querySelector('.msg.assistant:last-child .content')"
                       ".textContent.length > 5")  # fmt: skip
        assert not browser.find_element("id", "stop").get_property("disabled")
        browser.find_element("id", "stop").click()
        _wait(browser, "document.querySelector('.msg.assistant:last-child').dataset.done")
        assert long.get_attribute("data-done") == "stopped"
        assert long.find_element("css selector", ".stats").text.endswith("· stopped")
        partial = _text(long)
        full, _ = alone(model, chat_ids(model, history), 900)
        assert 5 < len(partial) < len(full) and full.startswith(partial)
        deadline = time.monotonic() + 10
        while engine.cancelled == cancelled and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.cancelled == cancelled + 1 and engine.health()["running"] == 0

        # the page is usable again: the next question is answered with the stopped one in its
        # history
        assert browser.find_element("id", "stop").get_property("disabled")
        assert not browser.find_element("id", "send").get_property("disabled")
        history.append({"role": "assistant", "content": partial})
        _set(browser, "max_tokens", "12")
        last = _ask(browser, "And then?")
        history.append({"role": "user", "content": "And then?"})
        _wait(browser, "document.querySelector('.msg.assistant:last-child').dataset.done")
        assert last.get_attribute("data-done") == "finished"
        assert _text(last) == alone(model, chat_ids(model, history), 12)[0]

        shot = tmp_path / "chat.png"
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        print(f"screenshot: {shot}")
        # "New chat" while an answer streams: it stops, and the next question starts afresh
        history.append({"role": "assistant", "content": _text(last)})
        long_ones = (
            q for q in ("Another long story?", "Tell me more.", "Go on, please.", "Why?")
            if alone(model, chat_ids(model, [*history, {"role": "user", "content": q}]), 40)[1]
            == 40
        )  # fmt: skip
        _set(browser, "max_tokens", "300")  # the prompt is longer now: within the context
        streaming = _ask(browser, next(long_ones))  # a question whose answer does not end soon
        _wait(browser, "document.querySelector('.msg.assistant:last-child .content')"
                       ".textContent.length > 5")  # fmt: skip
        assert streaming.get_attribute("data-done") is None
        browser.find_element("id", "clear").click()
        assert browser.find_elements("css selector", ".msg") == []
        _wait(browser, "!document.getElementById('send').disabled")
        _set(browser, "max_tokens", "8")
        fresh = _ask(browser, "Hi again.")
        _wait(browser, "document.querySelector('.msg.assistant:last-child').dataset.done")
        again = [history[0], {"role": "user", "content": "Hi again."}]
        assert _text(fresh) == alone(model, chat_ids(model, again), 8)[0]
        port = url.rsplit(":", 1)[1]
        resources_loaded = browser.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name);"
        )
    assert resources_loaded and all(u.startswith(url + "/") for u in resources_loaded)
    assert len(posts) == 5
    for headers in posts:  # what the server's guard requires of a page (issue 33)
        assert headers["content-type"] == "application/json"
        assert headers["authorization"] == f"Bearer {KEY}"
        assert headers["host"] == f"127.0.0.1:{port}"
    logs = [e["message"] for e in browser.get_log("browser")]
    assert not [m for m in logs if "Content Security Policy" in m or "Refused" in m], logs
