"""A headless Chromium driven by Selenium, for the dashboard's browser test.

Debian's `chromium` and `chromium-driver` (installed by `.ci/run`) are used as they are:
Selenium is given both paths, so it never tries to download a browser or a driver. Outside CI a
missing browser skips the test with a message; in CI (`CI=true`) it fails, so that a broken
install cannot pass as green.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
DRIVER_PATHS = ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver")
WINDOW = (1440, 1500)  # a laptop's width; tall enough to hold every card in one screenshot


def _missing(reason: str) -> None:
    message = f"{reason}; install Debian's chromium and chromium-driver (.ci/run does)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


def _browser_paths() -> tuple[str, str]:
    browser = next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)
    driver = shutil.which("chromedriver") or next(
        (p for p in DRIVER_PATHS if Path(p).exists()), None
    )
    if browser is None or driver is None:
        _missing("no headless browser: chromium or chromedriver not found")
    assert browser is not None and driver is not None
    return browser, driver


@pytest.fixture
def browser() -> Iterator[Any]:
    """A Selenium Chrome session on Debian's chromium; its console is kept for the test."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _missing("selenium is not installed (pip install -e '.[test]')")
    browser_path, driver_path = _browser_paths()
    profile = tempfile.mkdtemp(prefix="ft-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = browser_path
    for argument in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root, where Chromium's sandbox refuses to start
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--no-first-run",
        "--disable-extensions",
        "--hide-scrollbars",
        "--force-device-scale-factor=1",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    driver.set_page_load_timeout(20)
    driver.set_script_timeout(10)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
