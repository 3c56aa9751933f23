"""The playground page (GET /) in a real headless chromium: coloured token spans stream in, the page's text equals
the API's non-streamed answer, and "compare with AR" reproduces the same greedy text with a speed ratio."""

from __future__ import annotations

import os
import re
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from specgraft.serve.app import Server, create_app

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
SOURCES = {"prefill", "head", "matrix", "context", "bonus"}
PROMPT = "Write a Python function that checks whether a number is prime, with a docstring."
N_TOK = 48


def test_playground_is_self_contained():
    """GET / serves the page with no network dependency (no CDN, fonts or scripts from elsewhere)."""
    r = TestClient(create_app(None)).get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    html = r.text
    assert "<script>" in html and 'id="out-main"' in html and "/v1/chat/completions" in html
    assert not re.search(r"https?://", html), re.findall(r".{30}https?://.{30}", html)
    assert not re.search(r"""(src|href)\s*=\s*["']?//""", html)  # protocol-relative URLs
    assert "@import" not in html


SERVERS: dict = {}


@pytest.fixture(scope="module")
def live(smollm2_engine):
    from .live import Live

    server = Server.start(smollm2_engine, method="graft", max_num_seqs=4)
    with Live(server) as url:
        SERVERS["live"] = server  # the API-key test turns a key on and off on it
        yield url


@pytest.fixture(scope="module")
def browser():
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip(f"needs {CHROMIUM} and {CHROMEDRIVER} (Debian: apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install -e .[test])")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,900"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    yield driver
    driver.quit()


def text_of(driver, el_id: str) -> str:
    return driver.execute_script(f"return document.getElementById('{el_id}').textContent")


def spans(driver, out_id: str) -> list[tuple[str, str]]:
    """(source, text) of every token span in an output panel."""
    rows = driver.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0] + ' .tok'))"
        ".map(s => [s.className, s.textContent])", f"#{out_id}")
    out = []
    for cls, text in rows:
        src = [c[4:] for c in cls.split() if c.startswith("src-")]
        assert cls.split()[0] == "tok" and len(src) == 1, cls
        out.append((src[0], text))
    return out


def wait_for(cond, timeout: float, what: str, poll: float = 0.05):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def open_page(driver, url: str, method: str = "graft", compare: bool = False) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver.get(url + "/")
    wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, "#method option"), 20, "the method list from /v1/models")
    values = [o.get_attribute("value") for o in driver.find_elements(By.CSS_SELECTOR, "#method option")]
    assert "graft" in values and "ar" in values and "hf_assisted" not in values, values
    assert Select(driver.find_element(By.ID, "method")).first_selected_option.get_attribute("value") == "graft"
    assert "smollm2" in text_of(driver, "model").lower()
    Select(driver.find_element(By.ID, "method")).select_by_value(method)
    for el_id, value in (("prompt", PROMPT), ("temperature", "0"), ("max-tokens", str(N_TOK)), ("budget", "")):
        el = driver.find_element(By.ID, el_id)
        el.clear()
        if value:
            el.send_keys(value)
    box = driver.find_element(By.ID, "compare")
    if box.is_selected() != compare:
        box.click()
    driver.find_element(By.ID, "run").click()


def done(driver, key: str):
    status = text_of(driver, f"status-{key}")
    assert status not in ("error", "stopped"), f"{key}: {status}: {text_of(driver, 'error')}"
    return status == "done"


