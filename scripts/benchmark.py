#!/usr/bin/env python
"""Benchmarks for jax-dilated, one subcommand per operation.

Usage::

    python scripts/benchmark.py dilated                 # the default configuration
    python scripts/benchmark.py dilated --quick         # well under a minute, n=4096
    python scripts/benchmark.py dilated --modes head_groups,longnet --causal
    python scripts/benchmark.py dilated --help

Subcommands:

``dilated``
    Single-device ``jd.dilated_attention`` under ``jax.jit`` against a PyTorch
    CPU reference of the same mode (``scripts/torch_dilated.py``: torch's flash
    SDPA per dilated segment batch, the way the PyTorch dilated-attention
    library does it), forward and forward+backward, side by side in the same
    process with the same number of threads. It also measures the GFLOP/s of a
    plain attention-shaped batched matmul and reports the dilated forward's
    achieved GFLOP/s as a fraction of it, and the compiled temporary memory of
    forward+backward at several sequence lengths (it should grow linearly).

Every subcommand shows progress on stderr, prints a summary table and writes
its results as JSON (``--json``, default ``results/benchmark_<name>.json``).
New subcommands (ring, distributed, block-sparse) register themselves with
:func:`subcommand` and reuse the helpers below (threads, timing, progress,
environment, JSON).

Threads: ``--threads N`` (default 2) pins the process to N CPUs *before* JAX
and PyTorch start (so XLA's CPU thread pool has N threads) and calls
``torch.set_num_threads(N)``, so both libraries get the same cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import numpy as np

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent


# ----------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------

def limit_threads(threads: int) -> int:
    """Pin this process to ``threads`` CPUs (before JAX/torch start); returns the count used.

    XLA's CPU client sizes its thread pool from the schedulable CPUs, so CPU
    affinity is what limits JAX; torch is limited with ``torch.set_num_threads``
    by the caller.
    """
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or threads
    if threads < len(cpus):
        os.sched_setaffinity(0, cpus[:threads])
        cpus = cpus[:threads]
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, str(len(cpus)))
    return len(cpus)


class Progress:
    """Step counter on stderr: a tqdm bar on a terminal when tqdm is installed, else plain lines."""

    def __init__(self, total: int, desc: str):
        self._start = time.perf_counter()
        try:
            from tqdm import tqdm
            if not sys.stderr.isatty():  # a log file: one line per step reads better
                raise ImportError
        except ImportError:
            self._bar = None
            self._total, self._done = total, 0
            print(f"[{desc}] {total} steps", file=sys.stderr, flush=True)
        else:
            self._bar = tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True,
                             bar_format="{desc}: {n}/{total} |{bar}| {elapsed} {postfix}")

    def start(self, what: str) -> None:
        """Announce the step that begins now."""
        if self._bar is not None:
            self._bar.set_postfix_str(what)
        else:
            elapsed = time.perf_counter() - self._start
            print(f"  [{self._done + 1}/{self._total}] {what} (t={elapsed:.0f}s)",
                  file=sys.stderr, flush=True)

    def done(self) -> None:
        """Mark the current step finished."""
        if self._bar is not None:
            self._bar.update(1)
        else:
            self._done += 1

    def write(self, message: str) -> None:
        """Print a line without breaking the bar."""
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def time_calls(fn: Callable[[], object], *, repeats: int, warmup: int = 1,
               sync: Callable[[object], object] = lambda x: x) -> dict:
    """Wall-clock seconds of ``fn()`` (``sync`` applied to its result), after ``warmup`` calls.

    Returns ``{"median_s", "min_s", "times_s"}``.
    """
    for _ in range(warmup):
        sync(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sync(fn())
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "times_s": times}


def time_interleaved(calls: dict[str, tuple[Callable[[], object], Callable[[object], object]]],
                     *, repeats: int, warmup: int = 1) -> dict[str, dict]:
    """Time several ``(fn, sync)`` pairs call by call, in turn, so they see the same load.

    Each round calls every ``fn`` once (``sync`` applied to its result, e.g.
    ``jax.block_until_ready``); returns, per name, the :func:`time_calls` dict.
    """
    for _ in range(warmup):
        for fn, sync in calls.values():
            sync(fn())
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, (fn, sync) in calls.items():
            t0 = time.perf_counter()
            sync(fn())
            times[name].append(time.perf_counter() - t0)
    return {name: {"median_s": statistics.median(ts), "min_s": min(ts), "times_s": ts}
            for name, ts in times.items()}


def environment(threads: int) -> dict:
    """Versions and machine facts recorded with every result."""
    import jax
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "jax_device": str(jax.devices()[0].device_kind),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        import torch
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


def write_json(path: str | os.PathLike, payload: dict) -> Path:
    """Write ``payload`` as indented JSON, creating the parent folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def int_list(text: str) -> tuple[int, ...]:
    """argparse type: ``"1,2,4"`` -> ``(1, 2, 4)``."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def str_list(text: str) -> tuple[str, ...]:
    """argparse type: ``"a,b"`` -> ``("a", "b")``."""
    return tuple(x.strip() for x in text.split(",") if x.strip())


def fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:9.1f}"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    """Plain aligned text table on stdout."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths))
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


