"""The Grafana dashboard: committed JSON == generator output, and the JSON is an importable
dashboard whose every panel queries Prometheus through the `${datasource}` variable.
(That every query returns data from a real run is tests/test_prometheus.py.)"""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "dashboards" / "eplb.json"

# the metric names eplb exports (eplb/ops/metrics.py); the dashboard shows every one of them
METRICS = {
    "eplb_balancedness_ratio", "eplb_balancedness_overall_ratio", "eplb_gpu_load_tokens",
    "eplb_rebalances_total", "eplb_rebalance_duration_seconds", "eplb_experts_moved_total",
    "eplb_bytes_moved_total", "eplb_rebalance_balancedness_ratio", "eplb_expert_replicas",
    "eplb_load_window_fill_ratio", "eplb_placement_age_seconds", "eplb_steps_total", "eplb_info",
    "eplb_gpu_layer_load_tokens", "eplb_rebalance_layers_ratio", "eplb_rebalance_move_tolerance",
}


def load_generator():
    spec = importlib.util.spec_from_file_location("eplb_dashboard_generate",
                                                  ROOT / "dashboards" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def exprs(d: dict) -> list[str]:
    """Every PromQL expression: panel targets, annotations, query variables."""
    out = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
    out += [a["expr"] for a in d["annotations"]["list"] if "expr" in a]
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            out.append(v["query"]["query"] if isinstance(v["query"], dict) else v["query"])
    return out


def test_committed_json_is_the_generator_output():
    gen = load_generator()
    assert DASHBOARD.read_text() == gen.render(), \
        "dashboards/eplb.json is stale: run python dashboards/generate.py"
    assert gen.main(["--check"]) == 0


def test_dashboard_identity_and_datasource_variable():
    d = dashboard()
    assert d["uid"] == "eplb" and d["title"] and d["id"] is None
    assert isinstance(d["schemaVersion"], int) and d["schemaVersion"] >= 36
    variables = {v["name"]: v for v in d["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    # the job variable is resolved through the same data source
    assert variables["job"]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    assert variables["window"]["type"] == "interval"
    for a in d["annotations"]["list"]:
        assert a["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def test_every_panel_queries_prometheus_and_has_a_grid_position():
    d = dashboard()
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) and len(ids) >= 10
    cells = set()
    for p in d["panels"]:
        assert p["title"], p
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], f"panel {p['title']!r} has no query"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip(), f"panel {p['title']!r}: empty expr"
            assert t["datasource"] == p["datasource"], p["title"]
            assert 'job=~"$job"' in t["expr"], f"panel {p['title']!r} ignores $job"
        g = p["gridPos"]
        assert set(g) == {"h", "w", "x", "y"} and all(isinstance(v, int) for v in g.values())
        assert g["w"] >= 1 and g["h"] >= 1 and 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):  # no two panels overlap
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {p['title']!r} overlaps another"
                cells.add((x, y))


def test_panels_cover_the_issue_and_every_metric():
    d = dashboard()
    by_type: dict[str, list[str]] = {}
    for p in d["panels"]:
        by_type.setdefault(p["type"], []).append(" ".join(t["expr"] for t in p["targets"]))
    assert any("eplb_gpu_load_tokens" in e and "by (gpu)" in e for e in by_type["heatmap"])
    for p in d["panels"]:
        if p["type"] == "heatmap":  # "heatmap" format would de-accumulate the GPU rows as le buckets
            assert all(t.get("format", "time_series") == "time_series" for t in p["targets"])
            assert p["options"]["calculate"] is False
    joined = "\n".join(exprs(d))
    assert "histogram_quantile(" in joined and "eplb_rebalance_duration_seconds_bucket" in joined
    assert "increase(eplb_rebalances_total" in joined
    used = {re.sub(r"_(bucket|sum|count)$", "", m) for m in re.findall(r"\beplb_[a-z_]+", joined)}
    assert used == METRICS, f"missing: {METRICS - used}, unknown: {used - METRICS}"


def test_promql_is_balanced():
    """Cheap syntax sanity (the real parser is Prometheus, in test_prometheus.py)."""
    for e in exprs(dashboard()):
        for o, c in ("()", "[]", "{}"):
            assert e.count(o) == e.count(c), e
        assert e.count('"') % 2 == 0, e


def test_layer_by_gpu_heatmap_of_the_opt_in_metric():
    """The per-layer load per GPU: a layer x GPU matrix (rows layers, columns GPUs, coloured
    cells) at the latest scrape, from the opt-in eplb_gpu_layer_load_tokens, saying so."""
    from eplb.ops.metrics import EplbMetrics

    d = dashboard()
    (p,) = [p for p in d["panels"] if any("eplb_gpu_layer_load_tokens" in t["expr"]
                                           for t in p["targets"])]
    (t,) = p["targets"]
    assert t["expr"] == 'sum by (layer, gpu) (eplb_gpu_layer_load_tokens{job=~"$job"})'
    assert t["instant"] is True and t["format"] == "table"
    assert p["type"] == "table"
    ids = [x["id"] for x in p["transformations"]]
    assert ids.index("convertFieldType") < ids.index("groupingToMatrix") < ids.index("sortBy")
    grouping = p["transformations"][ids.index("groupingToMatrix")]["options"]
    assert (grouping["rowField"], grouping["columnField"], grouping["valueField"]) == ("layer", "gpu", "Value")
    # groupingToMatrix names its first column "<rowField>\\<columnField>": rows sorted by layer
    assert p["transformations"][ids.index("sortBy")]["options"]["sort"] == [{"field": "layer\\gpu"}]
    assert p["fieldConfig"]["defaults"]["custom"]["cellOptions"]["type"] == "color-background"
    # the note: opt-in, how to turn it on (the constructor argument that exists), its cost
    assert "opt-in" in p["title"] and "per_layer_gpu_load=True" in p["description"]
    assert "L x M series" in p["description"] and "--metrics-per-layer" in p["description"]
    import inspect

    assert "per_layer_gpu_load" in inspect.signature(EplbMetrics).parameters
