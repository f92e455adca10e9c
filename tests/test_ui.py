"""The dashboard (`run.py --ui`): its API against a real server on a free loopback port with real tiny runs (jobs
queued through it run as real `run.py` processes), and its page in a real headless Chromium.

The module shares one training folder: a finished run and a run that failed in setup are made in this process;
three jobs are queued: `alpha` (long: listed, steered and restarted-around while it trains, then killed with SIGKILL
before its first checkpoint), `beta` (long: starts when alpha is gone; the browser's curve, save and stop tests act
on it) and `gamma` (cancelled while queued). Each test asks the world for the stage it needs (`world.alpha_killed()`,
...), which brings it there if an earlier test has not."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from browser import find_browser, start_browser
from helpers import REPO, run_job, trainer_process

from toolkit.config.loader import ConfigError
from toolkit.run import control
from toolkit.ui.jobs import QUEUE_DIR, JobQueue, QueueRunner, processes_running
from toolkit.ui.server import Dashboard

pytestmark = pytest.mark.slow
SCREENSHOTS = os.environ.get("DIFFTUNE_UI_SCREENSHOTS")  # a folder: the browser tests save the docs' screenshots


def wait_for(what: str, check, timeout: float = 120.0, every: float = 0.2):
    """Polls `check` until it returns something true. The page re-renders while it is read (a live run's curves
    every poll), so an element found by one WebDriver call may be gone by the next: such a read counts as not yet."""
    from selenium.common.exceptions import StaleElementReferenceException

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = check()
        except StaleElementReferenceException:
            value = None
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


class Client:
    """HTTP to a dashboard, as a script or the page would send it."""

    def __init__(self, port: int, token: str | None = None):
        self.port, self.token = port, token

    def request(self, method: str, path: str, body: str | None = None, headers: dict | None = None):
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        sent = {"X-Difftune": "1"} if method != "GET" else {}
        if self.token:
            sent["Authorization"] = f"Bearer {self.token}"
        sent.update(headers or {})
        connection.request(method, path, body=body.encode() if body is not None else None, headers=sent)
        response = connection.getresponse()
        data = response.read()
        connection.close()
        kind = response.getheader("Content-Type", "")
        return response.status, (json.loads(data) if kind.startswith("application/json") else data), response

    def get(self, path: str, **kw):
        return self.request("GET", path, **kw)[:2]

    def post(self, path: str, body: str = "", **kw):
        return self.request("POST", path, body=body, **kw)[:2]


def job_text(tmp: Path, name: str, steps: int, **overrides) -> str:
    process = trainer_process(tmp, train={"steps": steps, "batch_size": 1}, logging={"log_every": 1},
                              sample={"prompts": ["a red circle"], "sample_steps": 1, "width": 64, "height": 64},
                              **overrides)
    process["datasets"][0]["cache_latents"] = True
    return yaml.safe_dump({"job": "extension", "config": {"name": name, "process": [process]}})


class World:
    def __init__(self, tmp: Path, registry):
        self.tmp, self.registry = tmp, registry
        self.root = tmp / "output"
        self.server: Dashboard | None = None
        self.runner: QueueRunner | None = None
        self.jobs: dict[str, str] = {}  # run name -> job id
        self.restart_record: dict | None = None
        self.start_dashboard()

    # ---- the dashboard ------------------------------------------------------------------------------------

    def start_dashboard(self) -> None:
        queue = JobQueue(self.root, self.registry, REPO / "config", [sys.executable, str(REPO / "run.py")],
                         cwd=self.tmp)
        self.server = Dashboard(self.root, queue, "127.0.0.1", 0)
        self.runner = QueueRunner(queue, interval=0.25)
        self.server.runner = self.runner
        assert self.runner.start()
        self.server.serve_in_thread()
        self.client = Client(self.server.server_address[1])

    def stop_dashboard(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.runner.stop()

    @property
    def url(self) -> str:
        return self.server.url

    def status(self, name: str) -> control.Status | None:
        return control.read_status(self.root / name)

    def job(self, name: str) -> dict:
        status, job = self.client.get(f"/api/jobs/{self.jobs[name]}")
        assert status == 200, job
        return job

    # ---- stages -------------------------------------------------------------------------------------------

    def submitted(self) -> None:
        if not self.jobs:
            for name, steps in (("alpha", 100000), ("beta", 100000), ("gamma", 3)):
                status, answer = self.client.post("/api/jobs", job_text(self.tmp, name, steps))
                assert status == 201, answer
                self.jobs[name] = answer["job"]["id"]

    def alpha_running(self) -> None:
        self.submitted()
        wait_for("alpha to train", lambda: (s := self.status("alpha")) and s.state in ("running", "crashed")
                 and s.step >= 2)

    def restarted(self) -> dict:
        """The dashboard stopped and started again on the same folder while alpha trains."""
        if self.restart_record is None:
            self.alpha_running()
            before = self.client.get("/api/jobs")[1]["jobs"]
            started = self.status("alpha").started_at
            self.stop_dashboard()
            time.sleep(0.5)  # scheduling passes, had the old runner been left going
            self.start_dashboard()
            time.sleep(0.5)  # and the new one's
            after = self.client.get("/api/jobs")[1]["jobs"]
            self.restart_record = {"before": before, "after": after, "started_at": started,
                                   "started_at_after": self.status("alpha").started_at}
        return self.restart_record

    def alpha_sampled(self) -> None:
        """alpha asked for a sample through the API, and the sample written."""
        self.restarted()
        samples = self.root / "alpha" / "samples"
        if self.job("alpha")["state"] == "running" and not list(samples.glob("step_*_0.png")):
            status, answer = self.client.post("/api/runs/alpha/control/sample")
            assert status == 202 and answer["requested"] == "sample", answer
        wait_for("alpha's sample", lambda: list(samples.glob("step_*_0.png")), timeout=60)

    def alpha_killed(self) -> None:
        """alpha killed with SIGKILL (after a sample, before any checkpoint), gamma cancelled: the queue goes on
        with beta."""
        self.alpha_sampled()
        if self.job("alpha")["state"] == "running":
            os.kill(self.job("alpha")["pid"], signal.SIGKILL)
        wait_for("the queue to see alpha gone", lambda: self.job("alpha")["state"] != "running", timeout=30)
        if self.job("gamma")["state"] == "queued":
            status, answer = self.client.request("DELETE", f"/api/jobs/{self.jobs['gamma']}")[:2]
            assert status == 200 and answer["state"] == "cancelled", answer

    def beta_running(self) -> None:
        self.alpha_killed()
        wait_for("beta to train", lambda: (s := self.status("beta")) and s.state in ("running", "stopped")
                 and s.step >= 2)

    def beta_stopped(self) -> None:
        self.beta_running()
        if self.status("beta").state == "running":
            status, answer = self.client.post("/api/runs/beta/control/stop")
            assert status == 202, answer
        wait_for("beta to stop", lambda: self.status("beta").state == "stopped")
        wait_for("the queue to see beta end", lambda: self.job("beta")["state"] != "running", timeout=30)

    def close(self) -> None:
        """The queue first (so that it starts nothing more), then every job process still there, with its
        process group (a job runs in a session of its own)."""
        if self.server is not None:
            self.stop_dashboard()
        for job in JobQueue(self.root, self.registry, REPO / "config", []).jobs():
            if job.pid is not None and control.process_alive(job.pid):
                try:
                    os.killpg(job.pid, signal.SIGKILL)
                except ProcessLookupError:  # ended meanwhile
                    pass


@pytest.fixture(scope="module")
def world(tmp_path_factory, registry, tiny_sd15):
    tmp = tmp_path_factory.mktemp("ui")
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # the queued runs share the two cores with this process and the browser
    world = World(tmp, registry)
    try:
        world.submitted()  # alpha starts while the two runs below are made here
        run_job(tmp, registry, "finished", trainer_process(
            tmp, train={"steps": 4}, save={"save_every": 2},
            sample={"sample_every": 2, "prompts": ["a red circle", "a blue square"], "sample_steps": 1, "width": 64,
                    "height": 64}))
        with pytest.raises(ConfigError):
            run_job(tmp, registry, "broken", trainer_process(tmp, model={"arch": "sd15",
                                                                         "name_or_path": str(tmp / "absent_model")}))
        yield world
    finally:
        world.close()
        if threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = threads


@pytest.fixture(scope="module")
def browser(world):
    _, _, why = find_browser()
    if why:
        pytest.skip(f"no browser for the dashboard's browser tests: {why}")
    driver = start_browser()
    yield driver
    driver.quit()


# ---- API ---------------------------------------------------------------------------------------------------------


def test_a_dashboard_restart_keeps_the_queue_and_never_restarts_or_duplicates_a_run(world):
    record = world.restarted()
    ids = [job["id"] for job in record["before"]]
    assert ids == [world.jobs[n] for n in ("alpha", "beta", "gamma")] == [job["id"] for job in record["after"]]
    assert [job["state"] for job in record["after"]] == ["running", "queued", "queued"]
    assert record["after"][0]["pid"] == record["before"][0]["pid"]  # the same process, watched again
    assert record["started_at_after"] == record["started_at"]  # not started again
    alpha_file = world.root / QUEUE_DIR / record["after"][0]["file"]
    assert processes_running(alpha_file) == [record["after"][0]["pid"]]  # and only once
    assert world.status("beta") is None  # nothing overtook the running job


def test_runs_are_listed_with_their_states(world):
    world.restarted()
    status, answer = world.client.get("/api/runs")
    assert status == 200
    runs = {run["name"]: run for run in answer["runs"]}
    assert {"finished", "broken", "alpha"} <= set(runs)
    assert runs["finished"]["state"] == "finished" and (runs["finished"]["step"], runs["finished"]["total"]) == (4, 4)
    assert isinstance(runs["finished"]["loss"], float) and runs["finished"]["seconds_per_update"] > 0
    assert runs["finished"]["thumbnail"] == "/runs/finished/files/samples/step_000000004_1.png"
    status, image = world.client.get(runs["finished"]["thumbnail"])
    assert status == 200 and image == (world.root / "finished" / "samples" / "step_000000004_1.png").read_bytes()
    assert runs["broken"]["state"] == "failed" and "looks like a local path" in runs["broken"]["last_error"]
    alpha = runs["alpha"]
    assert alpha["state"] == "running" and alpha["total"] == 100000 and alpha["step"] >= 2
    assert alpha["eta_s"] > 0 and alpha["seconds_per_update"] > 0 and alpha["loss"] is not None
    status, detail = world.client.get("/api/runs/finished?since=2")
    assert [r["step"] for r in detail["metrics"]] == [3, 4] and detail["last_step"] == 4
    assert detail["plan"]["total updates"] == 4 and "name_or_path: tiny" in detail["config"]
    assert [(s["step"], s["index"], s["prompt"]) for s in detail["samples"]] == [
        (2, 0, "a red circle"), (2, 1, "a blue square"), (4, 0, "a red circle"), (4, 1, "a blue square")]


def test_control_requests_are_acted_on_by_the_running_job(world):
    """A sample request through the API (the browser's save and stop buttons act on beta below); alpha keeps no
    checkpoint, so its kill below is a crash before the first one."""
    world.restarted()
    if world.job("alpha")["state"] != "running":
        pytest.skip("alpha was killed by an earlier test")
    assert not list((world.root / "alpha" / "samples").glob("*"))  # alpha samples only when asked
    world.alpha_sampled()
    wait_for("the request to be removed once acted on",
             lambda: not list((world.root / "alpha" / "control").glob("*.json")), timeout=30)
    assert world.client.post("/api/runs/finished/control/stop")[0] == 409  # nothing runs there
    assert world.client.post("/api/runs/alpha/control/pause")[0] == 404
    assert world.client.post("/api/runs/absent/control/stop")[0] == 404


def test_a_killed_run_is_crashed_with_nothing_saved_and_the_next_job_starts(world):
    world.alpha_killed()
    alpha = world.job("alpha")
    # started by the dashboard before its restart: the new one watched it by its pid, so it has no exit code
    assert alpha["state"] == "crashed" and alpha["returncode"] is None
    runs = {run["name"]: run for run in world.client.get("/api/runs")[1]["runs"]}
    assert runs["alpha"]["state"] == "crashed" and runs["alpha"]["note"].startswith("nothing saved yet")
    said = subprocess.run([sys.executable, str(REPO / "run.py"), "--status", str(world.root / "alpha")],
                          capture_output=True, text=True, check=False).stdout
    assert "crashed, nothing saved yet" in said and "starts over" in said
    # the queue went on with the next job in its order (gamma, cancelled, never starts)
    wait_for("beta to start", lambda: world.job("beta")["state"] != "queued", timeout=10)
    assert world.job("gamma")["state"] == "cancelled"
    # jobs run as `run.py --quiet`: the log, not a progress bar (alpha cached its latents and sampled)
    assert list((world.root / "alpha" / "samples").glob("step_*_0.png"))
    log = world.job("alpha")["log"]
    assert "total updates" in log and "caching latents" not in log
    assert not any(bar in log for bar in ("train:", "caching", "sampling", "it/s]", "step/s")), log[-3000:]


def test_a_job_file_with_errors_is_refused_by_key_and_nothing_is_queued(world):
    before = world.client.get("/api/jobs")[1]["jobs"]
    typo = job_text(world.tmp, "typo", 3).replace("lr:", "lrr:")
    status, answer = world.client.post("/api/jobs", typo)
    assert status == 400
    assert {"key": "config.process[0].train.lrr", "message": "unknown key (did you mean 'lr'?)"} in answer["errors"]
    missing = yaml.safe_load(job_text(world.tmp, "missing", 3))
    missing["config"]["process"][0]["datasets"][0]["folder_path"] = str(world.tmp / "no_such_folder")
    status, answer = world.client.post("/api/jobs", yaml.safe_dump(missing))
    assert status == 400 and answer["errors"][0]["key"] == "config.process[0].datasets[0].folder_path"
    # parsed safely: a Python tag is an error, never a call
    status, answer = world.client.post("/api/jobs", "!!python/object/apply:os.system ['touch pwned']\n")
    assert status == 400 and "cannot parse" in answer["errors"][0]["message"]
    assert not (world.tmp / "pwned").exists() and not Path("pwned").exists()
    assert world.client.get("/api/jobs")[1]["jobs"] == before


def test_a_job_cannot_write_outside_the_training_folder_unless_allowed(world, tmp_path):
    outside = yaml.safe_load(job_text(world.tmp, "outside", 3))
    outside["config"]["process"][0]["training_folder"] = str(tmp_path / "elsewhere")
    status, answer = world.client.post("/api/jobs", yaml.safe_dump(outside))
    assert status == 400 and answer["errors"][0]["key"] == "config.process[0].training_folder"
    assert "--allow-outside" in answer["errors"][0]["message"]
    cached = yaml.safe_load(job_text(world.tmp, "cached", 3))
    cached["config"]["process"][0]["datasets"][0]["cache_latents_to_disk"] = True  # default cache: the image folder
    status, answer = world.client.post("/api/jobs", yaml.safe_dump(cached))
    assert status == 400 and answer["errors"][0]["key"] == "config.process[0].datasets[0].cache_dir"
    allowed = JobQueue(tmp_path / "root", world.registry, REPO / "config", [sys.executable], cwd=world.tmp,
                       allow_outside=True)
    job, problems = allowed.submit(yaml.safe_dump(outside))
    assert problems == [] and job.state == "queued" and job.run is None  # queued, not run: no runner here


def test_token_host_and_write_header_rules(world):
    token = "s3cret-token-0123456789"
    token_server = Dashboard(world.root, None, "127.0.0.1", 0, token=token)
    token_server.serve_in_thread()
    try:
        port = token_server.server_address[1]
        anonymous, holder = Client(port), Client(port, token=token)
        for path in ("/", "/static/app.js", "/api/runs", "/runs/finished/files/metrics.jsonl"):
            assert anonymous.get(path)[0] == 401, path
            assert holder.get(path)[0] == 200, path
        assert Client(port, token="wrong").get("/api/runs")[0] == 401
        assert Client(port, token="s3cret-tökén-0123456789").get("/api/runs")[0] == 401  # not a 500
        status, _, response = anonymous.request("GET", f"/?token={token}")
        cookie = response.getheader("Set-Cookie")
        assert status == 200 and cookie.startswith(f"difftune_token_{port}={token};") and "HttpOnly" in cookie
        # read among other applications' cookies of this host, one of them unparseable
        cookies = f'theme=dark mode; other={{"a": 1}}; difftune_token_{port}={token}'
        assert anonymous.get("/api/runs", headers={"Cookie": cookies})[0] == 200
        assert anonymous.get("/api/runs", headers={"Cookie": f"difftune_token_1={token}"})[0] == 401  # another port's
    finally:
        token_server.shutdown()
        token_server.server_close()
    with pytest.raises(ValueError, match="token"):
        Dashboard(world.root, None, "0.0.0.0", 0)
    with pytest.raises(ValueError, match="16 characters"):
        Dashboard(world.root, None, "127.0.0.1", 0, token="short; Path=/")
    client = world.client
    assert client.get("/api/runs", headers={"Host": "evil.example:80"})[0] == 421  # DNS rebinding
    assert client.request("POST", "/api/runs/finished/control/stop", headers={"X-Difftune": "0"})[0] == 403


def test_a_refused_request_never_smuggles_its_body_in_as_a_next_request(world):
    """A page elsewhere may POST any text without the write header: the refusal ends the connection, so a request
    hidden in the body is never read as a request."""
    hidden = ("POST /api/runs/finished/control/sample HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Difftune: 1\r\n"
              "Content-Length: 0\r\n\r\n")
    with socket.create_connection(("127.0.0.1", world.server.server_address[1]), timeout=10) as connection:
        request = (f"POST /api/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
                   f"Content-Length: {len(hidden)}\r\n\r\n{hidden}")
        connection.sendall(request.encode())
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 403") and answer.count(b"HTTP/1.1 ") == 1  # one answer, then closed
    assert b"Connection: close" in answer


def test_a_non_loopback_dashboard_prints_a_generated_token(tmp_path):
    process = subprocess.Popen([sys.executable, str(REPO / "run.py"), "--ui", str(tmp_path), "--host", "0.0.0.0",
                                "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = process.stdout.readline().strip()
    finally:
        process.kill()
        process.wait()
    assert line.startswith("http://0.0.0.0:") and "?token=" in line and len(line.split("?token=")[1]) >= 24
    port = int(line.split(":")[2].split("/")[0])
    assert port > 0


def test_files_are_served_only_from_inside_run_folders(world):
    client = world.client
    (world.root / "finished" / "outside_link").symlink_to(world.tmp / "finished.yaml")
    for path in ("/runs/finished/files/../../finished.yaml", "/runs/finished/files/%2E%2E/%2E%2E/finished.yaml",
                 "/runs/..%2F..%2F/files/finished.yaml", "/runs/finished/files/outside_link",
                 "/runs/%2Fetc/files/passwd", "/static/..%2Fserver.py", "/static/%2E%2E/jobs.py",
                 "/runs/.queue/files/runner.lock", "/api/runs/..%2F..%2Fetc"):
        status, _ = client.get(path)
        assert 400 <= status < 500, path
    assert client.get("/runs/finished/files/config.yaml")[0] == 200
    sample = world.root / "finished" / "samples" / "step_000000002_0.png"
    status, body, response = client.request("GET", "/runs/finished/files/samples/step_000000002_0.png",
                                            headers={"Range": "bytes=8-23"})
    assert status == 206 and body == sample.read_bytes()[8:24]
    assert response.getheader("Content-Range") == f"bytes 8-23/{sample.stat().st_size}"
    assert client.request("GET", "/runs/finished/files/config.yaml", headers={"Range": "bytes=999999-"})[0] == 416
    status, _, response = client.request("GET", "/runs/finished/files/report.html")
    assert status == 200 and "sandbox" in response.getheader("Content-Security-Policy")


# ---- in the browser ----------------------------------------------------------------------------------------------


def screenshot(driver, name: str) -> None:
    if SCREENSHOTS:
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(1280, min(max(height, 700), 2600))
        time.sleep(0.5)
        driver.save_screenshot(str(Path(SCREENSHOTS) / name))
        driver.set_window_size(1280, 900)


def test_browser_runs_page_lists_the_runs(world, browser):
    world.alpha_running()
    browser.get(world.url)
    rows = wait_for("the runs table", lambda: {row.get_attribute("data-run"): row.get_attribute("data-state")
                                               for row in browser.find_elements("css selector", "#runs tr[data-run]")}
                    if len(browser.find_elements("css selector", "#runs tr[data-run]")) >= 3 else None, timeout=20)
    assert rows["finished"] == "finished" and rows["broken"] == "failed"
    assert rows["alpha"] in ("running", "crashed")
    wait_for("the thumbnail to load", lambda: browser.execute_script(
        "const i = document.querySelector('tr[data-run=finished] img.thumb'); return i ? i.naturalWidth : 0"),
             timeout=10)
    screenshot(browser, "ui_runs.png")


def test_browser_curve_grows_while_the_run_logs(world, browser):
    world.beta_running()
    if world.status("beta").state != "running":
        pytest.skip("beta was stopped by an earlier test")
    browser.get(world.url + "#/run/beta")
    line = 'polyline.smooth[data-run="beta"][data-series="loss"]'

    def points() -> int:  # read in one script: the page redraws the chart on every poll of a live run
        return browser.execute_script("const e = document.querySelector(arguments[0]);"
                                      " return e ? Number(e.dataset.points) : 0", line)

    first = wait_for("the loss curve", points, timeout=20)
    wait_for("the loss curve to grow", lambda: points() > first + 2, timeout=60)
    ticks = browser.execute_script(
        "return document.querySelectorAll('[data-chart=\"loss\"] text[data-tick=\"y\"]').length")
    assert ticks >= 2  # the value axis is labelled
    browser.execute_script("document.getElementById('log-scale').click()")
    title = lambda: browser.execute_script(
        "const e = document.querySelector('[data-chart=\"loss\"] h3 small'); return e ? e.textContent : ''")
    wait_for("the chart to say log scale", lambda: title().endswith("log scale)"), timeout=10)


def test_browser_shows_a_typo_by_key(world, browser):
    browser.get(world.url + "#/queue")
    text = wait_for("the queue page", lambda: browser.find_elements("id", "job-text"), timeout=10)[0]
    typo = job_text(world.tmp, "typo", 3).replace("lr:", "lrr:")
    browser.execute_script("arguments[0].value = arguments[1]", text, typo)
    browser.find_element("id", "job-submit").click()
    item = wait_for("the error list", lambda: browser.find_elements(
        "css selector", '#job-errors li[data-key="config.process[0].train.lrr"]'), timeout=10)[0]
    assert "did you mean 'lr'" in item.text


def test_browser_report_reads_on_a_phone_and_needs_no_other_file(world, browser):
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                            {"width": 390, "height": 844, "deviceScaleFactor": 2, "mobile": True})
    try:
        browser.get(world.url + "runs/finished/files/report.html")
        wait_for("the report's charts", lambda: browser.find_elements("css selector", "svg"), timeout=10)
        page_width, view_width, widest_chart = browser.execute_script(
            "return [document.documentElement.scrollWidth, window.innerWidth,"
            " Math.max(...[...document.querySelectorAll('svg')].map(s => s.getBoundingClientRect().right))]")
        assert page_width <= view_width == 390 and widest_chart <= view_width  # no sideways scroll
        sources = browser.execute_script("return [...document.querySelectorAll('img, video')].map(e => e.src)")
        assert len(sources) == 4 and all(source.startswith("data:") for source in sources)
        loaded = browser.execute_script("return [...document.images].every(i => i.complete && i.naturalWidth > 0)")
        assert loaded
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def test_browser_save_and_stop_buttons_act_on_the_running_job(world, browser):
    world.beta_running()
    if world.status("beta").state != "running":
        pytest.skip("beta was stopped by an earlier test")
    browser.get(world.url + "#/run/beta")
    enabled = lambda name: [b for b in browser.find_elements("id", f"control-{name}") if b.is_enabled()]

    def click(name: str) -> bool:  # found and clicked in one try: a redraw in between makes the try count as not yet
        buttons = enabled(name)
        if buttons:
            buttons[0].click()
        return bool(buttons)

    wait_for("the save button to be enabled", lambda: click("save"), timeout=20)
    wait_for("beta's checkpoint", lambda: list((world.root / "beta" / "checkpoints").glob("step_*/train_state.json")),
             timeout=60)
    if SCREENSHOTS:  # the docs' run page: a sample, and alpha's curves overlaid
        wait_for("the sample button", lambda: click("sample"), timeout=10)
        wait_for("beta's sample", lambda: list((world.root / "beta" / "samples").glob("step_*_0.png")), timeout=60)
        browser.get(world.url + "#/run/beta?with=alpha")
        wait_for("the sample strip", lambda: browser.find_elements("css selector", "#sample-strip img"), timeout=20)
        time.sleep(1.0)
        screenshot(browser, "ui_run.png")
    wait_for("the stop button", lambda: click("stop"), timeout=10)
    wait_for("beta to stop", lambda: world.status("beta").state == "stopped", timeout=120)
    wait_for("the page to say so", lambda: browser.find_elements("css selector", '#run-state [data-state="stopped"]'),
             timeout=10)
    assert not wait_for("the stop button's state", lambda: [enabled("stop")], timeout=10)[0]  # nothing to stop


def test_the_queue_ends_in_order_with_each_job_as_its_run_ended(world):
    world.beta_stopped()
    beta = world.job("beta")
    assert beta["returncode"] == 0  # started by this dashboard: its exit code is known (a stop exits 0)
    stopped_at = world.status("beta").step
    assert (world.root / "beta" / "checkpoints" / f"step_{stopped_at:09d}" / "train_state.json").is_file()
    assert not (world.root / "beta" / "beta.safetensors").exists()  # stopped, not finished: a rerun resumes it
    states = [(job["id"], job["state"]) for job in world.client.get("/api/jobs")[1]["jobs"]]
    assert states == [(world.jobs["alpha"], "crashed"), (world.jobs["beta"], "stopped"),
                      (world.jobs["gamma"], "cancelled")]
    assert world.status("gamma") is None  # never started
    assert world.client.request("DELETE", f"/api/jobs/{world.jobs['beta']}")[0] == 409  # only queued jobs cancel
