"""A real Prometheus scrapes a real demo run, and every PromQL expression of the Grafana
dashboard (dashboards/eplb.json: panels, annotations, the $job variable) returns data.

Prometheus runs on docker/prometheus/prometheus.yml, the compose demo's own scrape config,
with its one target "node0:9400" replaced by the demo's 127.0.0.1:PORT and nothing else
changed (job name, 1 s scrape interval, labels). Both processes listen on 127.0.0.1 only.
The `prometheus` binary comes from Prometheus itself (Debian/Ubuntu: apt-get install
prometheus), not from pip: without it this test skips with a one-line reason, unless
EPLB_REQUIRE_PROMETHEUS=1 is set, which makes it a failure. .ci/run installs the package and
sets the variable, so CI cannot silently lose the test (tests/_prom.py).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from _dist import free_port
from _prom import REQUIRE_ENV, prometheus_tool

ROOT = Path(__file__).resolve().parent.parent
SCRAPE_CONFIG = ROOT / "docker" / "prometheus" / "prometheus.yml"
COMPOSE = ROOT / "docker" / "docker-compose.yml"
DASHBOARD = ROOT / "dashboards" / "eplb.json"
COMPOSE_TARGET = '"node0:9400"'  # as quoted in the targets list
_SCRIPT = Path(sys.executable).parent / "eplb"
EPLB = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "eplb.ops.cli"]
STEPS, EVERY = 400, 40
DEMO = ["demo", "--nproc", "2", "--steps", str(STEPS), "--rebalance-interval", str(EVERY),
        "--layers", "2", "--experts", "8", "--tokens", "32", "--hidden", "32",
        "--intermediate", "32", "--metrics-interval", "5", "--metrics-replicas",
        "--metrics-per-layer"]
# Grafana's built-in variables as Grafana would set them for a 1 s scrape interval
# ($__rate_interval = 4 x scrape interval), and the smallest $window choice
BUILTINS = {"$__rate_interval": "4s", "$__interval": "1s", "$window": "1m"}
WAIT = 75  # seconds, at most, for the run to be scraped to its end


def prometheus_binary() -> str:
    return prometheus_tool("prometheus")  # skips, or fails under EPLB_REQUIRE_PROMETHEUS=1


def derived_config(metrics_port: int) -> str:
    """docker/prometheus/prometheus.yml with only the target host:port replaced."""
    text = SCRAPE_CONFIG.read_text()
    assert text.count(COMPOSE_TARGET) == 1, f"expected one {COMPOSE_TARGET} in {SCRAPE_CONFIG}"
    return text.replace(COMPOSE_TARGET, f'"127.0.0.1:{metrics_port}"')


class Prometheus:
    def __init__(self, url: str):
        self.url = url

    def get(self, path: str, **params) -> dict:
        q = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"{self.url}{path}?{q}", timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.get("/api/v1/query", query=expr)["result"]

    def query_range(self, expr: str, start: float, end: float, step: str = "1s") -> list[dict]:
        return self.get("/api/v1/query_range", query=expr, start=f"{start:.3f}",
                        end=f"{end:.3f}", step=step)["result"]

    def scalar(self, expr: str) -> float | None:
        r = self.query(expr)
        return float(r[0]["value"][1]) if r else None

    def wait_scraping(self, job: str, process: subprocess.Popen, log: Path, seconds: float = 60.0) -> None:
        """Until Prometheus has `job`'s target in its scrape pool (bounded). Its service
        discovery hands targets over on a 5 s tick, so a short job started with Prometheus
        can run to its end before the first scrape, and every rate of its counters is
        then empty."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            assert process.poll() is None, "prometheus exited" + log_tail(log)
            try:
                active = self.get("/api/v1/targets", state="active")["activeTargets"]
                if any(t["labels"].get("job") == job for t in active):
                    return
            except OSError:  # not listening yet, or 503 while starting
                pass
            time.sleep(0.2)
        raise AssertionError(f"Prometheus has no {job} target after {seconds} s" + log_tail(log))


def start(cmd: list[str], log: Path, **env: str) -> subprocess.Popen:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=e, cwd=ROOT,
                                start_new_session=True)


def stop(p: subprocess.Popen | None) -> None:
    """SIGTERM the process group (a launcher and its ranks), SIGKILL after 10 s."""
    if p is None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            break
        try:
            p.wait(timeout=10)
            break
        except subprocess.TimeoutExpired:
            continue
    p.wait()


def dashboard_queries(d: dict) -> list[tuple[str, str, bool, str | None]]:
    """(where, expr, instant, panel min interval) for every PromQL expression the
    dashboard runs."""
    out = []
    for p in d["panels"]:
        for t in p["targets"]:
            out.append((f"panel {p['title']!r} {t['refId']}", t["expr"], bool(t.get("instant")),
                        p.get("interval")))
    for a in d["annotations"]["list"]:
        out.append((f"annotation {a['name']!r}", a["expr"], False, None))
    return out


def seconds(duration: str) -> int:
    n, unit = int(duration[:-1]), duration[-1]
    return n * {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit]


def substitute(expr: str, variables: dict[str, str]) -> str:
    for name in sorted(variables, key=len, reverse=True):  # $__rate_interval before $__r...
        expr = expr.replace(name, variables[name])
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def compose_healthcheck_path(service: str) -> str:
    """The URL path that docker/docker-compose.yml's healthcheck of `service` probes."""
    import yaml

    test = yaml.safe_load(COMPOSE.read_text())["services"][service]["healthcheck"]["test"]
    (url,) = [a for a in test if a.startswith("http://")]
    return urllib.parse.urlsplit(url).path


def log_tail(*logs: Path) -> str:
    return "".join(f"\n--- {p.name}:\n{p.read_text()[-3000:]}" for p in logs if p.exists())


