"""A real headless Chromium for the dashboard's browser tests (Debian's `chromium` and `chromium-driver`, which
.ci/run installs), driven by selenium."""

from __future__ import annotations

import shutil

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
DRIVER_NAMES = ("chromedriver", "chromium-driver")


def find_browser() -> tuple[str | None, str | None, str]:
    """(browser, driver, why not) on this machine."""
    browser = next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)
    driver = next((path for name in DRIVER_NAMES if (path := shutil.which(name))), None)
    try:
        import selenium  # noqa: F401
    except ImportError:
        return browser, driver, "selenium is not installed (pip install -e '.[test]')"
    if browser is None or driver is None:
        return browser, driver, ("no Chromium and chromedriver on this machine (.ci/run installs Debian's chromium and "
                                 "chromium-driver where apt-get can)")
    return browser, driver, ""


def start_browser(width: int = 1280, height: int = 900):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver, why = find_browser()
    if why:
        raise RuntimeError(why)
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", f"--window-size={width},{height}",
                 "--hide-scrollbars", "--mute-audio"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(driver), options=options)
