"""The viewer end to end in headless Chromium (Debian's `chromium` and `chromium-driver`,
driven by Selenium): rollouts recorded through Turnstile from the real CPU vLLM, served by
`turnstile view`'s app, opened in the browser, checked and screenshotted.

`TURNSTILE_DOCS_SCREENSHOTS=DIR` also writes `viewer.png`, `viewer-overview.png` and
`inspect.svg` (the `turnstile inspect` output) there, for the README.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from rich.console import Console

from tests.integration.test_examples import Turnstile, published_rollouts
from tests.live import LiveServer
from tests.unit.test_view import record_images
from turnstile.backends.fake import FAKE_IMAGE_TOKEN_ID
from turnstile.cli.inspection import show_rollout, summary
from turnstile.view.data import OutputData, TokenText
from turnstile.view.server import build_app

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROME_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
)
WINDOW = (1400, 1000)
# The page renders a few thousand token spans; on a busy 2-core machine that is seconds.
PAGE_TIMEOUT_S = 60
# Model calls of the tiny CPU vLLM, with short answers to keep the suite fast.
CALL_TIMEOUT_S = 120.0
MAX_TOKENS = 16
SCREENSHOT_MAX_HEIGHT = 2600
DOCS_ENV = "TURNSTILE_DOCS_SCREENSHOTS"
MODEL = "tiny-qwen3"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(autouse=True, scope="module")
def _browser_installed() -> None:
    """The browser is a requirement of the suite (.ci/run installs it), never a skip."""
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        pytest.fail(
            "needs Debian's chromium and chromium-driver (apt-get install chromium "
            "chromium-driver)",
            pytrace=False,
        )


def record(ts: Turnstile) -> str:
    """Rollouts over three policy versions; the returned one has a tool round trip and a
    stitching break."""
    with httpx.Client(base_url=ts.url, timeout=CALL_TIMEOUT_S) as http:
        return _record(ts, http)


def _record(ts: Turnstile, http: httpx.Client) -> str:
    def chat(rid: str, messages: list[dict[str, Any]], version: int) -> dict[str, Any]:
        resp = http.post(
            f"/rollouts/{rid}/v1/chat/completions",
            headers={"X-Turnstile-Policy-Version": str(version)},
            json={
                "model": MODEL,
                "messages": messages,
                "tools": TOOLS,
                "max_tokens": MAX_TOKENS,
                "seed": 7,
            },
        )
        resp.raise_for_status()
        return dict(resp.json()["choices"][0]["message"])

    for version, reward in ((0, 0.0), (1, 0.5), (2, 1.0)):
        rid = http.post("/rollouts", json={"group_id": "browser", "task_id": "weather"}).json()[
            "rollout_id"
        ]
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Oslo?"}]
        reply = chat(rid, messages, version)
        messages.append({"role": "assistant", "content": reply.get("content") or ""})
        messages.append({"role": "user", "content": "And tomorrow?"})
        chat(rid, messages, version)
        http.post(f"/rollouts/{rid}/finish", json={"rewards": {"correct": reward}})
    # The featured rollout: the harness rewrites the model's reply into a tool call (the
    # tiny random model never calls tools itself) and appends the tool's result.
    featured: str = http.post(
        "/rollouts",
        json={"group_id": "browser", "task_id": "weather", "metadata": {"harness": "browser-test"}},
    ).json()["rollout_id"]
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    chat(featured, messages, 2)
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    messages += [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    reply = chat(featured, messages, 2)
    messages += [
        {"role": "assistant", "content": reply.get("content") or ""},
        {"role": "user", "content": "Thanks!"},
    ]
    chat(featured, messages, 2)
    http.post(
        f"/rollouts/{featured}/rewards",
        json={"rewards": {"correct": 1.0}, "info": {"correct": "mentions sunny"}},
    )
    http.post(f"/rollouts/{featured}/finish")
    assert len(published_rollouts(ts.output, "browser", 4)) == 4
    return featured


class Viewer(LiveServer):
    """`turnstile view`'s app over a recorded directory."""

    def __init__(self, directory: Path, tokenizer: Path) -> None:
        super().__init__(build_app(directory, tokenizer))
        self.start()


@pytest.fixture(scope="module")
def recorded(
    vllm_server: Any, qwen3_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("browser") / "out"
    with Turnstile(vllm_server.base_url, out, qwen3_tokenizer_dir) as ts:
        rid = record(ts)
    return out, rid


@pytest.fixture
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--window-size={WINDOW[0]},{WINDOW[1]}")
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _wait_ready(driver: Any, hash_: str) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, PAGE_TIMEOUT_S).until(
        lambda d: (
            d.execute_script("return document.body.dataset.ready") == hash_
            or d.find_element("id", "error").is_displayed()
        )
    )
    assert not driver.find_element("id", "error").is_displayed(), driver.find_element(
        "id", "error"
    ).text


def _screenshot(driver: Any, path: Path) -> None:
    height = driver.execute_script("return document.body.scrollHeight")
    driver.set_window_size(WINDOW[0], min(max(height + 40, WINDOW[1]), SCREENSHOT_MAX_HEIGHT))
    driver.save_screenshot(str(path))
    driver.set_window_size(*WINDOW)
    assert path.stat().st_size > 10_000  # a rendered page, not a blank one


