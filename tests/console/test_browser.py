"""The console in a real browser (Debian's headless Chromium, driven by selenium) against
``megha up --embedded`` (1 GM, 2 LMs of two 4-CPU workers): what an operator sees.

Run apart (``-m browser`` with MEGHA_BROWSER_TESTS=1, by .ci/run): Chromium is slow to
start on two loaded cores."""

from __future__ import annotations

import asyncio
import importlib.util
import shutil
from pathlib import Path

import pytest

from services.common.client import GlobalMasterClient

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "console_screenshots.py"
_spec = importlib.util.spec_from_file_location("console_screenshots", SCRIPT)
shots = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shots)

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not (shutil.which("chromium") and shutil.which("chromedriver")),
        reason="needs Debian's chromium and chromium-driver (.ci/run installs them)",
    ),
]


@pytest.fixture(scope="module")
def up():
    with shots.UpEmbedded(gms=1, lms=2, workers=2) as federation:
        yield federation


@pytest.fixture(scope="module")
def browser():
    driver = shots.headless_chromium()
    yield driver
    driver.quit()


def submit(gm: str, tasks, job_id: str) -> list[str]:
    async def go():
        async with GlobalMasterClient(gm) as client:
            return list((await client.submit(tasks, job_id=job_id)).task_ids)

    return asyncio.run(go())


def wait_for(browser, probe, what: str, timeout_s: float = 30.0):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, timeout_s, poll_frequency=0.2).until(
        lambda _driver: probe(), message=what
    )


def cells(browser, css: str) -> list[str]:
    """The text of every element ``css`` matches, read in one script: the page swaps its
    live region every refresh, and elements found first and read one by one went stale
    in between (StaleElementReferenceException in a CI run)."""
    return browser.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0]), e => e.innerText.trim())",
        css,
    )


def test_the_federation_page_lists_every_node(up, browser):
    browser.get(up.console + "federation")
    nodes = cells(browser, "td.node")
    assert nodes == ["lm-1-w0", "lm-1-w1", "lm-2-w0", "lm-2-w1"]
    assert cells(browser, "td.alive") == ["alive"] * 4
    assert "4 nodes on 2 LMs, 1 GMs" in browser.page_source


def test_a_submitted_job_appears_and_succeeds_without_a_reload(up, browser):
    browser.get(up.console + "jobs")
    browser.execute_script("window.notReloaded = true")
    submit(up.gm, shots.sim(3, 1.0), "seen-live")
    wait_for(browser, lambda: "seen-live" in cells(browser, "td.job"), "the job never showed")
    row = wait_for(
        browser,
        lambda: next(
            (r for r in cells(browser, "tr") if r.startswith("seen-live") and "3 succeeded" in r),
            None,
        ),
        "the job never showed succeeded",
    )
    assert row.split()[:3] == ["seen-live", "default", "3"]
    assert browser.execute_script("return window.notReloaded") is True  # same page
    # Its page: each task on a node, with its allocation time.
    browser.get(up.console + "jobs/seen-live")
    states = cells(browser, "td.state")
    assert states == ["succeeded"] * 3
    assert all(where.startswith(("lm-1/", "lm-2/")) for where in cells(browser, "td.where"))


def test_a_task_that_cannot_fit_shows_its_pending_reason(up, browser):
    submit(up.gm, shots.sim(4, 120.0, cpu_milli=4000), "fills-all")  # every node, full
    browser.get(up.console + "jobs/fills-all")
    wait_for(browser, lambda: cells(browser, "td.state") == ["running"] * 4, "never all running")
    submit(up.gm, shots.sim(1, 1.0, cpu_milli=4000), "cannot-fit")
    browser.get(up.console + "jobs/cannot-fit")
    browser.execute_script("window.notReloaded = true")
    reason = wait_for(
        browser,
        lambda: next((r for r in cells(browser, "td.reason") if r), None),
        "no pending reason shown",
    )
    assert reason.startswith("waiting for resources: needs cpu=4"), reason
    assert "largest free on a matching node: cpu=0" in reason
    assert cells(browser, "td.state") == ["queued"]
    assert browser.execute_script("return window.notReloaded") is True
