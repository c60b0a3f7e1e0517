"""The dashboard in a real headless Chromium (Debian's ``chromium`` + ``chromium-driver``,
driven by Selenium) against a real node process with real paho clients.

What it proves: the page loads from the node (token from the URL fragment), shows the
member, the quorum and live figures that change when messages flow, lists a connected
client whose kick button closes that client's real connection, and browses retained
messages; its delete and kick buttons act on exactly the topic or client of their row,
even one whose name a browser would rewrite in a URL path (``junk/../victim/cfg``, ``..``).
``MQTTRING_DASHBOARD_SCREENSHOT=path`` also saves the screenshot there (how
``docs/dashboard.png`` is made).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from http_support import HOST, TOKEN, HttpNode, wait_for

WAIT = 20.0  # the page polls every 2 s; a loaded runner may need a few rounds


def _browser_paths() -> tuple[str, str]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        raise AssertionError("needs Debian's chromium and chromium-driver (see .ci/run)")
    return browser, driver


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    binary, driver = _browser_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1400,1500", f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(flag)
    chrome = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield chrome
    finally:
        chrome.quit()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[HttpNode]:
    node = HttpNode(tmp_path, node_id="dash1")
    yield node
    node.stop()


def _text(browser: WebDriver, element_id: str) -> str:
    return browser.find_element(By.ID, element_id).text


def _until(browser: WebDriver, condition, what: str) -> None:
    # Tables are redrawn every poll: an element found a moment ago may be gone (stale).
    WebDriverWait(browser, WAIT, poll_frequency=0.1,
                  ignored_exceptions=[StaleElementReferenceException]).until(
        lambda b: condition(b), message=f"dashboard never showed {what}")


def _row_text(browser: WebDriver, selector: str) -> str:
    rows = browser.find_elements(By.CSS_SELECTOR, selector)
    return rows[0].text if rows else ""


def _click(browser: WebDriver, selector: str) -> bool:
    buttons = browser.find_elements(By.CSS_SELECTOR, selector)
    if not buttons:
        return False
    buttons[0].click()
    return True


def test_dashboard_live_figures_and_kick(node: HttpNode, browser: WebDriver, paho_any,
                                         tmp_path: Path) -> None:
    sub = paho_any(node, "dash-sub")
    sub.connect()
    sub.subscribe("plant/#", 1)
    pub = paho_any(node, "dash-pub")
    pub.connect()
    pub.publish("plant/line1/state", b"running", qos=1, retain=True)
    sub.get()

    browser.get(f"http://{HOST}:{node.http_port}/#token={TOKEN}")
    _until(browser, lambda b: _text(b, "quorum") == "quorum", "the quorum badge")
    member = "#members tr[data-node='dash1']"
    _until(browser, lambda b: " up " in _row_text(b, member) and "1024" in _row_text(b, member),
           "the member row, up, owning every shard")
    _until(browser, lambda b: _text(b, "clients-connected") == "2", "two clients")
    _until(browser, lambda b: b.find_elements(
        By.CSS_SELECTOR, "#clients tr[data-client='dash-sub']"), "the subscriber's row")
    assert browser.find_elements(By.CSS_SELECTOR, "#chart-messages canvas")

    # Live figures move when messages flow.
    _until(browser, lambda b: _text(b, "total-received").isdigit(), "the received total")
    before = int(_text(browser, "total-received"))
    for i in range(20):
        pub.publish(f"plant/line1/m{i}", b"x", qos=1)
    sub.collect(20)
    _until(browser, lambda b: int(_text(b, "total-received")) >= before + 20,
           "the received total grow by 20")
    _until(browser, lambda b: _text(b, "rate-in") not in ("\N{EN DASH}", "0.0"), "a message rate")

    # The retained browser.
    box = browser.find_element(By.ID, "retained-filter")
    box.clear()
    box.send_keys("plant/#")
    browser.find_element(By.CSS_SELECTOR, "#retained-form button").click()
    _until(browser, lambda b: b.find_elements(
        By.CSS_SELECTOR, "#retained tr[data-topic='plant/line1/state']"), "the retained row")
    _until(browser, lambda b: "running" in _row_text(
        b, "#retained tr[data-topic='plant/line1/state']"), "the retained payload")

    shot = tmp_path / "dashboard.png"
    browser.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("MQTTRING_DASHBOARD_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["MQTTRING_DASHBOARD_SCREENSHOT"])

    # Kick: the button closes the real client's connection; the row goes away.
    _until(browser, lambda b: _click(b, "button.kick[data-client='dash-sub']"), "a kick button")
    assert sub.disconnected.wait(WAIT), "the kicked client is still connected"
    _until(browser, lambda b: not b.find_elements(
        By.CSS_SELECTOR, "#clients tr[data-client='dash-sub']"), "the kicked client gone")
    assert _text(browser, "error") == ""


def _retained_rows(browser: WebDriver) -> set[str]:
    return {row.get_attribute("data-topic")
            for row in browser.find_elements(By.CSS_SELECTOR, "#retained tbody tr")}


def test_dashboard_deletes_and_kicks_exactly_the_odd_ones(node: HttpNode, browser: WebDriver,
                                                          paho_any) -> None:
    """The delete button of ``junk/../victim/cfg`` deletes that topic, not ``victim/cfg``
    (the browser turned the old path form into the second); the same for ``a/./b`` (not
    ``a/b``), empty levels, spaces and unicode; the kick button of client ``..`` closes that
    client, not another."""
    pub = paho_any(node, "victim")
    pub.connect()
    odd = paho_any(node, "..")
    odd.connect()
    topics = {"victim/cfg", "junk/../victim/cfg", "a/b", "a/./b", "x//y", "sp ace/ü?&%2F"}
    for topic in sorted(topics):
        pub.publish(topic, topic.encode(), qos=1, retain=True)
    with node.http() as http:
        def stored() -> set[str]:
            return {r["topic"] for r in http.get("/api/v1/retained").json()["retained"]}

        wait_for(lambda: stored() == topics, WAIT, "every retained topic stored")
        browser.get(f"http://{HOST}:{node.http_port}/#token={TOKEN}")
        _until(browser, lambda b: _retained_rows(b) == topics, "every retained topic")
        for topic in ("junk/../victim/cfg", "a/./b", "x//y", "sp ace/ü?&%2F"):
            _until(browser, lambda b, t=topic: _click(b, f'button.delete[data-topic="{t}"]'),
                   f"the delete button of {topic!r}")
            topics.discard(topic)
            _until(browser, lambda b: _retained_rows(b) == topics, f"{topic!r} gone alone")
            assert stored() == topics, topic
        assert topics == {"victim/cfg", "a/b"}

        _until(browser, lambda b: _click(b, 'button.kick[data-client=".."]'),
               "the kick button of client '..'")
        assert odd.disconnected.wait(WAIT), "client '..' is still connected"
        _until(browser, lambda b: not b.find_elements(
            By.CSS_SELECTOR, '#clients tr[data-client=".."]'), "client '..' gone")
        assert not pub.disconnected.is_set()
        assert http.get("/api/v1/clients", params={"client": "victim"}).status_code == 200
    assert _text(browser, "error") == ""