@dataclasses.dataclass
class Subcommand:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], dict]


SUBCOMMANDS: dict[str, Subcommand] = {}


def subcommand(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None]):
    """Register ``run(args) -> results dict`` as subcommand ``name``."""
    def register(run):
        SUBCOMMANDS[name] = Subcommand(name, help, add_arguments, run)
        return run
    return register


# ----------------------------------------------------------------------------
# dilated: single-device dilated attention vs the PyTorch CPU reference
# ----------------------------------------------------------------------------

DILATED_DEFAULTS = dict(seq_len=16384, segments=(2048, 4096, 8192), rates=(1, 2, 4),
                        repeats=5, memory_seq_lens=(16384, 32768, 65536))
DILATED_QUICK = dict(seq_len=4096, segments=(512, 1024, 2048), rates=(1, 2, 4),
                     repeats=3, memory_seq_lens=(4096, 8192, 16384))
# float32 agreement threshold of the JAX/torch cross-check, relative to max |output|
# (bfloat16 is much coarser).
CHECK_RTOL = {"float32": 1e-4, "bfloat16": 3e-2}


def _dilated_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="float32", choices=sorted(CHECK_RTOL))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seq-len", "-n", type=int, default=None,
                   help=f"sequence length (default {DILATED_DEFAULTS['seq_len']}; "
                        f"--quick {DILATED_QUICK['seq_len']})")
    p.add_argument("--segments", type=int_list, default=None,
                   help="segment lengths, comma-separated (default 2048,4096,8192; "
                        "--quick 512,1024,2048)")
    p.add_argument("--rates", type=int_list, default=None,
                   help="dilation rates, comma-separated (default 1,2,4)")
    p.add_argument("--modes", type=str_list, default=("head_groups",),
                   help="comma-separated subset of head_groups,longnet (default head_groups)")
    p.add_argument("--causal", action="store_true", help="causal attention")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed repeats per measurement, median reported (default 5; --quick 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls after compiling")
    p.add_argument("--memory-seq-lens", type=int_list, default=None,
                   help="sequence lengths for the compiled temp-memory table "
                        "(default 16384,32768,65536; --quick 4096,8192,16384)")
    p.add_argument("--matmul-block", type=int, default=512,
                   help="block length L of the reference matmuls [N,L,D]x[N,L,D] and "
                        "[N,L,L]x[N,L,D] (the shapes of one attention block; default 512)")
    p.add_argument("--implementation", default=None,
                   help="jd.dilated_attention implementation (default: by device kind)")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch baseline")
    p.add_argument("--quick", action="store_true",
                   help="small configuration (n=4096, 3 repeats): well under a minute")
    p.add_argument("--seed", type=int, default=0)


def _resolve_quick(args: argparse.Namespace) -> None:
    """Fill unset size options from the default or the --quick configuration."""
    table = DILATED_QUICK if args.quick else DILATED_DEFAULTS
    for name, value in table.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def dilated_flops(*, batch: int, seq_len: int, heads: int, head_dim: int, segments,
                  rates, mode: str, causal: bool) -> int:
    """Forward FLOPs dilated attention actually needs (no padding, no masked-out pairs).

    For every branch ``(w, r)``, every head that runs it (all heads in longnet
    mode, offset ``j mod r``; group ``i`` at offset ``i mod r`` in head_groups
    mode) and every dilated segment of ``L`` tokens: ``QK^T`` and ``PV`` cost
    ``2 * D`` flops per (query, key) pair each, so ``4 * D * pairs`` with
    ``pairs = L^2`` (``L (L + 1) / 2`` when causal). The last segment may be
    shorter than ``w``; a segment longer than the sequence is the whole sequence.
    """
    def pairs(length: int) -> int:
        return length * (length + 1) // 2 if causal else length * length

    g = len(segments)
    if mode == "head_groups":
        base, extra = divmod(heads, g)
        sizes = [base + (i < extra) for i in range(g)]
        runs = [[(i % r, sizes[i])] for i, r in enumerate(rates)]
    elif mode == "longnet":
        runs = [[(o, len(range(o, heads, r))) for o in range(min(r, heads))] for r in rates]
    else:
        raise ValueError(f"unknown mode {mode!r}")
    total = 0
    for w, r, branch_runs in zip(segments, rates, runs):
        for start in range(0, seq_len, w):
            seg = min(w, seq_len - start)
            for offset, num_heads in branch_runs:
                selected = len(range(offset, seg, r))
                total += num_heads * pairs(selected)
    return 4 * head_dim * total * batch


def _matmul_reference(jax, jnp, *, block: int, head_dim: int, dtype, repeats: int,
                      batches=(1, 4, 16, 64), square: int = 2048) -> dict:
    """GFLOP/s of plain jitted batched matmuls shaped like one attention block.

    ``[N, L, D] x [N, L, D] -> [N, L, L]`` (QK^T) and ``[N, L, L] x [N, L, D]``
    (PV) with ``L = block``, float32 accumulation, for several batch sizes ``N``
    (the rate depends a lot on whether the ``[N, L, L]`` product stays in
    cache). The reference rate ``gflops`` is the best over ``N`` of the pair
    (QK^T and PV once each, as an attention block does them): what a plain
    matmul of these shapes reaches on this machine. A ``square``-sized square
    matmul is measured too, as the machine's practical matmul peak.
    """
    qk = jax.jit(lambda a, b: jnp.einsum("nqd,nkd->nqk", a, b,
                                         preferred_element_type=jnp.float32))
    pv = jax.jit(lambda a, b: jnp.einsum("nqk,nkd->nqd", a, b,
                                         preferred_element_type=jnp.float32))
    mm = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))

    def median(fn, *xs):
        return time_calls(lambda: fn(*xs), repeats=max(4 * repeats, 10), warmup=2,
                          sync=jax.block_until_ready)["median_s"]

    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    per_batch = {}
    for n in batches:
        q = jax.random.normal(k1, (n, block, head_dim), dtype)
        k = jax.random.normal(k2, (n, block, head_dim), dtype)
        p = jax.random.normal(k3, (n, block, block), dtype)
        flops = 2 * n * block * block * head_dim
        t_qk, t_pv = median(qk, q, k), median(pv, p, k)
        per_batch[n] = {"qk_gflops": flops / t_qk / 1e9, "pv_gflops": flops / t_pv / 1e9,
                        "gflops": 2 * flops / (t_qk + t_pv) / 1e9}
    best = max(per_batch, key=lambda n: per_batch[n]["gflops"])
    a = jax.random.normal(k1, (square, square), dtype)
    t_sq = median(mm, a, a)
    return {
        "block": block, "head_dim": head_dim, "per_batch": per_batch, "best_batch": best,
        "qk_gflops": per_batch[best]["qk_gflops"], "pv_gflops": per_batch[best]["pv_gflops"],
        "gflops": per_batch[best]["gflops"],
        "square": square, "square_gflops": 2 * square ** 3 / t_sq / 1e9,
    }


