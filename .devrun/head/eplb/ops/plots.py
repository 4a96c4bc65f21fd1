"""The figures of `eplb simulate --plot` (matplotlib, Agg backend, PNG files): the one
module that draws, so the pure core returns data only (issue 31).

- plot_simulation: a balancedness replay (eplb.core.simulate): imbalance per step and the
  moves of every rebalance;
- plot_scale: a cost replay (eplb.core.scale) at several EP sizes: tokens/s and the gain
  over the static placement.

matplotlib is optional (the `plot` extra); it is imported only when a figure is drawn.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from eplb.core.scale import ScaleResult
    from eplb.core.simulate import SimulationResult


def _pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_simulation(result: SimulationResult, path: str | Path, title: str = "",
                    step_label: str = "step") -> None:
    """PNG: imbalance per step (policies, none, oracles) and, per rebalance, slots changed
    (light bars) and experts received from another GPU (dark bars), as % of all slots."""
    plt = _pyplot()
    cfg = result.config
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True,
                                   gridspec_kw={"height_ratios": [3, 2]})
    steps = np.arange(cfg["steps"])
    start = cfg["start"]
    ax1.plot(steps[start:], result.none.scored, color="0.5", ls="--", marker=".", label="none (static)")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = list(result.policies)
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        c = colors[i % len(colors)]
        res = result.policies[name]
        ax1.plot(steps[start:], res.scored, color=c, marker="o", ms=3,
                 label=f"{name} (mean {res.summary()['mean']:.3f})")
        if name in result.oracle:
            o = result.oracle[name]
            ax1.plot(steps[start:], o.scored, color=c, ls=":",
                     label=f"oracle:{name} (mean {o.summary()['mean']:.3f})")
        at = np.array([r.step for r in res.rebalances])
        changed = np.array([100 * r.slots_changed for r in res.rebalances]) / res.total_slots
        remote = np.array([100 * r.experts_moved for r in res.rebalances]) / res.total_slots
        x = at + (i - (len(names) - 1) / 2) * width * cfg["interval"]
        ax2.bar(x, changed, width=width * cfg["interval"], color=c, alpha=0.35,
                label=f"{name}: slots changed")
        ax2.bar(x, remote, width=width * cfg["interval"], color=c, label=f"{name}: received remotely")
    ax1.axhline(1.0, color="k", lw=0.5)
    ax1.set_ylabel("max/mean GPU load\n(mean over layers)")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    ax1.set_title(title or (f"{cfg['num_gpus']} GPUs, {cfg['num_slots']} slots, window {cfg['window']}, "
                            f"interval {cfg['interval']}, decay {cfg['decay']:g}"), fontsize=10)
    ax2.set_ylabel("moved per rebalance\n(% of all slots)")
    ax2.set_xlabel(step_label)
    ax2.legend(fontsize=7, ncol=2 * len(names), loc="upper left")
    ax2.set_ylim(0, 100 + 12 * (1 + (2 * len(names) > 4)))  # headroom for the legend
    ax2.set_yticks([0, 20, 40, 60, 80, 100])
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_scale(results: Sequence[ScaleResult], path: str | Path, title: str = "") -> None:
    """tokens/s against EP size, one line per placement kind (matplotlib, Agg)."""
    plt = _pyplot()

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    Ms = [r.config["num_gpus"] for r in results]
    for name in results[0].rows:
        ax.plot(Ms, [r.rows[name].tokens_per_s for r in results], marker="o", label=name)
        ax2.plot(Ms, [100 * r.gain_over_static(name) for r in results], marker="o", label=name)
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xticks(Ms, [str(m) for m in Ms])
        a.set_xlabel("expert-parallel GPUs (EP)")
        a.grid(alpha=0.3)
    ax.set_ylabel("tokens/s (MoE layers only)")
    ax2.set_ylabel("gain over static (%)")
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