def test_viewer_shows_a_rollout_in_chromium(
    recorded: tuple[Path, str],
    qwen3_tokenizer_dir: Path,
    browser: Any,
    tmp_path: Path,
) -> None:
    out, rid = recorded
    docs = os.environ.get(DOCS_ENV)
    if docs:
        Path(docs).mkdir(parents=True, exist_ok=True)
    viewer = Viewer(out, qwen3_tokenizer_dir)
    try:
        browser.get(viewer.url + "/")
        _wait_ready(browser, "#/")
        rows = browser.find_elements("css selector", "#rollouts tbody tr")
        assert len(rows) == 4
        circles = browser.find_elements("css selector", "#version-plot circle")
        assert len(circles) == 6  # reward and tokens at versions 0, 1, 2
        _screenshot(browser, tmp_path / "overview.png")
        if docs:
            shutil.copy(tmp_path / "overview.png", Path(docs) / "viewer-overview.png")

        browser.find_element("css selector", f"tr[data-rollout='{rid}'] a").click()
        _wait_ready(browser, f"#/rollout/{rid}")
        head = browser.find_element("id", "rollout-head").text
        assert rid in head and "correct = 1" in head and "mentions sunny" in head
        assert "browser-test" in head
        turns = browser.find_elements("css selector", "#turns tbody tr")
        assert len(turns) == 3
        samples = browser.find_elements("css selector", ".sample")
        assert len(samples) >= 2  # the rewritten reply breaks the chain
        # Decoded text, with the loss mask: sampled tokens (mask 1) and prompt tokens.
        page = browser.find_element("id", "samples").text
        assert "Oslo" in page and "sunny" in page
        assert browser.find_elements("css selector", ".t.m1")
        assert browser.find_elements("css selector", ".t.m0.special")
        # Turn and tool boundaries are marked.
        marks = {e.text for e in browser.find_elements("css selector", ".turn-mark")}
        assert {"turn 0", "completion 0"} <= marks
        roles = {e.text for e in browser.find_elements("css selector", ".role-mark")}
        assert {"user", "assistant", "tool_call", "tool"} <= roles
        # The break: its kind, the mismatching tokens side by side, the token marked.
        brk = browser.find_element("css selector", ".break")
        assert "Stitching break: history_rewritten" in brk.text
        assert brk.find_elements("css selector", "td.diff")
        assert browser.find_elements("css selector", ".t.brk")
        _screenshot(browser, tmp_path / "rollout.png")
        if docs:
            shutil.copy(tmp_path / "rollout.png", Path(docs) / "viewer.png")
    finally:
        viewer.stop()


def test_inspect_output_for_the_docs(
    recorded: tuple[Path, str],
    qwen3_tokenizer_dir: Path,
    tmp_path: Path,
) -> None:
    out, rid = recorded
    console = Console(record=True, width=120, force_terminal=True)
    data = OutputData(out)
    summary(data, console)
    assert show_rollout(data, rid, TokenText(qwen3_tokenizer_dir), console)
    text = console.export_text(clear=False)
    assert "history_rewritten" in text and "sunny" in text and "<tool_call>" in text
    console.save_svg(str(tmp_path / "inspect.svg"), title="turnstile inspect")
    docs = os.environ.get(DOCS_ENV)
    if docs:
        Path(docs).mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp_path / "inspect.svg", Path(docs) / "inspect.svg")


def test_viewer_shows_image_thumbnails_at_their_spans(
    browser: Any, tmp_path: Path, qwen3_tokenizer_dir: Path
) -> None:
    """An image rollout (recorded through the app on the fake backend): each image is a
    decoded thumbnail at its span, in place of its placeholder tokens."""
    out = tmp_path / "out"
    rid = record_images(out)
    viewer = Viewer(out, qwen3_tokenizer_dir)
    try:
        browser.get(f"{viewer.url}/#/rollout/{rid}")
        _wait_ready(browser, f"#/rollout/{rid}")
        thumbs = browser.find_elements("css selector", ".image-span img.thumb")
        assert len(thumbs) == 3  # the screen, the icon, the screen again
        from selenium.webdriver.support.ui import WebDriverWait

        WebDriverWait(browser, PAGE_TIMEOUT_S).until(
            lambda d: all(d.execute_script("return arguments[0].complete", t) for t in thumbs)
        )
        widths = [browser.execute_script("return arguments[0].naturalWidth", t) for t in thumbs]
        assert widths == [112, 56, 112]  # decoded from /media/{sha256}
        labels = [e.text for e in browser.find_elements("css selector", ".image-label")]
        assert labels[0].startswith("12 image tokens at ")
        # The placeholder tokens are folded under the thumbnails, not drawn one by one.
        titles = browser.execute_script(
            "return [...document.querySelectorAll('#samples .t')].map((e) => e.title)"
        )
        drawn = [int(m.group(1)) for t in titles if (m := re.search(r" id (\d+) ", t))]
        assert len(drawn) == len(titles) > 0
        assert FAKE_IMAGE_TOKEN_ID not in drawn
        _screenshot(browser, tmp_path / "images.png")
    finally:
        viewer.stop()
