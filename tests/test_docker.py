"""docker/: what can be checked without a Docker daemon. The compose file parses, every file
it mounts or builds from exists, the node commands are valid torchrun and demo command
lines (parsed by torchrun's and the demo's own parsers), Prometheus scrapes the port rank 0
serves on, and Grafana's provisioning points at that Prometheus and at the dashboard.
The scrape config itself runs in a real Prometheus in tests/test_prometheus.py."""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "docker-compose.yml"


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
    from eplb.demo import add_demo_arguments, check_demo_arguments

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


def test_two_node_job_commands():
    c = compose()
    nodes = [c["services"]["node0"], c["services"]["node1"]]
    parsed = [torchrun_args(n["command"]) for n in nodes]
    for rank, (node, t) in enumerate(zip(nodes, parsed)):
        assert node["hostname"] == f"node{rank}"
        assert t.nnodes == "2" and t.nproc_per_node == "2" and t.node_rank == rank
        assert t.rdzv_backend == "c10d" and t.rdzv_endpoint == "node0:29400"
        assert t.module and t.training_script == "eplb.demo"
        assert t.local_addr == f"node{rank}"  # c10d sorts nodes by it: rank 0 on node0
    assert sorted(t.local_addr for t in parsed)[0] == "node0"
    assert parsed[0].rdzv_id == parsed[1].rdzv_id
    # every rank must run the same demo (metrics attach collectively on all of them)
    assert parsed[0].training_script_args == parsed[1].training_script_args
    demo = demo_args(parsed[0].training_script_args)
    assert demo.metrics_port == 9400 and demo.metrics_host == "0.0.0.0"
    assert demo.metrics_replicas  # the dashboard's opt-in replica panels have data
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
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("`promtool` is not on PATH (it comes with Prometheus: apt-get install "
                    "prometheus; .ci/run does)", pytrace=False)
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
    assert t.training_script == "eplb.demo"
    assert demo_args(t.training_script_args).metrics_host == "0.0.0.0"
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text()
    assert "!eplb/" in ignore and "!moe/" in ignore
