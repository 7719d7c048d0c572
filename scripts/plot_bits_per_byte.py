#!/usr/bin/env python
"""Plot held-out bits per byte against position in the document for packed-text runs.

Reads ``summary.json`` of each run directory written by ``scripts/train_longnet.py
--corpus stdlib`` (or ``--data DIR``): ``heldout_by_position`` holds bits per byte of
the predicted bytes bucketed by their position within their piece (the bytes of
context the model has: 1-63, 64-127, ..., T/2 to T-1). A model that uses context
beyond its local window keeps improving past the window's length; a window model
flattens there (a dotted line marks each window-only run's segment). Bits per byte
fall with position for every model partly because of what comes where in a file
(licence headers and imports first, code later): compare models at the same
position. With ``--baseline RUN`` (one of the runs, e.g. the window model) a lower
panel shows each run's difference from it.

Writes the plot (PNG) and the same numbers as CSV (``--out`` with ``.csv``).

Usage::

    python scripts/plot_bits_per_byte.py runs/longnet_stdlib_dilated \\
        runs/longnet_stdlib_window --baseline runs/longnet_stdlib_window \\
        --out results/bits_per_byte.png
"""

from __future__ import annotations

import argparse
import csv
import json
import os


def load(run_dir):
    with open(os.path.join(run_dir, "summary.json")) as f:
        s = json.load(f)
    if "heldout_by_position" not in s:
        raise ValueError(f"{run_dir}: summary.json has no heldout_by_position (a run of "
                         f"the synthetic task, not of packed text?).")
    segs, rates = s["segment_lengths"], s["dilation_rates"]
    label = (f"{s['attention']}: " + " + ".join(f"({w}, {r})" for w, r in zip(segs, rates))
             + f", {s['steps']} steps, {s['heldout_bpb']:.3f} bits/byte")
    return s, label


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="run directories (with summary.json)")
    p.add_argument("--out", default="results/bits_per_byte.png")
    p.add_argument("--title", default=None)
    p.add_argument("--baseline", default=None,
                   help="one of the runs: also plot every run's difference from it")
    args = p.parse_args(argv)

    runs = [(d, *load(d)) for d in args.runs]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    csv_path = os.path.splitext(args.out)[0] + ".csv"
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "attention", "position_lo", "position_hi", "bits_per_byte",
                    "bytes"])
        for d, s, _ in runs:
            for b in s["heldout_by_position"]:
                w.writerow([d, s["attention"], b["lo"], b["hi"] - 1, b["bits_per_byte"],
                            b["bytes"]])
    print(f"wrote {csv_path}")

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: only the CSV was written.")
        return
    base = None
    if args.baseline is not None:
        match = [s for d, s, _ in runs if os.path.abspath(d) == os.path.abspath(args.baseline)]
        if not match:
            p.error(f"--baseline {args.baseline} is not one of the runs.")
        base = {(b["lo"], b["hi"]): b["bits_per_byte"] for b in match[0]["heldout_by_position"]}
    if base is None:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        axes = (ax,)
    else:
        fig, axes = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True,
                                 gridspec_kw={"height_ratios": (3, 2)})
        ax = axes[0]
    for d, s, label in runs:
        pts = [(b["lo"], b["hi"], b["bits_per_byte"]) for b in s["heldout_by_position"]
               if b["bytes"]]
        # each bucket at its geometric centre
        xs = [(max(lo, 1) * (hi - 1)) ** 0.5 for lo, hi, _ in pts]
        line, = ax.plot(xs, [y for *_, y in pts], marker="o", label=label)
        if base is not None:
            diff = [(x, y - base[(lo, hi)]) for x, (lo, hi, y) in zip(xs, pts)
                    if base.get((lo, hi)) is not None]
            axes[1].plot([x for x, _ in diff], [y for _, y in diff], marker="o",
                         color=line.get_color())
        for a in axes:
            if len(s["segment_lengths"]) == 1:
                a.axvline(s["segment_lengths"][0], color=line.get_color(), ls=":", lw=1)
    for a in axes:
        a.set_xscale("log", base=2)
        a.grid(True, which="both", alpha=0.3)
    axes[-1].set_xlabel("position of the predicted byte in its document piece "
                        "(bytes of context)")
    ax.set_ylabel("held-out bits per byte")
    if base is not None:
        axes[1].axhline(0.0, color="black", lw=0.8)
        axes[1].set_ylabel(f"minus {os.path.basename(os.path.normpath(args.baseline))}")
    corpus = runs[0][1]["corpus"]
    ax.set_title(args.title or f"{os.path.basename(str(corpus['source']))} corpus, "
                 f"T={runs[0][1]['seq_len']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