def _max_rel_diff(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(max |a - b|, that divided by max |b|)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    diff = float(np.max(np.abs(a - b)))
    return diff, diff / max(float(np.max(np.abs(b))), 1e-30)


def _import_libs(args: argparse.Namespace) -> SimpleNamespace:
    """JAX, jax_dilated and (unless --no-torch) torch + the torch reference.

    Imported only once :func:`limit_threads` has pinned the CPUs, so XLA's
    thread pool sees the right count; torch gets ``set_num_threads``.
    """
    import jax
    import jax.numpy as jnp

    import jax_dilated as jd

    libs = SimpleNamespace(jax=jax, jnp=jnp, jd=jd, torch=None, td=None)
    if not args.no_torch:
        import torch
        torch.set_num_threads(args.threads)
        sys.path.insert(0, str(SCRIPTS))
        import torch_dilated as td
        try:
            td.check_config(args.seq_len, args.segments, args.rates)
        except ValueError as err:
            print(f"PyTorch baseline skipped: {err}", file=sys.stderr)
        else:
            libs.torch, libs.td = torch, td
    return libs


@subcommand("dilated", "dilated attention: JAX vs PyTorch CPU, GFLOP/s, memory",
            _dilated_arguments)
def run_dilated(args: argparse.Namespace) -> dict:
    """The ``dilated`` benchmark; returns the JSON-able results."""
    _resolve_quick(args)
    for mode in args.modes:
        if mode not in ("head_groups", "longnet"):
            raise SystemExit(f"--modes: unknown mode {mode!r} (head_groups, longnet)")
    if len(args.segments) != len(args.rates):
        raise SystemExit(f"--segments {args.segments} and --rates {args.rates} differ in length")
    libs = _import_libs(args)
    config = {k: getattr(args, k) for k in (
        "dtype", "batch", "heads", "head_dim", "seq_len", "segments", "rates", "modes",
        "causal", "repeats", "warmup", "memory_seq_lens", "matmul_block", "implementation",
        "quick", "seed", "threads")}
    env = environment(args.threads)

    steps_per_mode = 3 + (libs.td is not None) + len(args.memory_seq_lens)
    progress = Progress(1 + steps_per_mode * len(args.modes), "dilated")
    progress.write(f"dilated: B={args.batch} n={args.seq_len} H={args.heads} D={args.head_dim} "
                   f"{args.dtype} segments={args.segments} rates={args.rates} "
                   f"causal={args.causal} modes={','.join(args.modes)} "
                   f"threads={args.threads} repeats={args.repeats}")

    progress.start("matmul reference")
    matmul = _matmul_reference(libs.jax, libs.jnp, block=args.matmul_block,
                               head_dim=args.head_dim, dtype=libs.jnp.dtype(args.dtype),
                               repeats=args.repeats)
    progress.done()
    progress.write(f"matmul reference: {matmul['gflops']:.1f} GFLOP/s "
                   f"(QK^T {matmul['qk_gflops']:.1f}, PV {matmul['pv_gflops']:.1f}, "
                   f"N={matmul['best_batch']}; square {matmul['square_gflops']:.1f})")

    rng = np.random.default_rng(args.seed)
    shape = (args.batch, args.seq_len, args.heads, args.head_dim)
    inputs = [rng.standard_normal(shape, dtype=np.float32) for _ in range(4)]  # q, k, v, dout
    results = {}
    for mode in args.modes:
        res = results[mode] = _dilated_mode(args, mode, libs, inputs, progress)
        res["jax_forward_fraction_of_matmul"] = res["gflops"]["jax_forward"] / matmul["gflops"]
        res["jax_forward_fraction_of_square_matmul"] = (
            res["gflops"]["jax_forward"] / matmul["square_gflops"])
    progress.close()

    payload = {"benchmark": "dilated", "config": config, "environment": env,
               "matmul": matmul, "modes": results}
    _print_dilated_summary(payload)
    return payload


def _dilated_mode(args: argparse.Namespace, mode: str, libs: SimpleNamespace,
                  inputs: list[np.ndarray], progress: Progress) -> dict:
    """Everything measured for one mode: timings, cross-check, GFLOP/s, memory."""
    jax, jnp = libs.jax, libs.jnp
    dtype = jnp.dtype(args.dtype)
    q, k, v, ct = (jnp.asarray(x, dtype) for x in inputs)
    attn = functools.partial(libs.jd.dilated_attention, segment_lengths=args.segments,
                             dilation_rates=args.rates, mode=mode, is_causal=args.causal,
                             implementation=args.implementation)

    def loss(q_, k_, v_, ct_):
        return jnp.sum(attn(q_, k_, v_).astype(jnp.float32) * ct_.astype(jnp.float32))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    res: dict = {"jax": {}}

    # --- compile the JAX passes (compile time recorded, excluded from the timings) ---
    progress.start(f"{mode}: compile jax")
    jax_calls = {}
    for label, fn, call_args in (("forward", attn, (q, k, v)),
                                 ("forward_backward", grad, (q, k, v, ct))):
        t0 = time.perf_counter()
        exe = jax.jit(fn).lower(*call_args).compile()
        res["jax"][label] = {"compile_s": time.perf_counter() - t0,
                             "temp_bytes": getattr(exe.memory_analysis(),
                                                   "temp_size_in_bytes", None)}
        jax_calls[label] = (functools.partial(exe, *call_args), jax.block_until_ready)
    progress.done()

    # --- the PyTorch reference of the same mode ---
    torch_calls = {}
    if libs.td is not None:
        torch_calls = _torch_calls(args, mode, libs, inputs)
        res["torch"] = {}

    # --- time both sides, interleaved call by call so they share the machine's load ---
    for label in ("forward", "forward_backward"):
        progress.start(f"{mode}: time {label.replace('_', '+')}")
        calls = {"jax": jax_calls[label]}
        if torch_calls:
            calls["torch"] = torch_calls[label]
        for side, timing in time_interleaved(calls, repeats=args.repeats,
                                             warmup=args.warmup).items():
            res[side].setdefault(label, {}).update(timing)
        progress.done()

    if torch_calls:
        # --- honesty check: both sides computed the same function ---
        progress.start(f"{mode}: check torch vs jax")
        res["check"] = _cross_check(jax_calls, torch_calls, args.dtype)
        c = res["check"]
        progress.write(
            f"{mode}: torch vs jax max |diff| out {c['output']['max_abs_diff']:.2e}, "
            f"dq {c['dq']['max_abs_diff']:.2e}, dk {c['dk']['max_abs_diff']:.2e}, "
            f"dv {c['dv']['max_abs_diff']:.2e}" + ("" if c["agree"] else "  ** DISAGREE **"))
        progress.done()
        passes = ("forward", "forward_backward")
        res["torch_over_jax"] = {p: res["torch"][p]["median_s"] / res["jax"][p]["median_s"]
                                 for p in passes}
        # the same from each interleaved round, less sensitive to load changes
        res["torch_over_jax_paired_median"] = {
            p: statistics.median(t / j for t, j in zip(res["torch"][p]["times_s"],
                                                       res["jax"][p]["times_s"]))
            for p in passes}

    # --- achieved GFLOP/s (needed flops only) ---
    flops = dilated_flops(batch=args.batch, seq_len=args.seq_len, heads=args.heads,
                          head_dim=args.head_dim, segments=args.segments, rates=args.rates,
                          mode=mode, causal=args.causal)
    fb_flops = 3.5 * flops  # backward with QK^T recomputed: 5 matmuls to forward's 2
    res["flops"] = {"forward": flops, "forward_backward": fb_flops,
                    "forward_backward_convention": "3.5 x forward (FlashAttention)"}
    res["gflops"] = {f"{side}_{p}": f / res[side][p]["median_s"] / 1e9
                     for side in ("jax", "torch") if side in res
                     for p, f in (("forward", flops), ("forward_backward", fb_flops))}

    # --- compiled temp memory vs sequence length ---
    res["memory"] = memory = {}
    for seq in args.memory_seq_lens:
        progress.start(f"{mode}: memory n={seq}")
        spec = jax.ShapeDtypeStruct((args.batch, seq, args.heads, args.head_dim), dtype)
        memory[str(seq)] = {
            f"{label}_temp_bytes": getattr(
                jax.jit(fn).lower(*([spec] * nargs)).compile().memory_analysis(),
                "temp_size_in_bytes", None)
            for label, fn, nargs in (("forward", attn, 3), ("forward_backward", grad, 4))}
        progress.done()
    lens = sorted(args.memory_seq_lens)
    lo, hi = memory[str(lens[0])], memory[str(lens[-1])]
    if len(lens) > 1 and lo["forward_backward_temp_bytes"] and lo["forward_temp_bytes"]:
        res["memory_ratio"] = {
            "seq_lens": [lens[-1], lens[0]], "length_ratio": lens[-1] / lens[0],
            "forward_backward": hi["forward_backward_temp_bytes"]
            / lo["forward_backward_temp_bytes"],
            "forward": hi["forward_temp_bytes"] / lo["forward_temp_bytes"]}
    return res


def _torch_calls(args: argparse.Namespace, mode: str, libs: SimpleNamespace,
                 inputs: list[np.ndarray]) -> dict:
    """``{"forward", "forward_backward"}`` -> ``(fn, sync)`` for the PyTorch reference."""
    torch = libs.torch
    dtype = getattr(torch, args.dtype)
    q, k, v = (torch.tensor(x).to(dtype).requires_grad_(True) for x in inputs[:3])
    dout = torch.tensor(inputs[3]).to(dtype)
    attn = functools.partial(libs.td.dilated_attention, mode=mode,
                             segment_lengths=args.segments, dilation_rates=args.rates,
                             is_causal=args.causal)

    def forward():
        with torch.no_grad():
            return attn(q, k, v)

    def forward_backward():
        # the gradient of sum(out * dout), like the JAX side
        return torch.autograd.grad(attn(q, k, v), (q, k, v), grad_outputs=dout)

    def no_sync(x):  # CPU torch ops are synchronous
        return x

    return {"forward": (forward, no_sync), "forward_backward": (forward_backward, no_sync)}


def _cross_check(jax_calls: dict, torch_calls: dict, dtype: str) -> dict:
    """Max differences between the JAX and torch output and gradients."""
    t_out = torch_calls["forward"][0]().float().numpy()
    t_grads = [g.float().numpy() for g in torch_calls["forward_backward"][0]()]
    j_out = np.asarray(jax_calls["forward"][0](), np.float32)
    j_grads = [np.asarray(g, np.float32) for g in jax_calls["forward_backward"][0]()]
    check = {"output": _max_rel_diff(j_out, t_out)}
    for name, jg, tg in zip("qkv", j_grads, t_grads):
        check[f"d{name}"] = _max_rel_diff(jg, tg)
    worst = max(rel for _, rel in check.values())
    return {**{key: {"max_abs_diff": a, "rel_to_max": r} for key, (a, r) in check.items()},
            "rtol": CHECK_RTOL[dtype], "agree": worst <= CHECK_RTOL[dtype]}


def _print_dilated_summary(payload: dict) -> None:
    """Timing, throughput and memory tables of a ``dilated`` run."""
    cfg, matmul, modes = payload["config"], payload["matmul"], payload["modes"]
    print()
    print(f"dilated attention: B={cfg['batch']} n={cfg['seq_len']} H={cfg['heads']} "
          f"D={cfg['head_dim']} {cfg['dtype']} segments={list(cfg['segments'])} "
          f"rates={list(cfg['rates'])} causal={cfg['causal']} threads={cfg['threads']} "
          f"(median of {cfg['repeats']}; {payload['environment'].get('cpu', '?')})")
    print()
    rows = []
    for mode, r in modes.items():
        for label, name in (("forward", "fwd"), ("forward_backward", "fwd+bwd")):
            t_jax = r["jax"][label]["median_s"]
            t_torch = r["torch"][label]["median_s"] if "torch" in r else None
            ratio = r.get("torch_over_jax", {}).get(label)
            gf = r["gflops"][f"jax_{label}"]
            gf_t = r["gflops"].get(f"torch_{label}")
            rows.append([mode, name, fmt_ms(t_jax), fmt_ms(t_torch),
                         "-" if ratio is None else f"{ratio:.2f}x",
                         f"{gf:.1f}", "-" if gf_t is None else f"{gf_t:.1f}",
                         f"{r['flops'][label] / 1e9:.1f}"])
    print_table(["mode", "pass", "jax ms", "torch ms", "torch/jax", "jax GF/s",
                 "torch GF/s", "GFLOP"], rows)
    print("(torch/jax = torch time / jax time: > 1 means JAX is faster; GFLOP = flops the "
          "pass needs, fwd+bwd counted as 3.5 x fwd)")
    print()
    print(f"matmul reference (jitted einsum [N,{matmul['block']},{matmul['head_dim']}] "
          f"attention-block shapes, best N={matmul['best_batch']}): {matmul['gflops']:.1f} "
          f"GFLOP/s (QK^T {matmul['qk_gflops']:.1f}, PV {matmul['pv_gflops']:.1f}; by N: "
          + ", ".join(f"{n}: {v['gflops']:.0f}" for n, v in matmul["per_batch"].items())
          + f"); square {matmul['square']}^3 matmul {matmul['square_gflops']:.1f} GFLOP/s")
    for mode, r in modes.items():
        line = (f"  {mode}: jax forward {r['gflops']['jax_forward']:.1f} GFLOP/s = "
                f"{100 * r['jax_forward_fraction_of_matmul']:.0f}% of block matmul, "
                f"{100 * r['jax_forward_fraction_of_square_matmul']:.0f}% of square")
        if "check" in r:
            c = r["check"]
            line += (f"; torch vs jax max|diff| out {c['output']['max_abs_diff']:.1e} "
                     f"grads {max(c[g]['max_abs_diff'] for g in ('dq', 'dk', 'dv')):.1e}"
                     + (" (agree)" if c["agree"] else " (** DISAGREE **)"))
        print(line)
    print()
    lens = [str(s) for s in cfg["memory_seq_lens"]]
    rows = []
    for mode, r in modes.items():
        for label in ("forward_backward", "forward"):
            cells = [fmt_bytes(r["memory"][s][f"{label}_temp_bytes"]) for s in lens]
            ratio = r.get("memory_ratio", {}).get(label)
            rows.append([mode, label.replace("_", "+")] + cells
                        + ["-" if ratio is None else f"{ratio:.2f}"])
    ratio_head = (f"{lens[-1]}/{lens[0]}" if len(lens) > 1 else "ratio")
    print("compiled temp memory (memory_analysis().temp_size_in_bytes)")
    print_table(["mode", "pass"] + [f"n={s}" for s in lens] + [ratio_head], rows)


# ----------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for cmd in SUBCOMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.add_argument("--threads", type=int, default=2,
                       help="CPU threads for JAX (via CPU affinity) and torch (default 2)")
        default_json = f"results/benchmark_{cmd.name}.json"
        p.add_argument("--json", default=str(ROOT / default_json),
                       help=f"where to write the results (default {default_json})")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.threads = limit_threads(args.threads)
    payload = SUBCOMMANDS[args.command].run(args)
    path = write_json(args.json, payload)
    print(f"\nresults written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
