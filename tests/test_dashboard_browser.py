"""The dashboard driven like a user: a real headless Chromium (Debian's ``chromium`` and
``chromium-driver``, through Selenium) against a real ``serve`` and a real ``mjsched dashboard`` on
SQLite and PostgreSQL. One browser for the module; every wait is a bounded wait on the page's DOM.

Set ``MJSCHED_DASHBOARD_SCREENSHOTS=<folder>`` to save the main pages as PNGs (the docs' screenshots).
"""

from __future__ import annotations

import datetime as dt
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REQUIRE_SERVERS, add_job, isolated_database, serial
from procs import serves
from waiting import LogLines

from mjsched_isolated.store import Store

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
PLUGINS = str(Path(__file__).parent / "dashboard_plugins")
OPERATOR_PW, VIEWER_PW = "operator-pass-123", "viewer-pass-4567"
WAIT_S = 30.0
LATER = dt.datetime(2099, 1, 1, tzinfo=dt.UTC)  # jobs that only run when asked
SHOTS = os.environ.get("MJSCHED_DASHBOARD_SCREENSHOTS")

# one worker runs the module (one browser, each stack started once), never beside a timing test (conftest)
pytestmark = [pytest.mark.timeout(120), serial]


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        message = "Debian's chromium and chromium-driver are not installed (.ci/run installs them)"
        pytest.fail(message) if REQUIRE_SERVERS else pytest.skip(message)
    profile = tempfile.mkdtemp(prefix="mjsched-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                 f"--user-data-dir={profile}", "--window-size=1400,1000"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


class Dashboard:
    """A ``mjsched dashboard --port 0`` subprocess; ``url`` once it listens."""

    def __init__(self, db_url: str) -> None:
        env = {**os.environ, "MJSCHED_DASHBOARD_OPERATOR_PASSWORD": OPERATOR_PW,
               "MJSCHED_DASHBOARD_VIEWER_PASSWORD": VIEWER_PW,
               "MJSCHED_LEASE_RENEW_INTERVAL_S": "0.5"}  # its run-now supervisor sees a cancel within 0.5 s
        self.proc = subprocess.Popen([sys.executable, "-m", "mjsched_isolated", "dashboard", "--db", db_url,
                                      "--plugins", PLUGINS, "--port", "0"], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env)
        assert self.proc.stdout is not None
        self.log = LogLines(self.proc.stdout)
        port = self.log.wait_for(r"dashboard on http://127\.0\.0\.1:(\d+)/", 30).group(1)
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def stack(request, tmp_path_factory, browser):
    """A database with three jobs, a ``serve`` running them and a dashboard on it (one per backend, for
    the module: each test acts on jobs of its own)."""
    with isolated_database(request.param, tmp_path_factory.mktemp(request.param)) as url:
        with Store.open(url) as store:
            add_job(store, "ticker", "nap", "* * * * * *", configuration='{"seconds": 0.2}')
            add_job(store, "manual", "nap", "0 0 1 1 *", configuration='{"seconds": 0.3}', next_run_at=LATER)
            add_job(store, "hostile", "hostile", "0 0 1 1 *", next_run_at=LATER)
            add_job(store, "sleeper", "nap", "0 0 1 1 *", configuration='{"seconds": 60}', next_run_at=LATER)
        with serves() as start:
            serve = start(url, "--rescan-interval-s", "0.2", plugins=PLUGINS)
            dash = Dashboard(url)  # the two cold starts overlap
            try:
                serve.wait_ready()
                yield dash, request.param
            finally:
                browser.get("about:blank")  # closes the page's event stream before its server goes
                dash.stop()


def wait(browser, condition, what: str, timeout_s: float = WAIT_S):
    try:
        return WebDriverWait(browser, timeout_s, poll_frequency=0.05).until(lambda d: condition(d))
    except TimeoutException:
        pytest.fail(f"{what}: not within {timeout_s:g} s; page {browser.current_url}:\n"
                    f"{browser.find_element(By.TAG_NAME, 'body').text[:2000]}")


def console_errors(browser) -> list[str]:
    return [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def login(browser, base: str, password: str) -> None:
    browser.delete_all_cookies()
    browser.get(base + "/jobs")
    wait(browser, lambda d: "/login" in d.current_url, "redirected to the login page")
    browser.find_element(By.ID, "password").send_keys(password)
    browser.find_element(By.ID, "login").click()
    wait(browser, lambda d: d.current_url.endswith("/jobs"), "back on /jobs after logging in")


# the page swaps its <main> on every live update: read and click in one script, never through a kept element
def run_rows(browser) -> list[tuple[int, str]]:
    rows = browser.execute_script("return Array.from(document.querySelectorAll('#runs tr[data-run]'))"
                                  ".map(r => [Number(r.dataset.run), r.dataset.status]);")
    return [(int(i), s) for i, s in rows]


def text(browser, selector: str) -> str:
    return browser.execute_script("const e = document.querySelector(arguments[0]); return e ? e.textContent : '';",
                                  selector)


def click(browser, selector: str) -> None:
    assert browser.execute_script("const e = document.querySelector(arguments[0]); if (e) { e.click(); }"
                                  "return !!e;", selector), selector


def shoot(browser, name: str) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(Path(SHOTS, f"dashboard-{name}.png")))


def test_an_operator_watches_runs_live_runs_now_pauses_and_resumes(browser, stack):
    dash, backend = stack
    base = dash.url
    login(browser, base, OPERATOR_PW)
    browser.get_log("browser")  # start clean

    # a scheduled job runs, and its runs appear without reloading the page
    browser.get(base + "/runs?job=ticker")
    wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-live") == "on",
         "the live-update stream to connect")
    browser.execute_script("window.notReloaded = true;")
    first = max([i for i, _ in run_rows(browser)] + [0])
    wait(browser, lambda d: any(i > first and s == "Completed" for i, s in run_rows(d)),
         "a newer completed run of ticker to appear live")
    assert browser.execute_script("return window.notReloaded === true;")

    # the tab is hidden: the stream closes; visible again: it reconnects
    browser.execute_script("Object.defineProperty(document, 'hidden', {configurable: true, get: () => true});"
                           "document.dispatchEvent(new Event('visibilitychange'));")
    assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-live") == "off"
    browser.execute_script("Object.defineProperty(document, 'hidden', {configurable: true, get: () => false});"
                           "document.dispatchEvent(new Event('visibilitychange'));")
    wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-live") == "on", "reconnected")

    # run now: the request answers at once, the run appears and completes on the job's page, live
    browser.get(base + "/jobs/manual")
    assert run_rows(browser) == []
    click(browser, "button.run")
    wait(browser, lambda d: "flash=" in d.current_url, "the run-now answer")
    assert "started" in text(browser, ".flash")
    wait(browser, lambda d: [s for _, s in run_rows(d)] == ["Completed"], "the manual run to appear and complete")
    shoot(browser, "job") if backend == "sqlite" else None

    # pause and resume
    click(browser, "button.pause")
    wait(browser, lambda d: text(d, "h1 .badge") == "Paused", "the job to be Paused")
    click(browser, "button.resume")
    wait(browser, lambda d: text(d, "h1 .badge") == "Active", "the job to be Active")

    # cancel a sleeping run: the run page's button; its supervisor stops it and records it Cancelled
    browser.get(base + "/jobs/sleeper")
    click(browser, "button.run")
    wait(browser, lambda d: [s for _, s in run_rows(d)] == ["Running"], "the sleeping run to start")
    click(browser, "#runs tr[data-run] a")
    wait(browser, lambda d: "/runs/" in d.current_url and text(d, "h1 .badge") == "Running", "the run's page")
    click(browser, "button.cancel")
    wait(browser, lambda d: "cancel requested" in text(d, ".flash"), "the cancel answer")
    wait(browser, lambda d: text(d, "h1 .badge") == "Cancelled", "the run to be Cancelled, live")
    assert "by operator@127.0.0.1" in text(browser, "dl.fields")

    # every page, with no JavaScript console error (a CSP violation would be one)
    for path, name in (("/", "overview"), ("/jobs", "jobs"), ("/runs", "runs"), ("/audit", "audit"),
                       ("/jobs/ticker", None), ("/runs/1", "run")):
        browser.get(base + path)
        wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-live") == "on",
             f"{path} to go live")
        if name and backend == "sqlite":
            shoot(browser, name)
    assert console_errors(browser) == []
    browser.get(base + "/audit")
    audit = browser.find_element(By.ID, "audit").text
    assert re.search(r"operator@127\.0\.0\.1 operator resume manual ok", audit), audit


