"""PNG plots of ``python -m benchmarks`` results (matplotlib), written next to the JSON.

``plot(payload, json_path)`` draws the figure of one op's payload into
``<json stem>.png`` and returns the paths written (none for an op without a
figure). One drawing function per op, registered in ``PLOTTERS``; each takes the
payload and a pair of axes. ``python -m benchmarks.plots results/*.json`` redraws
figures from saved results.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MIB = 2 ** 20


def _axes(ncols: int, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, ncols, figsize=(5.5 * ncols, 4), layout="constrained",
                             squeeze=False)
    fig.suptitle(title, fontsize=9)
    return fig, list(axes[0])


def _log2x(ax, xs, label):
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(xs), [str(x) for x in xs])
    ax.minorticks_off()
    ax.set_xlabel(label)


def _bars(ax, labels, groups: dict[str, list], ylabel: str, errors: dict[str, list] | None = None):
    """Grouped bars: one group per label, one bar per key of ``groups`` (None: no bar).

    ``errors``: per key, ``(low, high)`` pairs drawn as min..max whiskers."""
    import numpy as np
    width = 0.8 / max(len(groups), 1)
    x = np.arange(len(labels))
    for i, (name, values) in enumerate(groups.items()):
        vals = [float("nan") if v is None else v for v in values]
        yerr = None
        if errors and name in errors:
            lo = [0 if e is None or v is None else v - e[0] for v, e in zip(values, errors[name])]
            hi = [0 if e is None or v is None else e[1] - v for v, e in zip(values, errors[name])]
            yerr = [lo, hi]
        ax.bar(x + (i - (len(groups) - 1) / 2) * width, vals, width, label=name, yerr=yerr,
               capsize=2)
    ax.set_xticks(x, labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)


# ------------------------------------------------------------------------ dilated

def dilated(payload, ax_pair):
    """Left: median ms (min..max whiskers) of every variant per configuration and pass.
    Right: compiled temp memory of jax-dilated's forward+backward (and forward) vs n."""
    cfg, runs = payload["config"], payload["runs"]
    ax_t, ax_m = ax_pair
    variants = []
    for run in runs:
        for v in run["variants"]:
            if v not in variants:
                variants.append(v)
    labels = []
    groups = {v: [] for v in variants}
    errors = {v: [] for v in variants}
    for run in runs:
        for p, short in (("forward", "fwd"), ("forward_backward", "fwd+bwd")):
            labels.append(f"{run['mode']}{' causal' if run['causal'] else ''} {short}")
            for v in variants:
                t = run["variants"].get(v, {}).get(p)
                groups[v].append(None if t is None else t["median_s"] * 1e3)
                errors[v].append(None if t is None else (t["min_s"] * 1e3, t["max_s"] * 1e3))
    _bars(ax_t, labels, groups, "ms (median, min..max)", errors)
    ax_t.set_title(f"time at n={cfg['seq_len']}", fontsize=9)
    memory = payload.get("memory", {})
    for key, mem in memory.items():
        lens = sorted(int(n) for n in mem["by_seq_len"])
        for label, style in (("forward_backward", "o-"), ("forward", "s--")):
            ax_m.plot(lens, [mem["by_seq_len"][str(n)][label]["temp"] / MIB for n in lens],
                      style, label=f"{key} {label.replace('_', '+')}")
        _log2x(ax_m, lens, "sequence length n")
    ax_m.set_yscale("log")
    ax_m.set_ylabel("compiled temp memory (MiB)")
    ax_m.set_title("jax-dilated memory against n (linear is the goal)", fontsize=9)
    ax_m.legend(fontsize=7)


PLOTTERS = {"dilated": dilated}


def plot(payload: dict, json_path) -> list[Path]:
    """Draw ``payload``'s figure to ``json_path`` with a ``.png`` suffix; the paths written."""
    name = payload.get("benchmark")
    drawer = PLOTTERS.get(name)
    if drawer is None:
        return []
    env = payload.get("environment", {})
    title = (f"python -m benchmarks {name}: {env.get('cpu') or env.get('jax_devices', '')}, "
             f"{env.get('threads', '?')} threads, jax {env.get('jax', '?')}, "
             f"commit {str(env.get('git_commit'))[:8]}, {env.get('date_utc', '')}")
    warning = env.get("load", {}).get("warning")
    if warning:
        title += "\n" + warning
    fig, axes = _axes(2, title)
    drawer(payload, axes)
    out = Path(json_path).with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return [out]


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        for path in plot(json.loads(Path(arg).read_text()), arg):
            print(path)
