"""The chat page at / in a real headless browser (Debian's chromium, driven by Playwright):
type a message, see the streamed reply and its tokens/s, reset."""

from __future__ import annotations

import os
from pathlib import Path

import httpx2 as httpx
import pytest

sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = os.environ.get("LMCLI_CHROMIUM", "/usr/bin/chromium")
if not Path(CHROMIUM).exists():
    pytest.skip(f"no chromium at {CHROMIUM} (apt-get install chromium)", allow_module_level=True)


def test_page_streams_a_reply_and_resets(server: str) -> None:
    settings = {"temperature": 0.8, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "max_tokens": 24, "seed": 7}
    expected = httpx.post(
        server + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "the cat"}], **settings},
    ).json()["choices"][0]["message"]["content"]
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.set_default_timeout(20_000)
            page.goto(server + "/")
            page.wait_for_function("document.getElementById('model').textContent.startsWith('run')")
            for name in ("max_tokens", "seed"):
                page.fill(f"#{name}", str(settings[name]))
            page.fill("#input", "the cat")
            page.press("#input", "Enter")
            page.wait_for_function("document.getElementById('status').textContent.includes(' in ')")
            assert page.inner_text(".msg.user") == "the cat"
            assert page.eval_on_selector(".msg.assistant", "e => e.textContent") == expected
            assert "tokens/s" in page.inner_text("#status")
            page.click("#reset")
            assert page.locator(".msg").count() == 0
            assert page.inner_text("#status") == "new conversation"
        finally:
            browser.close()