@pytest.mark.slow
def test_playground_streams_coloured_tokens(browser, live):
    t = time.monotonic()
    open_page(browser, live)
    # while the request runs, spans from the drafter (or matrix / context retrieval) show up, coloured by source
    seen_running = wait_for(
        lambda: text_of(browser, "status-main") == "running" and
        any(src in ("head", "matrix", "context") for src, _ in spans(browser, "out-main")), 60,
        "a head/matrix/context token span while streaming")
    assert seen_running
    wait_for(lambda: done(browser, "main"), 60, "#status-main = done")
    got = spans(browser, "out-main")
    assert {src for src, _ in got} <= SOURCES, got
    assert got[0][0] == "prefill", got[:3]
    page_text = "".join(text for _, text in got)
    assert page_text == text_of(browser, "out-main")
    assert float(text_of(browser, "mat-main")) > 1.0
    assert float(text_of(browser, "tps-main")) > 0
    assert 0 < int(text_of(browser, "tokens-main")) <= N_TOK
    assert "graft" in text_of(browser, "title-main") and not browser.find_element("id", "lossy-main").is_displayed()
    colours = browser.execute_script(
        "return ['prefill','head','matrix','context','bonus'].map(s => "
        "getComputedStyle(document.querySelector('.legend .src-' + s)).backgroundColor)")
    assert len(set(colours)) == 5, colours

    body = {"messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": N_TOK,
            "method": "graft"}
    r = httpx.post(live + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert page_text == r.json()["choices"][0]["message"]["content"]
    print(f"streamed page run + API check: {time.monotonic() - t:.1f} s")


@pytest.mark.slow
def test_playground_compare_with_ar(browser, live):
    t = time.monotonic()
    open_page(browser, live, compare=True)
    assert browser.find_element("id", "panel-ar").is_displayed()
    wait_for(lambda: done(browser, "main"), 60, "#status-main = done")
    wait_for(lambda: done(browser, "ar"), 60, "#status-ar = done")
    main, ar = spans(browser, "out-main"), spans(browser, "out-ar")
    assert "".join(x for _, x in ar) == "".join(x for _, x in main) != ""  # greedy is lossless
    assert {src for src, _ in ar} <= {"prefill", "bonus"}, ar  # AR drafts nothing
    assert float(text_of(browser, "tps-ar")) > 0
    assert re.fullmatch(r"\d+\.\d+×", text_of(browser, "ratio").strip()), text_of(browser, "ratio")
    print(f"compare run: {time.monotonic() - t:.1f} s, speed-up {text_of(browser, 'ratio')}")
    # a final chunk of a lossy rule shows the red badge (the page itself never asks for one)
    assert not browser.find_element("id", "lossy-ar").is_displayed()
    browser.execute_script(
        "onChunk({choices: [{index: 0, delta: {}, finish_reason: 'stop'}], specgraft: {method: 'eagle', "
        "verify: 'typical', lossy: true, budget: 59, steps: 3, mean_accepted_tokens: 2.5, tokens_per_s: 9}}, "
        "{start: 0, t0: null, n0: 0, n: 0, tps: null}, 'ar')")
    badge = browser.find_element("id", "lossy-ar")
    assert badge.is_displayed() and badge.text == "LOSSY"
    assert badge.value_of_css_property("background-color") == "rgba(207, 34, 46, 1)"


@pytest.mark.slow
def test_playground_sends_the_api_key(browser, live):
    """With ``--api-key`` the page says it needs the key; once entered (kept in the browser), it lists the
    methods and streams as before."""
    from selenium.webdriver.common.by import By

    server = SERVERS["live"]
    server.api_key = "pg-key"
    try:
        browser.execute_script("localStorage.removeItem('specgraft-api-key')")
        browser.get(live + "/")
        wait_for(lambda: "API key" in text_of(browser, "error"), 20, "the page asking for the API key")
        assert not browser.find_elements(By.CSS_SELECTOR, "#method option")
        browser.find_element(By.ID, "api-key").send_keys("pg-key")
        browser.execute_script("localStorage.setItem('specgraft-api-key', 'pg-key')")
        open_page(browser, live)  # reloads: the key comes back from localStorage, /v1/models answers
        assert browser.find_element(By.ID, "api-key").get_attribute("value") == "pg-key"
        wait_for(lambda: done(browser, "main"), 60, "#status-main = done with the key")
        assert text_of(browser, "out-main")
    finally:
        server.api_key = None
        browser.execute_script("localStorage.removeItem('specgraft-api-key')")
