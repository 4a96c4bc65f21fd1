"""Render the panels of dashboards/eplb.json to a PNG from a live Prometheus, with
matplotlib, for documentation (no Grafana needed): each panel runs its own PromQL and is
drawn where its gridPos puts it.

    python dashboards/render.py --prometheus http://127.0.0.1:9090 --last 300 \
        --out docs/img/dashboard.png

Template variables are set as Grafana would set them: $job from the job variable's
label_values() query (all values), $window from --window, $__rate_interval from
--rate-interval (Grafana: 4 x the scrape interval). Needs matplotlib (`pip install
matplotlib`); this is a documentation tool, not part of the runtime.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.parse
import urllib.request
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent


def get(url: str, path: str, **params) -> dict:
    q = urllib.parse.urlencode(params, doseq=True)
    with urllib.request.urlopen(f"{url}{path}?{q}", timeout=30) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"{path} {params}: {body}")
    return body["data"]


def legend(fmt: str, labels: dict) -> str:
    if not fmt or fmt == "__auto":
        return ", ".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "__name__") or "value"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)


def substitute(text: str, variables: dict[str, str]) -> str:
    for name in sorted(variables, key=len, reverse=True):
        text = text.replace(name, variables[name])
    return text


def fmt_value(v: float, unit: str) -> str:
    if math.isnan(v):
        return "-"
    if unit == "percentunit":
        return f"{100 * v:.1f}%"
    if unit == "bytes":
        for scale, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
            if abs(v) >= scale:
                return f"{v / scale:.1f} {name}"
        return f"{v:.0f} B"
    if unit == "s":
        return f"{v * 1e3:.1f} ms" if abs(v) < 1 else f"{v:.1f} s"
    return f"{v:.0f}" if abs(v) >= 100 or float(v).is_integer() else f"{v:.2f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prometheus", required=True, help="base URL, e.g. http://127.0.0.1:9090")
    p.add_argument("--dashboard", type=Path, default=HERE / "eplb.json")
    p.add_argument("--last", type=float, default=300, help="seconds of history to draw")
    p.add_argument("--end", type=float, default=None, help="end time (unix seconds; default now)")
    p.add_argument("--step", default="1s", help="query_range resolution")
    p.add_argument("--window", default="1m", help="value of $window")
    p.add_argument("--rate-interval", default="4s", help="value of $__rate_interval")
    p.add_argument("--out", type=Path, default=Path("dashboard.png"))
    a = p.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt
    import numpy as np

    d = json.loads(a.dashboard.read_text())
    url = a.prometheus.rstrip("/")
    end = a.end or time.time()
    start = end - a.last
    variables = {"$__rate_interval": a.rate_interval, "$__interval": a.step, "$window": a.window}
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            metric, label = (s.strip() for s in
                             re.fullmatch(r"label_values\((.+),(.+)\)", query).groups())
            values = get(url, f"/api/v1/label/{label}/values", **{"match[]": metric})
            if not values:
                print(f"render: ${v['name']}: {query} found nothing", file=sys.stderr)
                return 1
            variables["$" + v["name"]] = "(" + "|".join(values) + ")"

    def seconds(duration: str) -> float:
        return float(duration[:-1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[duration[-1]]

    def query_range(expr: str, interval: str | None = None) -> list[dict]:
        # Grafana: the step ($__interval) is at least the panel's min interval
        step = substitute(interval, variables) if interval else a.step
        n = math.ceil(a.last / seconds(step))
        return get(url, "/api/v1/query_range",
                   query=substitute(expr, dict(variables, **{"$__interval": step})),
                   start=f"{end - n * seconds(step):.3f}", end=f"{end:.3f}", step=step)["result"]

    def series(result: dict):
        t = np.array([datetime.fromtimestamp(float(x)) for x, _ in result["values"]])
        y = np.array([float(v) for _, v in result["values"]])
        return t, y

    marks = []  # rebalance annotations: the start of each run of consecutive points
    for ann in d["annotations"]["list"]:
        for r in query_range(ann["expr"]):
            last = None
            for x, _ in r["values"]:
                x = float(x)
                if last is None or x - last > seconds(a.step) * 1.5:
                    marks.append(datetime.fromtimestamp(x))
                last = x

    panels = d["panels"]
    rows = max(q["gridPos"]["y"] + q["gridPos"]["h"] for q in panels)
    W, U = 22.0, 0.42  # figure width, height of one grid row (inches)
    top_margin = 0.5
    H = rows * U + top_margin
    fig = plt.figure(figsize=(W, H))
    time_fmt = mdates.DateFormatter("%H:%M:%S")

    def axes_for(g: dict, right_pad: float = 0.15):
        left, bottom_pad, top_pad = 0.65, 0.35, 0.3  # inches: tick labels and the title
        x0 = g["x"] / 24 * W + left
        w = g["w"] / 24 * W - left - right_pad
        y_top = H - top_margin - g["y"] * U - top_pad
        h = g["h"] * U - top_pad - bottom_pad
        return fig.add_axes([x0 / W, (y_top - h) / H, w / W, h / H])

    for panel in panels:
        g = panel["gridPos"]
        defaults = panel["fieldConfig"]["defaults"]
        unit = defaults.get("unit", "none")
        kind = panel["type"]
        overrides = {o["matcher"]["options"]: o for o in panel["fieldConfig"].get("overrides", [])
                     if o["matcher"]["id"] == "byFrameRefID"}
        ax = axes_for(g, right_pad=0.6 if overrides or kind == "heatmap" else 0.15)
        ax.set_title(substitute(panel["title"], {"$window": a.window}), fontsize=10, loc="left",
                     fontweight="bold")
        if kind in ("table", "bargauge"):
            target = panel["targets"][0]
            result = get(url, "/api/v1/query", query=substitute(target["expr"], variables),
                         time=f"{end:.3f}")["result"]
            matrix = next((t["options"] for t in panel.get("transformations", [])
                           if t["id"] == "groupingToMatrix"), None)
            if kind == "table" and matrix is not None:  # a heatmap: rows x columns at `end`
                rows_of = sorted({int(r["metric"][matrix["rowField"]]) for r in result})
                cols_of = sorted({int(r["metric"][matrix["columnField"]]) for r in result})
                if result:
                    m = np.full((len(rows_of), len(cols_of)), np.nan)
                    for r in result:
                        m[rows_of.index(int(r["metric"][matrix["rowField"]])),
                          cols_of.index(int(r["metric"][matrix["columnField"]]))] = float(r["value"][1])
                    im = ax.imshow(m, aspect="auto", cmap="YlOrRd", interpolation="nearest")
                    ax.set_xlabel(matrix["columnField"].upper(), fontsize=8)
                    ax.set_ylabel(matrix["rowField"], fontsize=8)
                    ax.tick_params(labelsize=7)
                    cb = fig.colorbar(im, ax=ax, pad=0.01, fraction=0.03)
                    cb.set_label("tokens / step", fontsize=8)
                    cb.ax.tick_params(labelsize=7)
                else:
                    ax.set_axis_off()
                    ax.text(0.5, 0.5, "no data (opt-in metric not enabled)", ha="center",
                            va="center", transform=ax.transAxes, fontsize=10, color="gray")
            elif kind == "table":
                ax.set_axis_off()
                cols = ["job", "instance", "version", "policy", "num_nodes", "num_gpus",
                        "num_layers", "num_slots"]
                cells = [[r["metric"].get(c, "") for c in cols] for r in result]
                if cells:
                    tab = ax.table(cellText=cells, colLabels=cols, loc="center", cellLoc="left")
                    tab.auto_set_font_size(False)
                    tab.set_fontsize(9)
                    tab.scale(1, 1.5)
            else:
                result = sorted(result, key=lambda r: -float(r["value"][1]))
                names = [legend(target["legendFormat"], r["metric"]) for r in result]
                vals = [float(r["value"][1]) for r in result]
                ax.barh(range(len(vals)), vals, color="tab:green")
                ax.set_yticks(range(len(vals)), names, fontsize=7)
                ax.invert_yaxis()
                ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
                ax.tick_params(axis="x", labelsize=8)
            continue
        if kind == "stat":
            results = query_range(panel["targets"][0]["expr"], panel.get("interval"))
            ax.set_xticks([])
            ax.set_yticks([])
            if results:
                t, y = series(results[0])
                ok = ~np.isnan(y)
                last = y[ok][-1] if ok.any() else float("nan")
                ax.fill_between(t, np.nan_to_num(y), color="tab:green", alpha=0.15)
                ax.text(0.5, 0.45, fmt_value(last, unit), transform=ax.transAxes, ha="center",
                        va="center", fontsize=22, fontweight="bold", color="tab:green")
            continue
        if kind == "heatmap":
            target = panel["targets"][0]
            results = sorted(query_range(target["expr"], panel.get("interval")),
                             key=lambda r: int(legend(target["legendFormat"], r["metric"])))
            if results:
                ts = sorted({float(x) for r in results for x, _ in r["values"]})
                index = {x: i for i, x in enumerate(ts)}
                m = np.full((len(results), len(ts)), np.nan)
                for row, r in enumerate(results):
                    for x, v in r["values"]:
                        m[row, index[float(x)]] = float(v)
                t0, t1 = (mdates.date2num(datetime.fromtimestamp(x)) for x in (ts[0], ts[-1]))
                im = ax.imshow(m, aspect="auto", origin="lower", cmap="Oranges",
                               extent=(t0, t1, -0.5, len(results) - 0.5), interpolation="nearest")
                ax.set_yticks(range(len(results)),
                              [legend(target["legendFormat"], r["metric"]) for r in results])
                ax.set_ylabel("GPU", fontsize=8)
                ax.xaxis_date()
                cb = fig.colorbar(im, ax=ax, pad=0.01, fraction=0.03)
                cb.set_label("tokens / step", fontsize=8)
                cb.ax.tick_params(labelsize=7)
            ax.xaxis.set_major_formatter(time_fmt)
            ax.tick_params(labelsize=8)
            continue
        # timeseries: colour per label set when every query returns the same label sets
        # (p50 / p99 of one phase share a colour), line style per query
        custom = defaults.get("custom", {})
        bars = custom.get("drawStyle") == "bars"
        points = custom.get("showPoints") == "always"
        per_target = [sorted(query_range(t["expr"], panel.get("interval")),
                             key=lambda r: sorted(r["metric"].items()))
                      for t in panel["targets"]]
        keys = [[tuple(sorted(r["metric"].items())) for r in rs] for rs in per_target]
        shared = len(keys) > 1 and all(k == keys[0] for k in keys) and not overrides
        right = ax.twinx() if overrides else None
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        n = 0
        for i, (target, results) in enumerate(zip(panel["targets"], per_target)):
            axis = right if target["refId"] in overrides else ax
            base: dict = {}  # stacked bars: height so far at each time
            for j, r in enumerate(results):
                t, y = series(r)
                name = legend(target["legendFormat"], r["metric"])
                color = colors[(j if shared else n) % len(colors)]
                n += 1
                if bars:
                    width = (seconds(substitute(panel.get("interval") or a.step, variables))
                             / 86400 * 0.8)
                    bottom = np.array([base.get(x, 0.0) for x in t])
                    # a bar covers the interval ending at its time
                    axis.bar(t, y, width=-width, bottom=bottom, label=name, color=color,
                             align="edge")
                    base.update(zip(t, bottom + y))
                else:
                    axis.plot(t, y, label=name, color=color,
                              linewidth=2.5 if name == "overall" else 1.2,
                              linestyle="--" if (shared and i) or axis is right else "-",
                              marker="o" if points else None, markersize=3)
        lo, hi = defaults.get("min"), defaults.get("max")
        if lo is not None or hi is not None:  # a little headroom: a line at max stays visible
            ax.set_ylim(bottom=lo, top=None if hi is None else hi + 0.02 * (hi - (lo or 0)))
        if unit == "percentunit":
            ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        elif unit in ("bytes", "s"):
            ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
                lambda v, _, u=unit: fmt_value(v, u)))
        if defaults.get("decimals") == 0:
            ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        for mark in marks:
            ax.axvline(mark, color="orange", alpha=0.5, linewidth=0.8, zorder=0)
        ax.set_xlim(datetime.fromtimestamp(start), datetime.fromtimestamp(end))
        ax.xaxis.set_major_formatter(time_fmt)
        ax.tick_params(labelsize=8)
        handles, labels = ax.get_legend_handles_labels()
        if right is not None:
            right.tick_params(labelsize=8)
            right.set_ylim(bottom=0)
            right.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
            h2, l2 = right.get_legend_handles_labels()
            handles, labels = handles + h2, labels + l2
        if handles:
            ax.legend(handles, labels, fontsize=7, ncol=min(4, len(labels)), loc="lower left",
                      framealpha=0.7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{d['title']}: {len(panels)} panels rendered from Prometheus by "
                 f"dashboards/render.py ($window={a.window}; orange lines: rebalances)",
                 fontsize=12, x=0.01, y=1 - 0.12 / H, ha="left", va="top")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=80)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