def test_dashboard_queries_against_real_prometheus(tmp_path):
    binary = prometheus_binary()
    metrics_port, prom_port = free_port(), free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(derived_config(metrics_port))
    prom_log, demo_log = tmp_path / "prometheus.log", tmp_path / "demo.log"
    prom = Prometheus(f"http://127.0.0.1:{prom_port}")
    prometheus = demo = None
    try:
        prometheus = start([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                            f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
                           prom_log)
        prom.wait_scraping("eplb", prometheus, prom_log)  # scraping before the demo steps: its rebalances are seen
        t0 = time.time()
        demo = start(EPLB + DEMO + ["--metrics-port", str(metrics_port), "--metrics-host",
                                    "127.0.0.1", "--metrics-hold", str(WAIT + 30)], demo_log)
        # bounded wait: Prometheus scraped the job up to its last step, rebalances included
        deadline, steps = time.monotonic() + WAIT, None
        while time.monotonic() < deadline:
            assert demo.poll() is None, f"demo exited with {demo.returncode}" + log_tail(demo_log)
            assert prometheus.poll() is None, "prometheus exited" + log_tail(prom_log)
            try:
                steps = prom.scalar('max(eplb_steps_total{job="eplb"})')
            except OSError:  # Prometheus not listening yet
                steps = None
            if steps == STEPS:
                break
            time.sleep(0.5)
        assert steps == STEPS, (f"after {WAIT} s Prometheus has eplb_steps_total={steps}, "
                                f"want {STEPS}" + log_tail(demo_log, prom_log))
        time.sleep(1.5)  # one more scrape: the final gauges
        end = time.time()

        assert prom.scalar('up{job="eplb"}') == 1
        # the endpoint the compose file's Prometheus healthcheck probes answers 200
        with urllib.request.urlopen(prom.url + compose_healthcheck_path("prometheus"), timeout=10) as r:
            assert r.status == 200
        # every scheduled rebalance, moved (success) or gaining less than min_gain (skipped)
        rebalances = prom.scalar('sum(eplb_rebalances_total{job="eplb",outcome!="failure"})')
        assert rebalances == STEPS // EVERY, rebalances
        info = prom.query("eplb_info")
        assert len(info) == 1 and info[0]["metric"]["num_gpus"] == "2", info

        d = json.loads(DASHBOARD.read_text())
        variables = dict(BUILTINS)
        (job_var,) = [v for v in d["templating"]["list"] if v["name"] == "job"]
        query = job_var["query"]  # label_values(METRIC, LABEL), Grafana's function
        query = query["query"] if isinstance(query, dict) else query
        metric, label = (s.strip() for s in query[len("label_values("):-1].split(","))
        jobs = prom.get(f"/api/v1/label/{label}/values", **{"match[]": metric})
        assert jobs == ["eplb"], f"$job variable {query!r} found {jobs}"
        variables["$job"] = "(" + "|".join(jobs) + ")"  # Grafana's multi-value regex

        empty = []
        for where, expr, is_instant, interval in dashboard_queries(d):
            # Grafana: $__interval (the query step) is at least the panel's min interval
            step = substitute(interval or BUILTINS["$__interval"], variables)
            promql = substitute(expr, dict(variables, **{"$__interval": step}))
            n = -(-(end - t0) // seconds(step))  # steps ending at `end`, covering the run
            result = prom.query(promql) if is_instant else \
                prom.query_range(promql, end - n * seconds(step), end, step)
            if not result:
                empty.append(f"{where}: {promql}")
        assert not empty, "dashboard queries with no data:\n" + "\n".join(empty)
    finally:
        stop(demo)
        stop(prometheus)


def test_ci_installs_prometheus_then_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    test_command = blocks[1]  # the README's second command: the test suite
    assert "pytest" in test_command and "\n" not in test_command
    lines = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    # verbatim, then only the slow tests (a separate pytest run)
    assert lines[-2] == test_command
    assert lines[-1] == ".venv/bin/python -m pytest -q -m slow"
    install = next(i for i, ln in enumerate(lines) if "apt-get install" in ln and "prometheus" in ln)
    guard = next(i for i, ln in enumerate(lines) if "command -v prometheus" in ln)
    assert guard < install < len(lines) - 2  # idempotent, before the tests
    # and the real-Prometheus tests are required there: a missing binary fails, never skips
    required = [i for i, ln in enumerate(lines) if ln.strip() == f"export {REQUIRE_ENV}=1"]
    assert required and required[0] < len(lines) - 2, f".ci/run must export {REQUIRE_ENV}=1"


def test_missing_binaries_skip_with_how_to_enable_or_fail_when_required(tmp_path, monkeypatch):
    """tests/_prom.py: the binary on PATH is used; missing, the test skips with a one-line
    reason naming the package and the variable, or fails under EPLB_REQUIRE_PROMETHEUS."""
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH
    for value in (None, "", "0"):
        if value is None:
            monkeypatch.delenv(REQUIRE_ENV, raising=False)
        else:
            monkeypatch.setenv(REQUIRE_ENV, value)
        with pytest.raises(pytest.skip.Exception) as skipped:
            prometheus_tool("promtool")
        reason = str(skipped.value)
        assert "\n" not in reason and "apt-get install prometheus" in reason
        assert f"{REQUIRE_ENV}=1" in reason
    for value in ("1", "yes"):
        monkeypatch.setenv(REQUIRE_ENV, value)
        with pytest.raises(pytest.fail.Exception, match="`prometheus` is not on PATH"):
            prometheus_tool("prometheus")
    fake = tmp_path / "prometheus"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert prometheus_tool("prometheus") == str(fake)  # found: runs, required or not
    assert shutil.which("promtool") is None
