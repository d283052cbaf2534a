"""The chat page in a real headless Chromium (Debian's `chromium`; .ci/run installs it): it loads, a
prompt typed into it streams an answer from the demo pair with the draft's marks, Stop stops, and a
model answer holding `<script>` stays text. With MLX_DSPARK_PAGE_SCREENSHOT=path the first test
saves a screenshot there (docs/page.png is one)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import pytest

import mlx_dspark
from mlx_dspark.engine.logits.constraints import Constraint
from mlx_dspark.engine.options import GenerationOptions
from mlx_dspark.loading.load import load
from tests.cdp_browser import find_chromium
from mlx_dspark.serve.app import make_server

CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (apt-get install chromium; .ci/run does)")
websocket = pytest.importorskip("websocket", reason="websocket-client (the test extras) is not installed")

DEMO = Path(mlx_dspark.__file__).parent / "demo"


def demo_loader():
    return load(DEMO / "target", draft=DEMO / "draft")


@contextmanager
def running_server(loader, **options):
    """The demo pair served on a free 127.0.0.1 port, under the name the CLI gives it."""
    server = make_server(loader, model_id="mlx-dspark-demo", host="127.0.0.1", port=0, **options)
    server.start()
    try:
        assert server.worker.loaded.wait(60), "the demo pair did not load in 60 s"
        yield server
    finally:
        server.close(wait_s=10)


@pytest.fixture(scope="module")
def browser():
    from tests.cdp_browser import Browser

    chrome = Browser(CHROMIUM)
    try:
        yield chrome
    finally:
        chrome.close()


def url(server) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}/"


def test_a_typed_prompt_streams_a_marked_answer_and_stop_stops(browser):
    with running_server(demo_loader, defaults=GenerationOptions(max_tokens=64)) as server:
        browser.navigate(url(server))
        browser.wait_for(f"document.getElementById('model').textContent === {server.model_id!r}")
        assert "4096" in browser.evaluate("document.getElementById('context').textContent")
        browser.type_and_enter("#prompt", "def append(self, item):")
        browser.wait_for("!document.getElementById('send').disabled && "
                         "document.querySelectorAll('.message.assistant .raw span').length > 0")
        origins = browser.evaluate("[...document.querySelectorAll('.message.assistant .raw span')].map(s => s.dataset.origin)")
        assert "target" in origins and ({"draft", "lookup"} & set(origins)), origins  # the demo's draft and lookups land
        rendered = browser.evaluate("document.querySelector('.message.assistant .rendered').textContent")
        raw = browser.evaluate("document.querySelector('.message.assistant .raw').textContent")
        assert rendered.strip() and raw.strip()
        assert "mean acceptance" in browser.evaluate("document.getElementById('stats').textContent")
        assert browser.evaluate("document.getElementById('error').textContent") == ""
        shot = os.environ.get("MLX_DSPARK_PAGE_SCREENSHOT")
        if shot:
            browser.evaluate("window.scrollTo(0, 0)")
            browser.screenshot(Path(shot))
        assert browser.evaluate("document.body.classList.contains('no-marks')") is False
        browser.evaluate("document.getElementById('marks').click()")
        assert browser.evaluate("document.body.classList.contains('no-marks')") is True
        browser.evaluate("document.getElementById('marks').click()")

        # Stop: a long answer, stopped after its first marks; the stream ends and nothing more arrives
        browser.evaluate("document.getElementById('max-tokens').value = '2000'")
        browser.type_and_enter("#prompt", "def run(self):")
        browser.wait_for("document.querySelectorAll('.message.assistant').length === 2 && "
                         "document.querySelectorAll('.message.assistant')[1].querySelectorAll('.raw span').length > 2",
                         on_timeout="document.getElementById('error').textContent + ' | ' + document.getElementById('messages').textContent")
        browser.evaluate("document.getElementById('stop').click()")
        browser.wait_for("!document.getElementById('send').disabled")
        count = browser.evaluate("document.querySelectorAll('.message.assistant')[1].querySelectorAll('.raw span').length")
        assert browser.wait_for(f"new Promise(r => setTimeout(() => r(true), 500))")
        assert browser.evaluate("document.querySelectorAll('.message.assistant')[1].querySelectorAll('.raw span').length") == count
        assert server.worker.queued == 0
        assert count < 2000


def test_an_answer_holding_a_script_tag_stays_text(browser):
    # The served answer is forced (a grammar) to hold markup: it must show as characters, never run or parse.
    forced = Constraint.regex(r'<script>window\.pwned = 1</script><img src=x onerror="window\.pwned=2"> ok')
    with running_server(demo_loader, defaults=GenerationOptions(max_tokens=64, constraint=forced)) as server:
        browser.navigate(url(server))
        browser.type_and_enter("#prompt", "hello")
        browser.wait_for("!document.getElementById('send').disabled && "
                         "document.querySelectorAll('.message.assistant .raw span').length > 0")
        shown = browser.evaluate("document.querySelector('.message.assistant .rendered').textContent")
        assert "<script>window.pwned = 1</script>" in shown
        assert browser.evaluate("document.querySelectorAll('main script, main img').length") == 0
        assert browser.evaluate("window.pwned === undefined")
        origins = browser.evaluate("[...document.querySelectorAll('.message.assistant .raw span')].map(s => s.dataset.origin)")
        assert "forced" in origins  # a grammar's forced run is verified in the round and marked as such
