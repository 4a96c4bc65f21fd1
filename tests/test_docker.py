"""docker/: what can be checked without a Docker daemon. The compose file parses, every file
it mounts or builds from exists, the node commands are valid torchrun and demo command
lines (parsed by torchrun's and the demo's own parsers), Prometheus scrapes the port rank 0
serves on, and Grafana's provisioning points at that Prometheus and at the dashboard.
The scrape config itself runs in a real Prometheus in tests/test_prometheus.py."""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from _dist import free_port
from _prom import prometheus_tool

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "docker-compose.yml"


_SCRIPT = Path(sys.executable).parent / "eplb"
EPLB = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "eplb.ops.cli"]
# the tool each service's healthcheck runs, and the images that have it: the eplb image is
# built FROM python (no curl), prom/prometheus is busybox-based (wget), grafana/grafana
# installs curl
PROBE_TOOL = {"node0": "python3", "node1": "python3", "prometheus": "wget", "grafana": "curl"}
URL = re.compile(r"http://[\w.-]+:\d+/[\w/.-]*")


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def bind_mounts(service: dict) -> list[tuple[Path, str]]:
    """(host path resolved against docker/, container path) of each bind mount."""
    out = []
    for v in service.get("volumes", []):
        src, dst = v.split(":")[:2]
        if src.startswith((".", "/")):
            out.append(((DOCKER / src).resolve(), dst))
    return out


def torchrun_args(argv: list[str]) -> argparse.Namespace:
    from torch.distributed.run import get_args_parser

    return get_args_parser().parse_args([str(x) for x in argv])


def demo_args(argv: list[str]) -> argparse.Namespace:
    from eplb.ops.demo_args import add_demo_arguments, check_demo_arguments

    p = argparse.ArgumentParser()
    add_demo_arguments(p)
    a = p.parse_args(argv)
    check_demo_arguments(a)
    return a


def test_compose_parses_and_references_existing_files():
    c = compose()
    assert set(c["services"]) == {"node0", "node1", "prometheus", "grafana"}
    for name, s in c["services"].items():
        for src, _ in bind_mounts(s):
            assert src.exists(), f"service {name} mounts a missing path: {src}"
        for port in s.get("ports", []):  # published on loopback only
            assert str(port).startswith("127.0.0.1:"), (name, port)
        if "build" in s:
            context = (DOCKER / s["build"]["context"]).resolve()
            assert context == ROOT
            assert (context / s["build"]["dockerfile"]).resolve() == DOCKER / "Dockerfile"
    for name in ("prometheus", "grafana"):
        assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", c["services"][name]["image"]), \
            f"{name}: pin the image version"
    assert set(c["volumes"]) == {"prometheus-data", "grafana-data"}


def dockerfile_healthcheck() -> tuple[dict[str, str], list[str]]:
    """(options, exec-form command) of the Dockerfile's one HEALTHCHECK."""
    text = (DOCKER / "Dockerfile").read_text().replace("\\\n", " ")
    (m,) = re.finditer(r"^HEALTHCHECK (.*?)CMD (\[.+\])$", text, re.M)
    options = dict(re.findall(r"--([\w-]+)=(\S+)", m.group(1)))
    return options, json.loads(m.group(2))


def probe_url(test: list[str]) -> str:
    (url,) = URL.findall(" ".join(test))
    return url


def container_port(service: dict, host_port: int) -> int:
    """The container port published on 127.0.0.1:host_port."""
    (port,) = [int(p.split(":")[2]) for p in service["ports"] if int(p.split(":")[1]) == host_port]
    return port


