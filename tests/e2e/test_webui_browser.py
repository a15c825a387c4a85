"""`erniekit webui` in a real browser (Playwright driving Debian's Chromium): a short training of
the tiny model started from the page shows loss points on the plot, the stop button ends it with
a checkpoint, the Chat tab answers with the result, and invalid input shows an error in the page.
Saves a screenshot (ERNIEKIT_SCREENSHOT=path also writes it there: the README's picture).

Without Chromium (or Playwright) the test is skipped with the reason in pytest's summary, so
README's test command passes on a fresh machine; CI sets ERNIEKIT_REQUIRE_BROWSER=1, which turns
that skip into a failure (a CI that silently stopped running the browser test would prove nothing)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
from pathlib import Path

import pytest
from launched_jobs import free_port, serve

ROOT = str(Path(__file__).resolve().parents[2])
REQUIRE = "ERNIEKIT_REQUIRE_BROWSER"


def browser_or_skip(environ=None) -> str:
    """Chromium's path; when it (or Playwright) is missing: skip, with the reason and the fix, or
    fail when ERNIEKIT_REQUIRE_BROWSER=1 (CI) says the browser test must run."""
    env = os.environ if environ is None else environ
    chromium = shutil.which("chromium", path=env.get("PATH")) or shutil.which("chromium-browser", path=env.get("PATH"))
    if importlib.util.find_spec("playwright") is None:
        missing = "no Playwright found (pip install -e '.[test]')"
    elif chromium is None:
        missing = "no Chromium found (apt-get install chromium)"
    else:
        return chromium
    if env.get(REQUIRE, "").strip() not in ("", "0"):
        pytest.fail(f"{missing}, and {REQUIRE}={env[REQUIRE]} requires the browser test", pytrace=False)
    pytest.skip(f"browser test: {missing}; set {REQUIRE}=1 to make this a failure")


def test_no_browser_skips_with_the_reason_or_fails_when_required(tmp_path):
    """The decision itself, against a PATH with and without a `chromium` executable."""
    empty = {"PATH": str(tmp_path)}
    with pytest.raises(pytest.skip.Exception, match=f"no Chromium found .*set {REQUIRE}=1 to make this a failure"):
        browser_or_skip(empty)
    with pytest.raises(pytest.skip.Exception):
        browser_or_skip({**empty, REQUIRE: "0"})
    with pytest.raises(pytest.fail.Exception, match=f"no Chromium found .*{REQUIRE}=1 requires the browser test"):
        browser_or_skip({**empty, REQUIRE: "1"})
    fake = tmp_path / "chromium"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert browser_or_skip({**empty, REQUIRE: "1"}) == str(fake)


@pytest.fixture()
def webui(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    yield from (url for _ in serve(["webui", "--port", str(port)], url, str(tmp_path)))


def _fill(page, elem_id: str, value: str) -> None:
    """Type `value` into a textbox and leave it; again when the page re-rendered the box meanwhile (a
    tab just opened mounts its boxes with their defaults: under load a fill landed before that once)."""
    from playwright.sync_api import expect

    box = page.locator(f"#{elem_id}").locator("textarea, input").first
    for _ in range(3):
        box.fill(value)
        box.press("Tab")
        try:
            expect(box).to_have_value(value, timeout=2_000)
            return
        except AssertionError:
            continue
    expect(box).to_have_value(value)


def test_train_stop_and_chat_through_the_page(request, tmp_path):
    chromium = browser_or_skip()  # before the server starts; in the test body, so a required browser fails it
    webui = request.getfixturevalue("webui")
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1280, "height": 1600})
        page.goto(webui)
        # an impossible hyperparameter: an error line in the page, no run
        _fill(page, "max_steps", "0")
        page.locator("#start").click()
        expect(page.locator("#train_message")).to_contain_text("Error: max steps 0 must be >= 1", timeout=60_000)
        expect(page.locator("#train_message")).not_to_contain_text("Traceback")
        # a short SFT run of the embedded tiny model (long enough to stop it halfway)
        _fill(page, "max_steps", "400")
        _fill(page, "output_dir", str(tmp_path / "run"))
        _fill(page, "batch_size", "16")
        page.locator("#start").click()
        expect(page.locator("#train_message")).to_contain_text("Run started", timeout=60_000)
        expect(page.locator("#cli textarea")).to_have_value(re.compile(r"^erniekit train .*sft\.yaml .*max_steps=400"))
        expect(page.locator("#points")).to_contain_text(re.compile(r"loss points: ([5-9]|\d\d+)"), timeout=180_000)
        expect(page.locator("#progress")).to_contain_text("ETA")
        # the plot draws the loss as a coloured line through the points (vega-lite's SVG marks)
        expect(page.locator("#loss_plot .mark-line path[stroke]")).to_have_count(1, timeout=30_000)
        # a second start into the same directory is refused in the page
        page.locator("#start").click()
        expect(page.locator("#train_message")).to_contain_text("a run is already writing to", timeout=30_000)
        page.locator("#stop").click()
        expect(page.locator("#progress")).to_contain_text("stopped", timeout=120_000)
        steps = [int(d.name.split("-")[1]) for d in (tmp_path / "run").iterdir() if d.name.startswith("checkpoint-")]
        assert steps and max(steps) < 400
        page.screenshot(path=str(tmp_path / "webui-train.png"), full_page=True)
        # resume: the run continues from its checkpoint (the log says so), then stop it again
        n = max(steps)
        page.locator("#resume").click()
        expect(page.locator("#train_message")).to_contain_text("Run resumed", timeout=60_000)
        expect(page.locator("#log textarea")).to_have_value(
            re.compile(f"resumed from .*checkpoint-{n}"), timeout=120_000
        )
        expect(page.locator("#progress")).to_contain_text(re.compile(r"running: step \d+"), timeout=120_000)
        page.locator("#stop").click()
        expect(page.locator("#progress")).to_contain_text("stopped", timeout=120_000)
        # chat with the result
        page.get_by_role("tab", name="Chat").click()
        _fill(page, "chat_dir", str(tmp_path / "run"))
        page.locator("#chat_load").click()
        expect(page.locator("#chat_message")).to_contain_text("Loaded", timeout=60_000)
        _fill(page, "chat_input", "12+7=")
        page.locator("#chat_send").click()
        expect(page.locator("#chatbot")).to_contain_text("12+7=", timeout=30_000)
        page.wait_for_function(
            "document.querySelectorAll('#chatbot .bot, #chatbot [data-testid=\"bot\"]').length > 0", timeout=60_000
        )
        # an export outside the directory the WebUI was started in: refused in the page, nothing written
        page.get_by_role("tab", name="Export").click()
        _fill(page, "export_src", str(tmp_path / "run"))
        _fill(page, "export_dst", "../../erniekit-escape")
        page.locator("#export").click()
        expect(page.locator("#export_result")).to_contain_text(
            "is outside the directories this WebUI may use", timeout=30_000
        )
        assert not (tmp_path.parent.parent / "erniekit-escape").exists()
        page.get_by_role("tab", name="Train").click()
        shot = tmp_path / "webui.png"
        page.screenshot(path=str(shot), full_page=True)
        browser.close()
    if os.environ.get("ERNIEKIT_SCREENSHOT"):
        shutil.copy(tmp_path / "webui-train.png", os.environ["ERNIEKIT_SCREENSHOT"])
    assert shot.stat().st_size > 10_000
