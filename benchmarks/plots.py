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
    _bars(ax_t, labels, groups, "ms (median, min..max; log scale)", errors)
    ax_t.set_yscale("log")
    ax_t.set_title(f"time at n={cfg['seq_len']}", fontsize=9)
    memory = payload.get("memory", {})
    if not memory:
        ax_m.set_axis_off()
        ax_m.text(0.5, 0.5, "memory not measured", ha="center", va="center")
        return
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


# ------------------------------------------------------------------------- ring

def ring(payload, ax_pair):
    """Left: per-device fwd+bwd temp memory against P (contiguous ring), the 1/P line
    of one device, and the other programs at the largest P. Right: median ms
    (min..max whiskers) of every variant, forward and forward+backward."""
    cfg = payload["config"]
    ax_m, ax_t = ax_pair
    rows = {name: r for name, r in payload["memory"].items()
            if r.get("layout") == "contiguous" and "ringattention" not in name}
    pts = sorted((r["devices"], r["forward_backward"]["temp"] / MIB) for r in rows.values())
    ps = [p for p, _ in pts]
    ax_m.plot(ps, [m for _, m in pts], "o-", label="ring (contiguous), fwd+bwd")
    single = [r["forward_backward"]["temp"] / MIB for r in payload["memory"].values()
              if r.get("layout") is None]
    base = single[0] if single else pts[0][1]
    ax_m.plot(ps, [base / p for p in ps], "k:", label="1/P of one device")
    for name, r in payload["memory"].items():
        if name not in rows:
            ax_m.plot([r["devices"]], [r["forward_backward"]["temp"] / MIB],
                      "s" if r.get("layout") is None else "x", label=name)
    _log2x(ax_m, ps, "devices P")
    ax_m.set_yscale("log")
    ax_m.set_ylabel("temp memory per device (MiB)")
    ax_m.set_title(f"per-device memory, global n={cfg['memory_seq_len']}", fontsize=9)
    ax_m.legend(fontsize=7)
    timing = payload.get("timing") or {}
    if not timing:
        ax_t.set_axis_off()
        return
    names = list(timing)
    groups, errors = {}, {}
    for label, short in (("forward", "fwd"), ("forward_backward", "fwd+bwd")):
        cells = [timing[n].get(label) for n in names]
        if all(c is None or "median_s" not in c for c in cells):
            continue
        groups[short] = [None if not c or "median_s" not in c else c["median_s"] * 1e3
                         for c in cells]
        errors[short] = [None if not c or "median_s" not in c
                         else (c["min_s"] * 1e3, c["max_s"] * 1e3) for c in cells]
    _bars(ax_t, names, groups, "ms (median, min..max)", errors)
    ax_t.set_title(f"time at global n={cfg['seq_len']} (the simulated devices share the "
                   f"cores)", fontsize=9)


# ------------------------------------------------------------------ distributed

def distributed(payload, ax_pair):
    """Left: per-device fwd+bwd temp memory against P next to the single-device
    program and 1/P of it. Right: fwd+bwd time of the whole simulated mesh per P."""
    cfg = payload["config"]
    ax_m, ax_t = ax_pair
    single = payload["single_device"]["temp_bytes"] / MIB
    pts = sorted((int(p), r["temp_bytes"] / MIB) for p, r in payload["devices"].items())
    ps = sorted({1} | {p for p, _ in pts})
    ax_m.plot([p for p, _ in pts], [m for _, m in pts], "o-", label="per device, P devices")
    ax_m.plot([1], [single], "s", label="single device (no mesh)")
    ax_m.plot(ps, [single / p for p in ps], "k:", label="1/P")
    _log2x(ax_m, ps, "devices P")
    ax_m.set_yscale("log")
    ax_m.set_ylabel("fwd+bwd temp memory per device (MiB)")
    ax_m.set_title(f"distributed dilated attention, global n={cfg['seq_len']}", fontsize=9)
    ax_m.legend(fontsize=8)
    timed = sorted((int(p), r["fwd_bwd"]) for p, r in payload["devices"].items()
                   if "fwd_bwd" in r)
    if not timed:
        ax_t.set_axis_off()
        return
    xs = [p for p, _ in timed]
    med = [t["median_s"] * 1e3 for _, t in timed]
    ax_t.errorbar(xs, med, yerr=[[m - t["min_s"] * 1e3 for m, (_, t) in zip(med, timed)],
                                 [t["max_s"] * 1e3 - m for m, (_, t) in zip(med, timed)]],
                  fmt="o-", capsize=2)
    _log2x(ax_t, xs, "devices P")
    ax_t.set_ylabel("fwd+bwd ms (median, min..max)")
    ax_t.set_title("time of the whole simulated mesh (its devices share the cores)",
                   fontsize=9)