def test_every_service_has_a_healthcheck_and_dependencies_wait_for_health():
    c = compose()
    services = c["services"]
    demo = demo_args(torchrun_args(services["node0"]["command"]).training_script_args)
    want = {  # what each healthcheck probes, from inside its container
        "node0": f"http://127.0.0.1:{demo.metrics_port}/healthz",  # rank 0's server
        "node1": f"http://node0:{demo.metrics_port}/healthz",  # node1 serves no HTTP
        "prometheus": f"http://127.0.0.1:{container_port(services['prometheus'], 9090)}/-/healthy",
        "grafana": f"http://127.0.0.1:{container_port(services['grafana'], 3000)}/api/health",
    }
    assert set(want) == set(services) == set(PROBE_TOOL)
    for name, s in services.items():
        hc = s.get("healthcheck")
        assert hc and not hc.get("disable"), f"{name}: no healthcheck"
        assert hc["test"][0] == "CMD" and hc["test"][1] == PROBE_TOOL[name], (name, hc["test"])
        assert probe_url(hc["test"]) == want[name], (name, hc["test"])
        for key in ("interval", "timeout", "start_period"):
            assert re.fullmatch(r"\d+s", hc[key]), (name, key, hc[key])
        assert int(hc["timeout"][:-1]) < int(hc["interval"][:-1]) and hc["retries"] >= 1
    # node0 runs the image's own HEALTHCHECK, and node1 the same probe aimed at node0
    _, dockerfile_probe = dockerfile_healthcheck()
    assert services["node0"]["healthcheck"]["test"][1:] == dockerfile_probe
    assert services["node1"]["healthcheck"]["test"][1:] == \
        [a.replace(want["node0"], want["node1"]) for a in dockerfile_probe]

    for name, s in services.items():
        assert isinstance(s.get("depends_on", {}), dict), \
            f"{name}: depends_on needs the long form, with a condition"
    conditions = {(name, dep): cond["condition"] for name, s in services.items()
                  for dep, cond in s.get("depends_on", {}).items()}
    assert all(dep in services for _, dep in conditions)
    # node0's /healthz answers only once node1 has joined the rendezvous: node1 waiting for a
    # healthy node0 would wait forever, so it waits for node0 to have started
    assert conditions.pop(("node1", "node0")) == "service_started"
    assert conditions == {("grafana", "prometheus"): "service_healthy"}


def test_dockerfile_healthcheck_probes_healthz_on_the_port_the_job_serves():
    text = (DOCKER / "Dockerfile").read_text()
    options, probe = dockerfile_healthcheck()
    assert probe[:2] == ["python3", "-c"]  # the image's own python: no curl in python:*-slim
    assert re.search(r"^ARG BASE_IMAGE=python:", text, re.M)
    cmd = json.loads(re.search(r"^CMD (\[.+?\])$", text.replace("\\\n", " "), re.M | re.S).group(1))
    port = demo_args(torchrun_args(cmd).training_script_args).metrics_port
    assert probe_url(probe) == f"http://127.0.0.1:{port}/healthz"
    assert str(port) in re.search(r"^EXPOSE (.+)$", text, re.M).group(1).split()
    for key in ("interval", "timeout", "start-period"):
        assert re.fullmatch(r"\d+s", options[key]), (key, options)
    assert int(options["retries"]) >= 1


def _probe(command: list[str], url: str) -> subprocess.CompletedProcess:
    """A healthcheck's exec-form command aimed at `url`, run with this interpreter."""
    argv = [sys.executable if a == "python3" else a.replace(probe_url(command), url) for a in command]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30)


