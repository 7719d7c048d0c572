"""PNG plots of ``scripts/benchmark.py`` results (matplotlib), written next to the JSON.

``plot(payload, json_path)`` draws the figure of one subcommand's payload into
``<json stem>.png`` and returns the paths written (none for a payload it has no figure
for). ``python scripts/benchmark_plots.py results/benchmark_ring.json ...`` redraws
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


def _bars(ax, labels, groups: dict[str, list], ylabel: str):
    """Grouped bars: one group per label, one bar per key of ``groups`` (None: no bar)."""
    import numpy as np
    width = 0.8 / max(len(groups), 1)
    x = np.arange(len(labels))
    for i, (name, values) in enumerate(groups.items()):
        vals = [float("nan") if v is None else v for v in values]
        ax.bar(x + (i - (len(groups) - 1) / 2) * width, vals, width, label=name)
    ax.set_xticks(x, labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)


def _dilated(payload, ax_pair):
    cfg, modes = payload["config"], payload["modes"]
    ax_t, ax_m = ax_pair
    labels, jax_ms, torch_ms = [], [], []
    for mode, r in modes.items():
        for label, short in (("forward", "fwd"), ("forward_backward", "fwd+bwd")):
            labels.append(f"{mode} {short}")
            jax_ms.append(r["jax"][label]["median_s"] * 1e3)
            torch_ms.append(r["torch"][label]["median_s"] * 1e3 if "torch" in r else None)
    _bars(ax_t, labels, {"jax-dilated": jax_ms, "torch reference": torch_ms}, "ms (median)")
    ax_t.set_title(f"time at n={cfg['seq_len']}", fontsize=9)
    lens = sorted(int(n) for n in cfg["memory_seq_lens"])
    for mode, r in modes.items():
        for label, style in (("forward_backward", "o-"), ("forward", "s--")):
            ax_m.plot(lens, [r["memory"][str(n)][f"{label}_temp_bytes"] / MIB for n in lens],
                      style, label=f"{mode} {label.replace('_', '+')}")
    _log2x(ax_m, lens, "sequence length n")
    ax_m.set_yscale("log")
    ax_m.set_ylabel("compiled temp memory (MiB)")
    ax_m.set_title("memory against n (linear is the goal)", fontsize=9)
    ax_m.legend(fontsize=8)


def _ring(payload, ax_pair):
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
    if timing:
        names = list(timing)
        _bars(ax_t, names, {
            "fwd": [timing[n].get("forward", {}).get("median_s", float("nan")) * 1e3
                    for n in names],
            "fwd+bwd": [timing[n]["forward_backward"]["median_s"] * 1e3 for n in names]},
            "ms (median, simulated devices share the cores)")
        ax_t.set_title(f"time at global n={cfg['seq_len']}", fontsize=9)
    else:
        ax_t.set_axis_off()


def _distributed(payload, ax_pair):
    cfg = payload["config"]
    ax_m, ax_t = ax_pair
    single = payload["single_device"]["temp_bytes"] / MIB
    pts = sorted((int(p), r["temp_bytes"] / MIB) for p, r in payload["devices"].items())
    ps = [1] + [p for p, _ in pts]
    ax_m.plot([p for p, _ in pts], [m for _, m in pts], "o-", label="per device, P devices")
    ax_m.plot([1], [single], "s", label="single device (no mesh)")
    ax_m.plot(ps, [single / p for p in ps], "k:", label="1/P")
    _log2x(ax_m, ps, "devices P")
    ax_m.set_yscale("log")
    ax_m.set_ylabel("fwd+bwd temp memory per device (MiB)")
    ax_m.set_title(f"distributed dilated attention, global n={cfg['seq_len']}", fontsize=9)
    ax_m.legend(fontsize=8)
    timed = [(int(p), r["fwd_bwd"]["median_s"]) for p, r in payload["devices"].items()
             if "fwd_bwd" in r]
    if timed:
        ax_t.plot([p for p, _ in timed], [t * 1e3 for _, t in timed], "o-")
        _log2x(ax_t, [p for p, _ in timed], "devices P")
        ax_t.set_ylabel("fwd+bwd ms (whole simulated mesh)")
        ax_t.set_title("time (the simulated devices share the cores)", fontsize=9)
    else:
        ax_t.set_axis_off()


def _pos(x):
    """``x``, or NaN where a log axis cannot show it (0 bytes, missing)."""
    return x if x else float("nan")


def _block_sparse(payload, ax_pair):
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
        ax_t.set_ylabel("time relative to exact attention")
        ax_t.set_title(f"time against density, n={cfg['seq_len']}", fontsize=9)
        ax_t.legend(fontsize=8)
    else:
        ax_t.set_axis_off()
    ax_m.plot(dens, [_pos(mem[key[d]]["forward_backward"]) / MIB for d in dens], "o-",
              label="one device, fwd+bwd")
    ring = [mem[key[d]].get("ring_per_device_forward_backward") for d in dens]
    if all(r is not None for r in ring):
        ax_m.plot(dens, [_pos(r) / MIB for r in ring], "s-",
                  label=f"ring, per device (P={cfg['devices']})")
    ax_m.axhline(mem["exact"]["forward_backward"] / MIB, color="k", ls=":",
                 label="exact attention")
    ax_m.set_xscale("log")
    ax_m.set_yscale("log")
    ax_m.set_xlabel("density")
    ax_m.set_ylabel("compiled temp memory (MiB)")
    ax_m.legend(fontsize=8)


PLOTTERS = {"dilated": _dilated, "ring": _ring, "distributed": _distributed,
            "block_sparse": _block_sparse}


def plot(payload: dict, json_path) -> list[Path]:
    """Draw ``payload``'s figure to ``json_path`` with a ``.png`` suffix; the paths written."""
    name = payload.get("benchmark")
    drawer = PLOTTERS.get(name)
    if drawer is None:
        return []
    env = payload.get("environment", {})
    title = (f"scripts/benchmark.py {name}: {env.get('cpu') or env.get('jax_device', '')}, "
             f"jax {env.get('jax', '?')}, {env.get('time', '')}")
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
