"""Debian's Chromium under Playwright (never a browser a test tool downloads itself)."""

from __future__ import annotations

import contextlib
import json
import os

from helpers.paths import TESTS

CHROMIUM = os.environ.get("DMUON_CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
ARTIFACTS = os.path.join(TESTS,
                         "test-artifacts")


@contextlib.contextmanager
def page_with_errors():
    """(page, errors): errors collects console errors, uncaught exceptions and failed
    or 4xx/5xx requests, so a test can assert the page ran clean."""
    from playwright.sync_api import sync_playwright

    if not os.access(CHROMIUM, os.X_OK):
        raise RuntimeError(f"{CHROMIUM} is missing: `make test` installs Debian's chromium")
    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("console", lambda m: m.type == "error" and errors.append(m.text))
            page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
            page.on("requestfailed", lambda r: errors.append(f"failed: {r.url}")
                    if "/events" not in r.url else None)  # aborted on purpose when done
            page.on("response", lambda r: r.status >= 400 and errors.append(
                f"{r.status}: {r.url}"))
            yield page, errors
        finally:
            browser.close()


@contextlib.contextmanager
def job_page(url: str, job_id: str, showing: str):
    """(page, the job's facts panel text) once the panel shows ``showing``; fails if the
    page logged an error meanwhile."""
    with page_with_errors() as (page, errors):
        page.goto(f"{url}/#job={job_id}")
        page.wait_for_function("document.getElementById('job-facts').innerText"
                               f".includes({json.dumps(showing)})", timeout=60_000)
        yield page, page.locator("#job-facts").inner_text()
        assert errors == []