# ----------------------------------------------------------------- block_sparse

def _pos(x):
    """``x``, or NaN where a log axis cannot show it (0 bytes, missing)."""
    return x if x else float("nan")


def block_sparse(payload, ax_pair):
    """Left: time relative to exact attention against density (the ``= density``
    line is proportional work). Right: fwd+bwd temp memory against density, one
    device and per device of the ring, next to exact attention."""
    cfg, mem, tim = payload["config"], payload["memory"], payload["timing"]
    ax_t, ax_m = ax_pair
    dens = sorted(float(n) for n in mem if n != "exact")
    key = {float(n): n for n in mem if n != "exact"}
    for label, style in (("fwd", "o-"), ("fwd+bwd", "s-")):
        if f"exact {label}" in tim:
            ex = tim[f"exact {label}"]["median_s"]
            ax_t.plot(dens, [tim[f"{key[d]} {label}"]["median_s"] / ex for d in dens], style,
                      label=f"{label} / exact")
    if tim:
        ax_t.plot(dens, dens, "k:", label="= density")
        ax_t.set_xscale("log")
        ax_t.set_yscale("log")
        ax_t.set_xlabel("density")
        ax_t.set_ylabel("time relative to exact attention (medians)")
        ax_t.set_title(f"time against density, n={cfg['seq_len']}", fontsize=9)
        ax_t.legend(fontsize=8)
    else:
        ax_t.set_axis_off()
    ax_m.plot(dens, [_pos(mem[key[d]]["forward_backward"]) / MIB for d in dens], "o-",
              label="one device, fwd+bwd")
    ring_temp = [mem[key[d]].get("ring_per_device_forward_backward") for d in dens]
    if all(r is not None for r in ring_temp):
        ax_m.plot(dens, [_pos(r) / MIB for r in ring_temp], "s-",
                  label=f"ring, per device (P={cfg['devices']})")
    ax_m.axhline(mem["exact"]["forward_backward"] / MIB, color="k", ls=":",
                 label="exact attention")
    ax_m.set_xscale("log")
    ax_m.set_yscale("log")
    ax_m.set_xlabel("density")
    ax_m.set_ylabel("compiled temp memory (MiB)")
    ax_m.legend(fontsize=8)


# --------------------------------------------------------------------------- lm

def lm(payload, ax_pair):
    """Left: compiled temp memory of the training step against n (and ~n through the
    first point). Right: decode time per token (median, min..p90) per context."""
    ax_m, ax_t = ax_pair
    train, decode = payload.get("train"), payload.get("decode")
    if train:
        by_len = sorted((int(n), row) for n, row in train["lengths"].items())
        lens = [n for n, _ in by_len]
        temp = [row["temp_bytes"] / MIB for _, row in by_len]
        ax_m.plot(lens, temp, "o-", label="training step (loss + grad + AdamW)")
        ax_m.plot(lens, [temp[0] * n / lens[0] for n in lens], "k:", label="~ n")
        _log2x(ax_m, lens, "sequence length n")
        ax_m.set_yscale("log")
        ax_m.set_ylabel("compiled temp memory (MiB)")
        ax_m.set_title("LongNetLM training step memory", fontsize=9)
        ax_m.legend(fontsize=8)
    else:
        ax_m.set_axis_off()
    if decode:
        by_ctx = sorted((int(c), row) for c, row in decode["contexts"].items())
        ctx = [c for c, _ in by_ctx]
        rows = [row for _, row in by_ctx]
        med = [r["median_ms"] for r in rows]
        ax_t.errorbar(ctx, med, yerr=[[m - r["min_ms"] for m, r in zip(med, rows)],
                                      [r["p90_ms"] - m for m, r in zip(med, rows)]],
                      fmt="o-", capsize=2)
        _log2x(ax_t, ctx, "context (tokens in the cache)")
        ax_t.set_ylabel("ms per token (median, min..p90)")
        ax_t.set_title("KV-cache decoding", fontsize=9)
    else:
        ax_t.set_axis_off()


PLOTTERS = {"dilated": dilated}
PLOTTERS.update(ring=ring, distributed=distributed, block_sparse=block_sparse, lm=lm)


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
