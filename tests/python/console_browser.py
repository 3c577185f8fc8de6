"""Headless Chromium driving Spillway's web console (test_console.py, scripts/bench-console.py).

Debian's ``chromium`` and ``chromium-driver`` (scripts/install-deps.sh installs them);
``CHROMIUM_BIN`` and ``CHROMEDRIVER`` name others. Selenium is given both paths, so it
never downloads a browser or a driver. A missing browser is an error, not a skip: CI
installs it, and a console test that silently does not run proves nothing."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from selenium import webdriver
from selenium.common.exceptions import (NoAlertPresentException, NoSuchElementException,
                                        StaleElementReferenceException, TimeoutException)
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

WINDOW = (1360, 900)


class BrowserMissing(RuntimeError):
    pass


def _find(env: str, names: list[str], fallback: list[str]) -> str:
    if os.environ.get(env):
        return os.environ[env]
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    for path in fallback:
        if Path(path).exists():
            return path
    raise BrowserMissing(
        f"{names[0]} not found (set {env}): install Debian's chromium and chromium-driver "
        "(scripts/install-deps.sh does)")


def chromium() -> tuple[webdriver.Chrome, tempfile.TemporaryDirectory]:
    """A headless Chromium with its own profile directory (two runs can go at once).
    Returns the driver and the profile directory, to clean up after ``driver.quit()``."""
    binary = _find("CHROMIUM_BIN", ["chromium", "chromium-browser"], ["/usr/lib/chromium/chromium"])
    driver_path = _find("CHROMEDRIVER", ["chromedriver"], ["/usr/lib/chromium/chromedriver"])
    profile = tempfile.TemporaryDirectory(prefix="spillway-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for argument in ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--no-first-run", "--disable-extensions", "--force-device-scale-factor=1",
                     f"--window-size={WINDOW[0]},{WINDOW[1]}", f"--user-data-dir={profile.name}"]:
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    try:
        driver = webdriver.Chrome(options=options, service=Service(driver_path))
    except Exception:
        profile.cleanup()
        raise
    driver.set_page_load_timeout(30)
    return driver, profile


def wait_for(driver, condition, timeout: float = 20.0, what: str = "the condition"):
    """Waits for ``condition(driver)`` to be truthy (never a fixed sleep); returns it."""
    def probe(d):
        try:
            return condition(d)
        except (NoSuchElementException, StaleElementReferenceException):
            return False
    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.02).until(probe)
    except TimeoutException:
        try:
            logged = [entry.get("message", "") for entry in driver.get_log("browser")]
        except Exception:  # noqa: BLE001 - only for the message
            logged = []
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; "
                             f"page at {driver.current_url}; browser log: {logged}") from None


def css(driver, selector: str):
    return driver.find_element(By.CSS_SELECTOR, selector)


def all_css(driver, selector: str):
    return driver.find_elements(By.CSS_SELECTOR, selector)


def text_of(driver, selector: str) -> str:
    found = all_css(driver, selector)
    return found[0].text if found else ""


def log_in(driver, base: str, user: str, password: str) -> None:
    """Opens the console and fills in its login form (the answer is the caller's to check)."""
    driver.get(base + "/#/overview")
    wait_for(driver, lambda d: css(d, "#login-user").is_displayed(), what="the login form")
    css(driver, "#login-user").send_keys(user)
    css(driver, "#login-password").send_keys(password)
    css(driver, "#login-submit").click()


def logged_in_as(driver, user: str) -> bool:
    return text_of(driver, ".who-name") == user


def go(driver, hash_route: str) -> None:
    """Follows a console link (hash routing: no page load)."""
    driver.execute_script("location.hash = arguments[0]", hash_route)


def accept_confirm(driver, timeout: float = 5.0) -> str:
    """Accepts the browser's confirm() dialog; its text."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            alert = driver.switch_to.alert
            text = alert.text
            alert.accept()
            return text
        except NoAlertPresentException:
            if time.monotonic() > deadline:
                raise AssertionError("no confirm() dialog appeared") from None
            time.sleep(0.02)


def page_errors(driver) -> list[str]:
    """What the browser logged as errors (script errors, CSP refusals), leaving out the
    API's refusals the console shows itself (a 401, 404 or 400 fetched on purpose)."""
    errors = []
    for entry in driver.get_log("browser"):
        if entry.get("level") != "SEVERE":
            continue
        message = entry.get("message", "")
        if "Failed to load resource" in message and any(
                f"status of {code}" in message for code in (400, 401, 404)):
            continue
        errors.append(message)
    return errors
