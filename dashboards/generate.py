"""Generate the Grafana dashboard for eplb's Prometheus metrics: dashboards/eplb.json.

    python dashboards/generate.py            # rewrite dashboards/eplb.json
    python dashboards/generate.py --check    # exit 1 if the committed file is stale

Plain Python dicts, no dependency: the dashboard is a dozen panels, and Grafana's JSON
model is what users import, diff and review anyway. tests/test_dashboard.py checks that the
committed JSON equals this script's output, and tests/test_prometheus.py runs every PromQL
expression in it against a real Prometheus scraping a real demo run.

Template variables: `datasource` (any Prometheus data source), `job` (the scrape jobs that
export `eplb_info`) and `window` (the range that rebalance counts and durations are taken
over: rebalances are rare events, minutes apart in production, so a rate over Grafana's
`$__rate_interval` would mostly be empty).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "eplb.json"

UID = "eplb"
TITLE = "EPLB: expert-parallel load balancing"
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'job=~"$job"'  # every query is restricted to the selected scrape jobs


def target(expr: str, legend: str = "", ref: str = "A", **extra) -> dict:
    t = {"datasource": DS, "expr": expr, "legendFormat": legend or "__auto", "range": True,
         "refId": ref}
    t.update(extra)
    return t


def instant(expr: str, legend: str = "", ref: str = "A", fmt: str = "time_series") -> dict:
    return target(expr, legend, ref, range=False, instant=True, format=fmt)


class Layout:
    """Left-to-right, top-to-bottom placement on Grafana's 24-column grid."""

    def __init__(self) -> None:
        self.x = self.y = self.row_h = 0
        self.next_id = 1

    def place(self, panel: dict, w: int, h: int) -> dict:
        if self.x + w > 24:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        panel["gridPos"] = {"h": h, "w": w, "x": self.x, "y": self.y}
        panel["id"] = self.next_id
        self.next_id += 1
        self.x += w
        self.row_h = max(self.row_h, h)
        return panel


def panel(kind: str, title: str, description: str, targets: list[dict], unit: str = "none",
          *, min_=None, max_=None, options: dict | None = None, custom: dict | None = None,
          overrides: list | None = None, decimals: int | None = None) -> dict:
    defaults: dict = {"unit": unit}
    if min_ is not None:
        defaults["min"] = min_
    if max_ is not None:
        defaults["max"] = max_
    if decimals is not None:
        defaults["decimals"] = decimals
    if custom:
        defaults["custom"] = custom
    p = {"type": kind, "title": title, "description": description, "datasource": DS,
         "targets": targets, "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
         "options": options or {}}
    return p


def timeseries(title: str, description: str, targets: list[dict], unit: str = "none", *,
               bars: bool = False, stack: bool = False, **kw) -> dict:
    custom = {"drawStyle": "bars" if bars else "line", "lineWidth": 1,
              "fillOpacity": 80 if bars else 10, "showPoints": "never", "spanNulls": False,
              "stacking": {"mode": "normal" if stack else "none", "group": "A"}}
    options = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
               "tooltip": {"mode": "multi", "sort": "desc"}}
    return panel("timeseries", title, description, targets, unit, custom=custom,
                 options=options, **kw)


def stat(title: str, description: str, targets: list[dict], unit: str = "none", **kw) -> dict:
    options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
               "colorMode": "value", "graphMode": "area", "textMode": "auto",
               "justifyMode": "auto", "orientation": "auto"}
    return panel("stat", title, description, targets, unit, options=options, **kw)


def thresholds(*steps: tuple) -> dict:
    """Grafana thresholds from (value, color) pairs; the first value is the base (None)."""
    return {"mode": "absolute",
            "steps": [{"color": c, "value": v} for v, c in steps]}


