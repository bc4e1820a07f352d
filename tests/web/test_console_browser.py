"""The console in a real headless browser (Debian's chromium, driven through chromedriver by Selenium):
every page opens against the cluster with traffic, a message is found by its key through the search form,
and a pending timed message is cancelled through its confirmation page with the broker's answer shown.
A failing test leaves a screenshot in test-artifacts/ (tests/web/conftest.py)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from tests.web.conftest import FAILING_GROUP, GROUP, TOPIC, Console, Traffic

pytestmark = [pytest.mark.browser, pytest.mark.timeout(240)]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    webdriver = pytest.importorskip("selenium.webdriver")
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip("Debian's chromium and chromium-driver are not installed (.ci/run installs them)")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="chronomq-chromium-")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1400,1000", f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    d = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    d.set_page_load_timeout(60)
    try:
        yield d
    finally:
        d.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _wait(driver: Any, element_id: str) -> Any:
    """The element once the page that has it is loaded (Selenium does not wait for a click's navigation)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, 20).until(ec.presence_of_element_located((By.ID, element_id)))


def _open(driver: Any, console: Console, path: str) -> Any:
    from selenium.webdriver.common.by import By

    driver.get(console.url.rstrip("/") + path)
    assert not driver.find_elements(By.ID, "error"), driver.find_element(By.ID, "error").text
    return driver.find_element(By.TAG_NAME, "h1").text


@pytest.mark.parametrize("path,heading", [
    ("/", "Cluster"), ("/topics", "Topics"), (f"/topics/{TOPIC}", f"Topic {TOPIC}"),
    ("/groups", "Consumer groups"), (f"/groups/{GROUP}", f"Consumer group {GROUP}"),
    ("/messages", "Messages"),
    ("/delayed", "Delayed messages"), ("/dlq", "Dead letters"), (f"/dlq/{FAILING_GROUP}", "Dead letters of"),
])
def test_every_page_opens(driver: Any, console: Console, path: str, heading: str) -> None:
    assert _open(driver, console, path).startswith(heading)
    assert "chronomq console" in driver.title


def test_cluster_page_shows_the_broker_and_charts_render(driver: Any, console: Console) -> None:
    from selenium.webdriver.common.by import By

    _open(driver, console, "/")
    assert "broker-a" in driver.find_element(By.ID, "brokers").text
    _open(driver, console, "/topics")
    bars = driver.find_elements(By.CSS_SELECTOR, "svg.chart rect.chart-bar")
    assert bars and max(b.size["width"] for b in bars) > 100  # drawn, not just present


def test_search_a_message_by_key(driver: Any, console: Console) -> None:
    from selenium.webdriver.common.by import By

    _open(driver, console, "/messages")
    form = driver.find_element(By.ID, "search")
    form.find_element(By.NAME, "topic").send_keys(TOPIC)
    form.find_element(By.NAME, "key").send_keys("order-12")
    form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    assert _wait(driver, "result-count").text == "1 found"
    driver.find_element(By.CSS_SELECTOR, "table.messages tbody a").click()
    assert "order 12 body" in _wait(driver, "body").text
    assert "order-12" in driver.find_element(By.ID, "properties").text


def test_cancel_a_pending_timed_message(driver: Any, console: Console, cluster: tuple[Any, Traffic]) -> None:
    from selenium.webdriver.common.by import By

    handle = cluster[1].timed["timed-0"]
    _open(driver, console, "/delayed")
    form = driver.find_element(By.ID, "pending-search")
    form.find_element(By.NAME, "key").send_keys("timed-0")
    form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    assert handle in _wait(driver, "pending").text
    driver.find_element(By.LINK_TEXT, "Cancel…").click()
    assert "cannot be undone" in _wait(driver, "confirm").text
    driver.find_element(By.ID, "confirm-button").click()
    outcome = _wait(driver, "outcome").find_element(By.CSS_SELECTOR, "td.outcome").text
    assert outcome == "CANCELLED"  # the broker's answer, shown as it gave it
    assert handle in driver.find_element(By.ID, "outcome").text


def test_a_failure_screenshot_is_a_png(driver: Any, console: Console, tmp_path, monkeypatch) -> None:
    from tests.web.conftest import save_failure_screenshot

    monkeypatch.setenv("CHRONOMQ_TEST_ARTIFACTS", str(tmp_path))
    _open(driver, console, "/delayed")
    path = save_failure_screenshot(driver, "tests/web/x.py::test_y[a/b]")
    assert path.parent == tmp_path and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
