"""`rollout dashboard` driven in headless Chromium (Debian's chromium + chromium-driver, through selenium).

The real command serves a SQLite store holding real runs (`dashboard_helpers.write_runs`) on a
free port; the browser checks what a person sees: the runs table, a run page's plots with the
right number of points, the page catching up while the run trains, a comparison, and the
API-key flow. Screenshots go to $ROLLOUT_TEST_ARTIFACTS (else a tmp folder); with
ROLLOUT_WRITE_DOCS=1 the run page's also goes to docs/dashboard-run.png.

    OMP_NUM_THREADS=1 .venv/bin/pytest -q tests/dashboard/test_dashboard_browser.py
    ROLLOUT_WRITE_DOCS=1 .venv/bin/pytest -q tests/dashboard/test_dashboard_browser.py   # refresh the README image

Skips only where no chromium or chromedriver binary is installed (`.ci/run` installs both).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from dashboard_helpers import GRPO_STEPS, SFT_STEPS, DashboardStore, write_runs

from rollout.store import open_store

ROLLOUT = Path(sys.executable).parent / "rollout"
DOCS_IMAGE = Path(__file__).resolve().parents[2] / "docs" / "dashboard-run.png"
CHROMIUM = next(
    filter(None, (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome"))), None
)
CHROMEDRIVER = shutil.which("chromedriver") or next(
    (p for p in ("/usr/lib/chromium/chromedriver", "/usr/bin/chromedriver") if os.path.exists(p)), None
)
WAIT_S = 10

pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="no chromium/chromedriver binary: apt-get install chromium chromium-driver (.ci/run does)",
)


def start_dashboard(path: Path, *extra: str) -> tuple[subprocess.Popen[str], str]:
    """`rollout dashboard` on a free port; returns the process and its base URL (as it printed it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    proc = subprocess.Popen(
        [str(ROLLOUT), "dashboard", "--storage-path", str(path), "--port", "0", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    line = proc.stdout.readline()  # type: ignore[union-attr]
    match = re.fullmatch(r"dashboard on (http://127\.0\.0\.1:\d+)/ \(api key (on|off)\)\n", line)
    if not match:
        proc.kill()
        raise AssertionError(f"unexpected first line {line!r}; stderr: {proc.stderr.read()}")  # type: ignore[union-attr]
    return proc, match.group(1)


def stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Iterator[DashboardStore]:
    path = tmp_path_factory.mktemp("dashboard") / "rollout.db"
    store = open_store("embedded", path=path)
    yield write_runs(store, path)
    store.close()


@pytest.fixture(scope="module")
def dashboard(runs) -> Iterator[str]:
    objects = runs.path.parent / "objects"  # type: ignore[union-attr]
    proc, url = start_dashboard(runs.path, "--object-path", str(objects))  # type: ignore[arg-type]
    yield url
    stop(proc)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    saved = os.environ.get("SE_OFFLINE")
    os.environ["SE_OFFLINE"] = "true"  # selenium-manager must never try to download a browser or driver
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM  # type: ignore[assignment]
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1360,1000", "--hide-scrollbars", "--force-device-scale-factor=1"):  # fmt: skip
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # console errors, CSP violations
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        if saved is None:
            os.environ.pop("SE_OFFLINE", None)
        else:
            os.environ["SE_OFFLINE"] = saved


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    folder = os.environ.get("ROLLOUT_TEST_ARTIFACTS")
    path = Path(folder) if folder else tmp_path_factory.mktemp("artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def wait_for(driver, script: str, expected, *, timeout: float = WAIT_S):
    """Run `script` (a JS expression) until it returns `expected`; returns the last value."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    seen = []

    def check(d) -> bool:
        seen.append(d.execute_script(f"return {script}"))
        return seen[-1] == expected

    try:
        WebDriverWait(driver, timeout, poll_frequency=0.1).until(check)
    except TimeoutException:
        raise AssertionError(f"{script} was {seen[-1] if seen else None!r}, expected {expected!r}") from None
    return seen[-1]


def plotted_points(driver, metric: str) -> list[int]:
    """Per line of the metric's chart: how many points its SVG path draws (its M/L commands)."""
    paths = driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map(p => [p.getAttribute('d'), p.dataset.points])",
        f'figure[data-metric="{metric}"] path.series',
    )
    for d, count in paths:
        assert len(re.findall(r"[ML]", d)) == int(count)  # the path and its data-points agree
    return [int(count) for _, count in paths]


def assert_no_console_errors(driver) -> None:
    """Nothing the page did failed: no script error, no refused request, no CSP violation."""
    errors = [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, errors


def save_screenshot(driver, path: Path, *, max_height: int = 2400) -> None:
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1360, min(max(int(height) + 20, 800), max_height))  # the whole page, within reason
    assert driver.save_screenshot(str(path))
    png = path.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, shot_height = struct.unpack(">II", png[16:24])  # IHDR
    assert width >= 1000 and shot_height >= 700, (width, shot_height)
    driver.set_window_size(1360, 1000)


def test_runs_table_shows_the_runs(browser, dashboard, runs, artifacts):
    browser.get(dashboard + "/")
    wait_for(browser, "document.querySelectorAll('tr.run-row').length", 3)
    rows = browser.execute_script(
        "return [...document.querySelectorAll('tr.run-row')].map(r => [r.dataset.runId, r.cells[2].textContent,"
        " r.cells[4].textContent, r.cells[5].textContent, r.className])"
    )
    assert rows == [
        [runs.grpo_id, "grpo-tiny", "running", str(GRPO_STEPS), "run-row"],
        [runs.rm_id, "rm-tiny", "✖ crashed", "12", "run-row crashed"],
        [runs.sft_id, "sft-tiny", "succeeded", str(SFT_STEPS), "run-row"],
    ]
    assert wait_for(browser, "document.querySelectorAll('tr.eval-row').length", 2) == 2
    assert_no_console_errors(browser)
    save_screenshot(browser, artifacts / "dashboard-runs.png")


def test_run_page_plots_and_follows_training(browser, dashboard, runs, artifacts):
    browser.get(f"{dashboard}/runs/{runs.grpo_id}")
    wait_for(browser, "document.querySelectorAll('figure.chart').length", 5)
    charts = browser.execute_script("return [...document.querySelectorAll('figure.chart')].map(f => f.dataset.metric)")
    assert charts == ["train/loss", "rollout/reward_mean", "eval/pass@1", "train/grad_norm", "train/kl"]
    wait_for(browser, "document.querySelector('figure[data-metric=\"rollout/reward_mean\"] path.series') !== null", True)
    assert plotted_points(browser, "rollout/reward_mean") == [GRPO_STEPS]
    assert plotted_points(browser, "train/grad_norm") == [GRPO_STEPS - 1]  # the NaN step is a gap...
    d = browser.execute_script("return document.querySelector('figure[data-metric=\"train/grad_norm\"] path').getAttribute('d')")
    assert d.count("M") == 2  # ...so the line starts twice
    assert plotted_points(browser, "eval/pass@1") == [1]
    assert browser.execute_script("return document.querySelectorAll('figure[data-metric=\"eval/pass@1\"] circle.dot').length") == 1
    assert wait_for(browser, "document.querySelectorAll('tr.snapshot-row').length", 1) == 1
    assert wait_for(browser, "document.querySelectorAll('tr.event-row').length", GRPO_STEPS + 2) == GRPO_STEPS + 2
    assert wait_for(browser, "document.querySelectorAll('tr.eval-row').length", 1) == 1
    commands = browser.execute_script("return [...document.querySelectorAll('tr.snapshot-row code')].map(c => c.textContent)")
    short = runs.grpo_snapshot_id[:12]
    assert commands == [
        f"rollout snapshot export {short} ./export-{short} --storage-path {runs.path}"
        f" --object-path {runs.path.parent / 'objects'}",
        f"rollout train grpo --config CONFIG --resume {short}",
    ]
    assert "live" in browser.find_element("id", "live").text

    runs.train_grpo(range(GRPO_STEPS + 1, GRPO_STEPS + 9))  # the run trains on: 8 more steps
    wait_for(browser, "document.querySelector('figure[data-metric=\"rollout/reward_mean\"] path').dataset.points", str(GRPO_STEPS + 8))
    assert plotted_points(browser, "rollout/reward_mean") == [GRPO_STEPS + 8]
    assert plotted_points(browser, "train/loss") == [GRPO_STEPS + 8]
    newest_event = wait_for(browser, "document.querySelector('tr.event-row td:nth-child(3)').textContent", "train_step")
    assert newest_event == "train_step"
    fields = browser.execute_script("return document.querySelector('tr.event-row td:nth-child(4)').textContent")
    assert json.loads(fields)["step"] == GRPO_STEPS + 8
    assert_no_console_errors(browser)
    save_screenshot(browser, artifacts / "dashboard-run.png", max_height=1400)  # charts to the first events
    if os.environ.get("ROLLOUT_WRITE_DOCS") == "1":
        DOCS_IMAGE.parent.mkdir(exist_ok=True)
        shutil.copyfile(artifacts / "dashboard-run.png", DOCS_IMAGE)


def test_finished_run_page_stops_polling(browser, dashboard, runs):
    browser.get(f"{dashboard}/runs/{runs.sft_id[:10]}")  # a prefix works as in `rollout runs show`
    wait_for(browser, "document.getElementById('live').textContent", "finished · not polling")
    assert plotted_points(browser, "train/loss") == [SFT_STEPS]
    assert browser.execute_script("return document.querySelectorAll('tr.snapshot-row').length") == 4
    assert browser.execute_script("return document.querySelectorAll('tr.event-row').length") == SFT_STEPS + 2
    assert_no_console_errors(browser)


def test_compare_two_runs_on_one_plot(browser, dashboard, runs, artifacts):
    browser.get(dashboard + "/")
    wait_for(browser, "document.querySelectorAll('tr.run-row').length", 3)
    for run_id in (runs.sft_id, runs.grpo_id):
        browser.find_element("css selector", f'tr[data-run-id="{run_id}"] input[type=checkbox]').click()
    browser.find_element("id", "compare").click()
    wait_for(browser, "location.pathname", "/compare")
    wait_for(browser, "document.querySelectorAll('figure.compare path.series').length", 2)
    assert browser.execute_script("return document.getElementById('metric').value") == "train/loss"
    labels = browser.execute_script("return [...document.querySelectorAll('path.series')].map(p => p.dataset.label)")
    assert sorted(labels) == sorted([runs.sft_id, runs.grpo_id])
    counts = dict(zip(labels, plotted_points_compare(browser), strict=True))
    grpo_steps = max(m.step for m in runs.store.read_metrics(runs.grpo_id, name="train/loss"))
    assert counts == {runs.sft_id: SFT_STEPS, runs.grpo_id: grpo_steps}
    assert browser.execute_script("return document.querySelectorAll('.legend li').length") == 2

    # Another metric: only the runs that logged it get a line.
    browser.find_element("css selector", "#metric option[value='train/lr']").click()
    wait_for(browser, "document.querySelectorAll('path.series').length > 0 && document.querySelector('svg.plot').getAttribute('aria-label')", "train/lr")
    assert plotted_points_compare(browser) == [SFT_STEPS, 0]
    assert "metric=train%2Flr" in browser.current_url
    assert "(not logged)" in browser.find_element("css selector", f'.legend li[data-run-id="{runs.grpo_id}"]').text
    assert_no_console_errors(browser)
    save_screenshot(browser, artifacts / "dashboard-compare.png")


def plotted_points_compare(driver) -> list[int]:
    return [int(n) for n in driver.execute_script("return [...document.querySelectorAll('figure.compare path.series')].map(p => p.dataset.points)")]


def test_api_key_from_the_url_fragment(browser, runs):
    proc, url = start_dashboard(runs.path, "--api-key", "k3y")  # type: ignore[arg-type]
    try:
        browser.get(f"{url}/runs/{runs.sft_id}")
        wait_for(browser, "document.querySelectorAll('form.keyform').length", 1)  # no key yet: asked for it
        browser.get(url + "/#key=k3y")
        wait_for(browser, "document.querySelectorAll('tr.run-row').length", 3)
        assert browser.execute_script("return location.hash") == ""  # the key left the address bar
        browser.execute_script("sessionStorage.clear()")
        browser.refresh()
        wait_for(browser, "document.querySelectorAll('form.keyform').length", 1)
        browser.find_element("id", "key").send_keys("k3y\n")
        wait_for(browser, "document.querySelectorAll('tr.run-row').length", 3)
    finally:
        stop(proc)