def build() -> dict:
    lay = Layout()
    panels: list[dict] = []

    def add(p: dict, w: int, h: int) -> None:
        panels.append(lay.place(p, w, h))

    bal_thresholds = thresholds((None, "red"), (0.8, "orange"), (0.9, "green"))

    # ---- top line: what is running and how it is doing now --------------------------------
    info = panel(
        "table", "Job",
        "eplb_info: version, policy and sizes of each job (one row per scrape target).",
        [instant(f"eplb_info{{{SEL}}}", fmt="table")],
        options={"showHeader": True, "cellHeight": "sm"})
    info["transformations"] = [{"id": "organize", "options": {
        "excludeByName": {"Time": True, "Value": True, "__name__": True},
        "indexByName": {"job": 0, "instance": 1, "version": 2, "policy": 3, "num_nodes": 4,
                        "num_gpus": 5, "num_layers": 6, "num_slots": 7}}}]
    add(info, 12, 4)
    b = stat("Balancedness now",
             "Mean over layers of mean GPU load / max GPU load in the latest step "
             "(1.0 = perfect).",
             [target(f"avg by (job) (eplb_balancedness_overall_ratio{{{SEL}}})", "{{job}}")],
             "percentunit", min_=0, max_=1, decimals=1)
    b["fieldConfig"]["defaults"]["thresholds"] = bal_thresholds
    add(b, 4, 4)
    add(stat("Steps / s", "Forward steps the job runs per second (eplb_steps_total).",
             [target(f"sum by (job) (rate(eplb_steps_total{{{SEL}}}[$__rate_interval]))",
                     "{{job}}")], "none", decimals=1), 4, 4)
    add(stat("Rebalances in $window", "Rebalances finished in the selected window, any "
             "trigger and outcome.",
             [target(f"sum by (job) (increase(eplb_rebalances_total{{{SEL}}}[$window]))",
                     "{{job}}")], "none", decimals=0), 4, 4)

    # ---- balance ------------------------------------------------------------------------
    add(timeseries(
        "Balancedness (overall and per layer)",
        "Mean GPU load / max GPU load per MoE layer in the latest step; 'overall' is the "
        "mean over layers. The step time of a layer is set by its busiest GPU, so 1 / this "
        "is the slowdown against perfect balance. Vertical markers are rebalances.",
        [target(f"eplb_balancedness_overall_ratio{{{SEL}}}", "overall", "A"),
         target(f"eplb_balancedness_ratio{{{SEL}}}", "layer {{layer}}", "B")],
        "percentunit", max_=1,
        overrides=[{"matcher": {"id": "byName", "options": "overall"},
                    "properties": [{"id": "custom.lineWidth", "value": 3},
                                   {"id": "color", "value": {"mode": "fixed",
                                                             "fixedColor": "green"}}]}]),
        12, 9)
    heat = panel(
        "heatmap", "Load per GPU (tokens)",
        "Tokens routed to each GPU (EP rank) in the latest step, summed over layers: one row "
        "per GPU. A row that stays hot is a GPU holding hot experts; after a rebalance the "
        "rows even out.",
        # format time_series, not "heatmap": Grafana's heatmap format treats series as
        # cumulative `le` buckets and subtracts neighbours; here each series is one row
        [target(f"sum by (gpu) (eplb_gpu_load_tokens{{{SEL}}})", "{{gpu}}", format="time_series")],
        "none",
        options={"calculate": False, "cellGap": 1,
                 "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64,
                           "exponent": 0.5, "fill": "dark-orange", "reverse": False,
                           "scale": "exponential"},
                 "yAxis": {"axisPlacement": "left", "reverse": False, "unit": "none",
                           "axisLabel": "GPU"},
                 "rowsFrame": {"layout": "unknown", "value": "tokens"},
                 "legend": {"show": True}, "tooltip": {"mode": "single", "yHistogram": False},
                 "cellValues": {"unit": "none"}, "exemplars": {"color": "rgba(255,0,255,0.7)"},
                 "filterValues": {"le": 1e-9}})
    heat["fieldConfig"]["defaults"]["custom"] = {"scaleDistribution": {"type": "linear"},
                                                  "hideFrom": {"legend": False, "tooltip": False,
                                                               "viz": False}}
    add(heat, 12, 9)

    # ---- rebalances ---------------------------------------------------------------------
    # counts of rare events: one bar per $__interval, and panel.interval ("Min interval")
    # = $window keeps that at least $window wide, so every bar spans several scrapes
    reb = timeseries(
        "Rebalances",
        "Rebalances finished in each bar's interval ($window or wider on long time ranges), "
        "by trigger (interval, request, api, initial, shift, resize) and outcome (success, failure, skipped).",
        [target(f"sum by (trigger, outcome) (increase(eplb_rebalances_total{{{SEL}}}[$__interval])) > 0",
                "{{trigger}} / {{outcome}}")],
        "none", bars=True, stack=True, min_=0, decimals=0)
    reb["interval"] = "$window"
    add(reb, 8, 8)
    add(timeseries(
        "Rebalance duration by phase",
        "p50 and p99 over $window of each phase: plan (rank 0 runs the policy), transfer "
        "(expert weights moved between GPUs), commit (maps rewritten), total.",
        [target("histogram_quantile(0.5, sum by (le, phase) "
                f"(rate(eplb_rebalance_duration_seconds_bucket{{{SEL}}}[$window])))",
                "p50 {{phase}}", "A"),
         target("histogram_quantile(0.99, sum by (le, phase) "
                f"(rate(eplb_rebalance_duration_seconds_bucket{{{SEL}}}[$window])))",
                "p99 {{phase}}", "B")],
        "s", min_=0), 8, 8)
    add(timeseries(
        "Balancedness before / after the last rebalance",
        "Planner's view of the load window at the last rebalance: balancedness of the old "
        "placement (before) and predicted for the new one (after).",
        [target(f"eplb_rebalance_balancedness_ratio{{{SEL}}}", "{{when}}")],
        "percentunit", max_=1), 8, 8)

    moved = timeseries(
        "Experts and bytes moved",
        "Expert replicas copied from another GPU, and their bytes, in each interval ($window "
        "or wider on long time ranges); copies inside one GPU are not counted.",
        [target(f"sum by (job) (increase(eplb_bytes_moved_total{{{SEL}}}[$__interval]))",
                "bytes {{job}}", "A"),
         target(f"sum by (job) (increase(eplb_experts_moved_total{{{SEL}}}[$__interval]))",
                "experts {{job}}", "B")],
        "bytes", min_=0,
        overrides=[{"matcher": {"id": "byFrameRefID", "options": "B"},
                    "properties": [{"id": "unit", "value": "none"},
                                   {"id": "custom.axisPlacement", "value": "right"}]}])
    moved["fieldConfig"]["defaults"]["custom"]["showPoints"] = "always"
    moved["interval"] = "$window"
    add(moved, 8, 8)
    add(timeseries(
        "Replicated experts per layer (opt-in metric)",
        "Experts with more than one replica, per layer, from eplb_expert_replicas (exported "
        "only when per-expert metrics are enabled: L x N series).",
        [target(f"count by (layer) (eplb_expert_replicas{{{SEL}}} > 1)", "layer {{layer}}")],
        "none", min_=0, decimals=0), 8, 8)
    add(panel(
        "bargauge", "Most replicated experts now (opt-in metric)",
        "The 16 (layer, expert) pairs with the most replicas in the current placement.",
        [instant(f"topk(16, eplb_expert_replicas{{{SEL}}})", "layer {{layer}} expert {{expert}}")],
        "none", min_=0, decimals=0,
        options={"orientation": "horizontal", "displayMode": "basic", "showUnfilled": True,
                 "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}),
        8, 8)

    # ---- state of the load window, how plans are made, and the placement ----------------
    add(timeseries(
        "Load window fill",
        "Share of the planner's load window holding recorded steps: it reaches 100% "
        "window_size steps after start; a plan made before that sees less history.",
        [target(f"eplb_load_window_fill_ratio{{{SEL}}}", "{{job}}")],
        "percentunit", min_=0, max_=1), 8, 7)
    how = timeseries(
        "How the last plan was made",
        "Share of the layers the last planned rebalance planned with earlier steady windows "
        "(a steady load: more tokens, less routing noise) or on the window's drift trend (a "
        "drifting load), and the move tolerance it used (right axis: the config's on a steady "
        "load, 0 after a load shift or on a drift). All 0 on a load that shifts.",
        [target(f"eplb_rebalance_layers_ratio{{{SEL}}}", "{{basis}}", "A"),
         target(f"eplb_rebalance_move_tolerance{{{SEL}}}", "move tolerance", "B")],
        "percentunit", min_=0,
        overrides=[{"matcher": {"id": "byFrameRefID", "options": "B"},
                    "properties": [{"id": "unit", "value": "none"},
                                   {"id": "custom.axisPlacement", "value": "right"}]}])
    add(how, 8, 7)
    add(timeseries(
        "Placement age",
        "Seconds since the current placement was committed (resets at every rebalance).",
        [target(f"eplb_placement_age_seconds{{{SEL}}}", "{{job}}")],
        "s", min_=0), 8, 7)

    # ---- opt-in: load per layer and GPU (eplb_gpu_layer_load_tokens, L x M series) -------
    # Grafana's heatmap panel always has time on its x axis; a layer x GPU heatmap at the
    # latest scrape is a matrix table with coloured cells: layers as rows, GPUs as columns
    matrix = panel(
        "table", "Load per layer and GPU now (opt-in metric)",
        "Heatmap of token-expert assignments per step routed to each GPU (columns) in each MoE "
        "layer (rows), mean over the last metrics interval, from eplb_gpu_layer_load_tokens. "
        "Needs the opt-in per-layer metric: EplbMetrics(..., per_layer_gpu_load=True) on every "
        "rank (the demo: --metrics-per-layer); it exports L x M series (61 layers x 256 GPUs = "
        "15,616), so it is off by default and this panel stays empty without it. A dark cell "
        "is a GPU that is the bottleneck of that layer; compare with 'Load per GPU', which "
        "sums the layers and can hide one layer's hot GPU.",
        [instant(f"sum by (layer, gpu) (eplb_gpu_layer_load_tokens{{{SEL}}})", fmt="table")],
        "none", min_=0, decimals=0,
        options={"showHeader": True, "cellHeight": "sm", "footer": {"show": False}})
    matrix["fieldConfig"]["defaults"]["custom"] = {
        "align": "center", "cellOptions": {"type": "color-background", "mode": "gradient"},
        "displayMode": "color-background"}  # displayMode: the same for Grafana 9
    matrix["fieldConfig"]["defaults"]["color"] = {"mode": "continuous-YlRd"}
    matrix["transformations"] = [
        {"id": "convertFieldType", "options": {"conversions": [
            {"targetField": "layer", "destinationType": "number"},
            {"targetField": "gpu", "destinationType": "number"}], "fields": {}}},
        {"id": "groupingToMatrix", "options": {"rowField": "layer", "columnField": "gpu",
                                               "valueField": "Value", "emptyValue": "null"}},
        {"id": "sortBy", "options": {"fields": {}, "sort": [{"field": "layer\\gpu"}]}},
    ]
    add(matrix, 24, 9)

    annotations = {"list": [{
        "datasource": DS, "enable": True, "hide": False, "iconColor": "orange",
        "name": "Rebalances",
        "expr": f"sum by (trigger, outcome) (increase(eplb_rebalances_total{{{SEL}}}[$__rate_interval])) > 0",
        "step": "$__interval", "titleFormat": "rebalance",
        "textFormat": "trigger {{trigger}}, outcome {{outcome}}", "useValueForTime": False,
    }]}
    templating = {"list": [
        {"name": "datasource", "label": "Data source", "type": "datasource",
         "query": "prometheus", "current": {}, "hide": 0, "includeAll": False, "multi": False,
         "options": [], "refresh": 1, "regex": "", "skipUrlSync": False},
        {"name": "job", "label": "Job", "type": "query", "datasource": DS,
         "definition": "label_values(eplb_info, job)",
         "query": "label_values(eplb_info, job)",  # string form: every Grafana version reads it
         "current": {}, "hide": 0, "includeAll": True, "allValue": ".+", "multi": True,
         "options": [], "refresh": 2, "regex": "", "skipUrlSync": False, "sort": 1},
        {"name": "window", "label": "Rebalance window", "type": "interval",
         "query": "1m,5m,15m,1h,6h,1d", "current": {"selected": True, "text": "15m", "value": "15m"},
         "options": [{"selected": v == "15m", "text": v, "value": v}
                     for v in ("1m", "5m", "15m", "1h", "6h", "1d")],
         "auto": False, "auto_count": 30, "auto_min": "10s", "hide": 0, "refresh": 2,
         "skipUrlSync": False},
    ]}
    return {
        "__requires": [{"type": "datasource", "id": "prometheus", "name": "Prometheus",
                        "version": "1.0.0"}],
        "annotations": annotations,
        "description": "Expert-parallel load balancing of MoE models: balance per layer and "
                       "GPU, rebalances, their cost, and the placement (metrics of eplb's "
                       "rank 0 /metrics endpoint).",
        "editable": True,
        "graphTooltip": 1,
        "id": None,
        "links": [],
        "panels": panels,
        "refresh": "10s",
        "schemaVersion": 39,
        "tags": ["eplb", "moe"],
        "templating": templating,
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "title": TITLE,
        "uid": UID,
        "version": 1,
    }


def render() -> str:
    """The file's exact text: sorted keys, 2-space indent, trailing newline."""
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if dashboards/eplb.json is stale")
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args(argv)
    text = render()
    if a.check:
        if not a.out.is_file() or a.out.read_text() != text:
            print(f"{a.out} is stale: run python dashboards/generate.py", file=sys.stderr)
            return 1
        return 0
    a.out.write_text(text)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