def test_refusals_and_escaping(browser, stack):
    dash, _ = stack
    base = dash.url

    # a request from a page that has no CSRF token is refused, even from the same origin
    login(browser, base, OPERATOR_PW)
    status = browser.execute_async_script(
        "const done = arguments[0];"
        "fetch('/api/jobs/manual/pause', {method: 'POST', credentials: 'include'}).then(r => done(r.status));")
    assert status == 403
    browser.get_log("browser")  # that refusal is logged as a failed load: expected; start clean after it

    # XSS: a plugin's error and details with script in them are shown as text
    browser.get(base + "/jobs/hostile")
    click(browser, "button.run")
    wait(browser, lambda d: [s for _, s in run_rows(d)] == ["Failed"], "the hostile run to fail")
    click(browser, "#runs tr[data-run] a")
    wait(browser, lambda d: d.find_elements(By.ID, "error"), "the run page")
    assert "<script>document.title='pwned'</script>" in text(browser, "#error")
    assert "<script>" in text(browser, "#details")
    assert "pwned" not in browser.title
    assert console_errors(browser) == []

    # a read-only user sees no action, and is refused one sent with the page's own CSRF token
    login(browser, base, VIEWER_PW)
    browser.get(base + "/jobs/manual")
    assert browser.find_elements(By.CSS_SELECTOR, "button.run, button.pause, #edit, #backfill") == []
    status = browser.execute_async_script(
        "const done = arguments[0];"
        "const token = document.querySelector('meta[name=csrf-token]').content;"
        "fetch('/api/jobs/manual/pause', {method: 'POST', credentials: 'include',"
        " headers: {'X-CSRF-Token': token}}).then(r => done(r.status));")
    assert status == 403
    browser.get_log("browser")  # the refusal is logged as a failed load: expected
    browser.get(base + "/jobs/manual")
    assert text(browser, "h1 .badge") == "Active"