def test_healthcheck_probe_against_a_real_demo_server(tmp_path):
    """The Dockerfile's HEALTHCHECK command, aimed at a real `eplb demo --metrics-port`,
    exits 0 while rank 0 serves and 1 (Docker's "unhealthy") when nothing listens."""
    _, probe = dockerfile_healthcheck()
    port = free_port()
    url = f"http://127.0.0.1:{port}/healthz"
    closed = _probe(probe, url)
    assert closed.returncode == 1, closed
    log = tmp_path / "demo.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log, "w") as f:
        demo = subprocess.Popen(EPLB + ["demo", "--nproc", "1", "--steps", "5", "--rebalance-interval", "5",
                                        "--layers", "1", "--experts", "4", "--tokens", "8", "--hidden", "8",
                                        "--intermediate", "8", "--metrics-port", str(port),
                                        "--metrics-host", "127.0.0.1", "--metrics-hold", "120"],
                                stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while (r := _probe(probe, url)).returncode != 0 and time.monotonic() < deadline:
            assert demo.poll() is None, f"demo exited with {demo.returncode}:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        assert r.returncode == 0, (r, log.read_text()[-3000:])
        # node1's probe is the same command aimed at node0's rank 0
        node1 = compose()["services"]["node1"]["healthcheck"]["test"][1:]
        assert _probe(node1, url).returncode == 0
    finally:
        try:
            os.killpg(demo.pid, signal.SIGKILL)  # the launcher and its rank
        except ProcessLookupError:
            pass
        demo.wait(30)
    down = _probe(probe, url)
    assert down.returncode == 1, down


def test_two_node_job_commands():
    c = compose()
    nodes = [c["services"]["node0"], c["services"]["node1"]]
    parsed = [torchrun_args(n["command"]) for n in nodes]
    for rank, (node, t) in enumerate(zip(nodes, parsed)):
        assert node["hostname"] == f"node{rank}"
        assert t.nnodes == "2" and t.nproc_per_node == "2" and t.node_rank == rank
        assert t.rdzv_backend == "c10d" and t.rdzv_endpoint == "node0:29400"
        assert t.module and t.training_script == "eplb.ops.demo"
        assert t.local_addr == f"node{rank}"  # c10d sorts nodes by it: rank 0 on node0
    assert sorted(t.local_addr for t in parsed)[0] == "node0"
    assert parsed[0].rdzv_id == parsed[1].rdzv_id
    # every rank must run the same demo (metrics attach collectively on all of them)
    assert parsed[0].training_script_args == parsed[1].training_script_args
    demo = demo_args(parsed[0].training_script_args)
    assert demo.metrics_port == 9400 and demo.metrics_host == "0.0.0.0"
    assert demo.metrics_replicas  # the dashboard's opt-in replica panels have data
    assert demo.metrics_per_layer  # and its layer x GPU heatmap
    assert "127.0.0.1:9400:9400" in nodes[0]["ports"]


def test_prometheus_scrapes_rank0_and_grafana_provisioning_matches():
    c = compose()
    prom = c["services"]["prometheus"]
    config_path = next(a.split("=", 1)[1] for a in prom["command"] if a.startswith("--config.file="))
    mounts = {dst: src for src, dst in bind_mounts(prom)}
    assert mounts[config_path] == DOCKER / "prometheus" / "prometheus.yml"
    cfg = yaml.safe_load(mounts[config_path].read_text())
    (job,) = cfg["scrape_configs"]
    assert job["job_name"] == "eplb" and job.get("metrics_path", "/metrics") == "/metrics"
    (targets,) = [s["targets"] for s in job["static_configs"]]
    demo = demo_args(torchrun_args(c["services"]["node0"]["command"]).training_script_args)
    assert targets == [f"node0:{demo.metrics_port}"]

    graf = c["services"]["grafana"]
    gmounts = {dst: src for src, dst in bind_mounts(graf)}
    ds_dir = gmounts["/etc/grafana/provisioning/datasources"]
    (ds,) = [d for f in sorted(ds_dir.glob("*.yml")) for d in yaml.safe_load(f.read_text())["datasources"]]
    assert ds["type"] == "prometheus" and ds["isDefault"] is True
    port = 9090  # Prometheus' default --web.listen-address
    assert ds["url"] == f"http://prometheus:{port}" and "prometheus" in c["services"]
    assert ds["jsonData"]["timeInterval"] == job["scrape_interval"]
    db_dir = gmounts["/etc/grafana/provisioning/dashboards"]
    (provider,) = [p for f in sorted(db_dir.glob("*.yml")) for p in yaml.safe_load(f.read_text())["providers"]]
    dashboards = {dst: src for dst, src in gmounts.items()
                  if dst.startswith(provider["options"]["path"] + "/")}
    assert list(dashboards.values()) == [ROOT / "dashboards" / "eplb.json"]
    home = graf["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home in dashboards
    assert json.loads((ROOT / "dashboards" / "eplb.json").read_text())["uid"] == "eplb"


def test_scrape_config_passes_promtool():
    promtool = prometheus_tool("promtool")  # skips, or fails under EPLB_REQUIRE_PROMETHEUS=1
    r = subprocess.run([promtool, "check", "config", str(DOCKER / "prometheus" / "prometheus.yml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfile():
    text = (DOCKER / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"  # CPU by default
    assert args["TORCH_VERSION"] == "2.13.0"
    assert re.search(r'--index-url "\$\{TORCH_INDEX_URL\}" "torch==\$\{TORCH_VERSION\}"', text)
    for line in re.findall(r"^COPY (.+)$", text, re.M):
        for src in line.split()[:-1]:
            assert (ROOT / src).exists(), f"COPY source missing: {src}"
    entry = json.loads(re.search(r"^ENTRYPOINT (.+)$", text, re.M).group(1))
    assert entry == ["torchrun"]
    cmd = json.loads(re.search(r"^CMD (\[.+?\])$", text.replace("\\\n", " "), re.M | re.S).group(1))
    t = torchrun_args(cmd)
    assert t.training_script == "eplb.ops.demo"
    assert demo_args(t.training_script_args).metrics_host == "0.0.0.0"
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text()
    assert "!eplb/" in ignore and "!moe/" in ignore
