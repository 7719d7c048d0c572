#!/usr/bin/env python
"""Benchmarks for jax-dilated, one subcommand per operation.

Usage::

    python scripts/benchmark.py dilated                 # the default configuration
    python scripts/benchmark.py dilated --quick         # well under a minute, n=4096
    python scripts/benchmark.py dilated --modes head_groups,longnet --causal
    python scripts/benchmark.py dilated --help
    python scripts/benchmark.py ring                    # 8 simulated devices, n=16384
    python scripts/benchmark.py ring --quick            # a minute or two, n=2048

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

``ring``
    Causal ring attention (``jd.sharded(jd.ring_attention, ...)`` under
    ``jax.jit``) on 8 simulated CPU devices (the subcommand sets the device
    count itself) against the single-device blockwise kernel on the same global
    problem: per-device compiled memory of forward and forward+backward for
    P = 1, 2, 4, 8 (default global n = 32768); forward and forward+backward
    times of the contiguous, zigzag and striped layouts (through ``jd.sharded``
    and on inputs already in the layout) and of the ``ringattention`` package
    from PyPI (optional: ``pip install ringattention einops``; run inside
    ``jax.shard_map`` on the same mesh and inputs, its output and gradients
    compared with ours), all interleaved (default n = 16384); every variant's
    output and gradients are checked against the single-device kernel. The
    simulated devices share this process's cores, so wall time follows the
    total work, which a layout does not change; a projection times each
    distinct ring step on one device and reports the critical path (sum over
    steps of the slowest device) that real devices, one per shard, would see.
    ``--quick``: n = 2048 (memory at 4096), a minute or two; ``--no-timing``:
    the memory table only.

``distributed``
    ``jd.dilated_attention(seq_axis=...)`` over P = 1, 2, 4, 8 simulated CPU
    devices on one global problem (default n = 65536): per-device compiled
    temp memory of forward+backward against the single-device program, the
    collective-permutes in the compiled HLO, and the key/value bytes each device
    sends per ring step for every branch, computed from the shapes the code
    sends, next to the O(n/r) expectation (``--no-timing`` for memory only).

``block_sparse``
    ``jd.block_sparse_attention`` at densities 0.05 ... 1.0 (``RandomBlocks``)
    next to exact blockwise attention: forward and forward+backward time
    (interleaved), compiled temp memory, and per-device memory of the ring on 8
    simulated devices against one device.

Every subcommand shows progress on stderr, prints a summary table and writes
its results as JSON (``--json``, default ``results/benchmark_<name>.json``) and
a PNG plot next to it (``scripts/benchmark_plots.py``; ``--no-plot`` skips it).
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
    try:  # the machine may be shared: its load when the run started
        info["loadavg_1_5_15"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
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
# ring: ring attention over simulated CPU devices vs the single-device kernel
# ----------------------------------------------------------------------------

RING_DEFAULTS = dict(seq_len=16384, memory_seq_len=32768, repeats=5)
RING_QUICK = dict(seq_len=2048, memory_seq_len=4096, repeats=2)
RING_LAYOUTS = ("contiguous", "zigzag", "striped")
RINGATTENTION_INSTALL = "pip install ringattention einops"
SINGLE = "single device"
RINGATTENTION = "ringattention (PyPI)"


def _ring_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="float32", choices=sorted(CHECK_RTOL))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seq-len", "-n", type=int, default=None,
                   help=f"global sequence length of the timing runs (default "
                        f"{RING_DEFAULTS['seq_len']}; --quick {RING_QUICK['seq_len']})")
    p.add_argument("--devices", type=int, default=8,
                   help="devices of the ring in the timing runs (default 8; simulated CPU "
                        "devices unless the default backend has that many)")
    p.add_argument("--layouts", type=str_list, default=RING_LAYOUTS,
                   help="comma-separated subset of contiguous,zigzag,striped (default all)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True,
                   help="causal attention (default; --no-causal for full attention)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed rounds, median reported (default 5; --quick 2)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds after compiling")
    p.add_argument("--no-forward", action="store_true",
                   help="time forward+backward only (the forward pass is timed by default)")
    p.add_argument("--no-prelaid", action="store_true",
                   help="skip the zigzag/striped variants on inputs already in the ring "
                        "layout (which isolate the attention from jd.sharded's permutation)")
    p.add_argument("--memory-seq-len", type=int, default=None,
                   help=f"global sequence length of the compiled-memory table (default "
                        f"{RING_DEFAULTS['memory_seq_len']}; --quick "
                        f"{RING_QUICK['memory_seq_len']})")
    p.add_argument("--memory-devices", type=int_list, default=(1, 2, 4, 8),
                   help="ring sizes P of the compiled-memory table (default 1,2,4,8)")
    p.add_argument("--no-ringattention", action="store_true",
                   help="skip the ringattention package from PyPI")
    p.add_argument("--ra-chunk", type=int, default=512,
                   help="ringattention query/key chunk size (default 512, the block size of "
                        "jax-dilated's kernel)")
    p.add_argument("--no-projection", action="store_true",
                   help="skip the per-step critical-path projection")
    p.add_argument("--no-timing", action="store_true",
                   help="compile and report the per-device memory table only")
    p.add_argument("--implementation", default=None,
                   help="kernel implementation (default: by device kind)")
    p.add_argument("--quick", action="store_true",
                   help=f"small configuration (n={RING_QUICK['seq_len']}, memory at "
                        f"n={RING_QUICK['memory_seq_len']}, 2 rounds): a minute or two")
    p.add_argument("--seed", type=int, default=0)


def _ring_devices(jax, count: int) -> list:
    """``count`` devices of the default backend, else of the (simulated) CPU backend."""
    devices = jax.devices()
    if len(devices) < count:
        devices = jax.devices("cpu")
    if len(devices) < count:
        raise SystemExit(f"ring: need {count} devices, have {len(devices)} (set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={count} "
                         f"before JAX starts)")
    return devices[:count]


def _request_cpu_devices(count: int) -> None:
    """Ask JAX for ``count`` CPU devices; must run before JAX creates its backends."""
    import jax
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except AttributeError:  # JAX without the option: the XLA flag does the same
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}"


def _import_ringattention():
    """The ``ringattention`` package (PyPI), or ``(None, reason)``.

    ringattention 0.1.2 reads ``jax.lib.xla_bridge.get_backend()`` at import time,
    an alias that current JAX has removed; the same function lives in
    ``jax.extend.backend``. The alias is put back for the import only (this
    shim lives here, in the benchmark, never in the library).
    """
    import jax
    shimmed = False
    if not hasattr(jax.lib, "xla_bridge"):
        import jax.extend.backend
        jax.lib.xla_bridge = SimpleNamespace(get_backend=jax.extend.backend.get_backend)
        shimmed = True
    try:
        import ringattention
    except ImportError as err:
        return None, f"not installed ({err}); install it with: {RINGATTENTION_INSTALL}"
    except Exception as err:  # noqa: BLE001 - another incompatibility with this JAX
        return None, f"import failed on jax {jax.__version__}: {type(err).__name__}: {err}"
    finally:
        if shimmed:
            del jax.lib.xla_bridge
    return ringattention, ("imported with a jax.lib.xla_bridge shim" if shimmed else "imported")


def _ringattention_fn(jax, jnp, ra, mesh, *, causal: bool, chunk: int, dtype):
    """The PyPI ringattention (blockwise JAX version) inside ``jax.shard_map`` on ``mesh``.

    Its signature: ``ring_attention(q, k, v, attn_bias, segment_ids, cache_idx,
    axis_name, float32_logits, blockwise_kwargs)`` on the local shards
    ``[batch, n, heads, head_dim]`` of a contiguous sequence; causality is the
    ``causal_block_size`` kwarg (1 = per token); scale ``1/sqrt(head_dim)``.
    """
    from jax.sharding import PartitionSpec as P
    kwargs = dict(causal_block_size=1 if causal else None, query_chunk_size=chunk,
                  key_chunk_size=chunk, deterministic=True, dropout_rng=None, attn_pdrop=0.0,
                  dtype=dtype, policy=jax.checkpoint_policies.nothing_saveable,
                  precision=None, prevent_cse=False)

    def local(q, k, v):
        return ra.ringattention_jax(q, k, v, None, None, None, "seq", True, kwargs)

    spec = P(None, "seq")
    # its carries are not varying-typed, so shard_map's vma check is off for it
    return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
                         check_vma=False)


def _ring_block(local_len: int, layout: str, target: int = 512) -> int:
    """Kernel block of a ring step: the largest divisor of the chunk not above ``target``.

    Mirrors jax-dilated's choice (zigzag blocks are aligned to the two chunks of a
    shard; the kernel's default 512 otherwise) for lengths it divides.
    """
    chunk = local_len // 2 if layout == "zigzag" else local_len
    return max(d for d in range(1, min(chunk, target) + 1) if chunk % d == 0)


def _step_patterns(seq_len: int, devices: int, layout: str, block: int,
                   causal: bool) -> list[list[bytes | None]]:
    """``[step][device]``: the kernel blocks a causal ring step computes, as a key.

    Device ``d`` at step ``s`` holds the key block of device ``(d - s) mod P``; a
    kernel block (i, j) is computed unless every key of block j comes after
    every query of block i (the library's skip rule); a step with no block is
    skipped whole (``None``).
    """
    from jax_dilated.core.layouts import global_order
    pos = global_order(seq_len, devices, layout).reshape(devices, -1, block)
    q_max, k_min = pos.max(-1), pos.min(-1)
    steps = []
    for s in range(devices):
        row = []
        for d in range(devices):
            src = (d - s) % devices
            active = (k_min[src][None, :] <= q_max[d][:, None]) if causal else \
                np.ones((pos.shape[1],) * 2, bool)
            row.append(active.tobytes() if active.any() else None)
        steps.append(row)
    return steps


def _ring_projection(args, libs, progress) -> dict:
    """Critical path of a ring with one real device per shard, from measured steps.

    The simulated devices of this process share its CPU cores, so wall time
    follows the *total* work of all devices, which a layout does not change. On
    real devices every step ends at a collective (the ``ppermute``), so a ring
    takes ``sum over steps of max over devices`` of the step times: that is
    what load balancing (zigzag, striped) shortens. Each distinct step (its set
    of computed kernel blocks) is timed on one device as a kernel forward and
    backward with the positions the ring uses; communication is not counted
    (it overlaps with compute in the ring).
    """
    jax, jnp, jd = libs.jax, libs.jnp, libs.jd
    from jax_dilated.backends import KernelArgs, get_kernel
    from jax_dilated.core.layouts import global_order
    p, n = args.devices, args.seq_len // args.devices
    kernel = get_kernel(args.implementation)
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(args.seed + 1)
    shape = (args.batch, n, args.heads, args.head_dim)
    q, k, v, ct = (jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)
                   for _ in range(4))
    plans, calls, blocks = {}, {}, {}
    for layout in args.layouts:
        block = _ring_block(n, layout)
        steps = _step_patterns(args.seq_len, p, layout, block, args.causal)
        pos = global_order(args.seq_len, p, layout).reshape(p, n).astype(np.int32)
        plans[layout] = steps
        for s, row in enumerate(steps):
            for d, key in enumerate(row):
                if key is None or (block, key) in calls:
                    continue
                kargs = KernelArgs(scale=args.head_dim ** -0.5, is_causal=args.causal,
                                   block_q=block, block_k=block)
                qp, kp = jnp.asarray(pos[d]), jnp.asarray(pos[(d - s) % p])

                def loss(q_, k_, v_, ct_, qp=qp, kp=kp, kargs=kargs):
                    o = kernel.attention(q_, k_, v_, kargs, q_positions=qp,
                                         k_positions=kp)[0]
                    return jnp.sum(o.astype(jnp.float32) * ct_.astype(jnp.float32))

                exe = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v, ct).compile()
                calls[(block, key)] = (functools.partial(exe, q, k, v, ct),
                                       jax.block_until_ready)
                blocks[(block, key)] = int(np.frombuffer(key, bool).sum())
    progress.write(f"projection: {len(calls)} distinct ring steps, timing each")
    timed = time_interleaved({str(i): c for i, c in enumerate(calls.values())},
                             repeats=max(args.repeats, 3), warmup=args.warmup)
    step_s = {key: timed[str(i)]["median_s"] for i, key in enumerate(calls)}
    result = {}
    for layout, steps in plans.items():
        block = _ring_block(n, layout)
        t = [[0.0 if key is None else step_s[(block, key)] for key in row] for row in steps]
        b = [[0 if key is None else blocks[(block, key)] for key in row] for row in steps]
        result[layout] = {
            "block": block,
            "critical_path_s": sum(max(row) for row in t),
            "total_work_s": sum(sum(row) for row in t),
            # computed (query, key) pairs, blocks x block^2: comparable across layouts
            "critical_path_pairs": sum(max(row) for row in b) * block ** 2,
            "total_pairs": sum(sum(row) for row in b) * block ** 2,
            "blocks_per_step_device": b,
        }
    if "contiguous" in result:
        base = result["contiguous"]
        for r in result.values():
            r["speedup_vs_contiguous"] = base["critical_path_s"] / r["critical_path_s"]
            r["pairs_speedup_vs_contiguous"] = (base["critical_path_pairs"]
                                                / r["critical_path_pairs"])
    return result


def _memory_of(jax, fn, specs) -> dict:
    """Compiled ``memory_analysis()`` sizes (bytes) of ``jax.jit(fn)`` at ``specs``."""
    m = jax.jit(fn).lower(*specs).compile().memory_analysis()
    return {key: getattr(m, f"{key}_size_in_bytes", None)
            for key in ("temp", "argument", "output")}


def _ring_memory_jobs(args, libs, ra) -> list[tuple]:
    """``(name, devices, layout, forward fn, input spec)`` of every compiled-memory row."""
    jax, jnp, jd = libs.jax, libs.jnp, libs.jd
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_dilated.backends import KernelArgs, get_kernel
    n, dtype = args.memory_seq_len, jnp.dtype(args.dtype)
    shape = (args.batch, n, args.heads, args.head_dim)
    kernel = get_kernel(args.implementation)
    kargs = KernelArgs(scale=args.head_dim ** -0.5, is_causal=args.causal)
    attn = functools.partial(jd.ring_attention, is_causal=args.causal,
                             implementation=args.implementation)
    jobs = [(SINGLE, 1, None, lambda q, k, v: kernel.attention(q, k, v, kargs)[0],
             jax.ShapeDtypeStruct(shape, dtype))]
    biggest = max(args.memory_devices)
    for p in args.memory_devices:
        mesh = Mesh(np.array(_ring_devices(jax, p)), ("seq",))
        spec = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(None, "seq")))
        others = [lay for lay in args.layouts if lay != "contiguous"] if p == biggest else []
        for layout in ["contiguous"] + others:
            jobs.append((f"P={p} {layout}", p, layout,
                         jd.sharded(attn, mesh, seq_axis="seq", layout=layout), spec))
        if p != biggest or p == 1:
            continue
        if not args.no_prelaid:
            for layout in others:
                local = functools.partial(attn, seq_axis="seq", layout=layout)
                jobs.append((f"P={p} {layout} pre-laid-out", p, layout,
                             jax.shard_map(local, mesh=mesh, in_specs=(P(None, "seq"),) * 3,
                                           out_specs=P(None, "seq")), spec))
        if ra is not None:
            jobs.append((f"P={p} {RINGATTENTION}", p, "contiguous",
                         _ringattention_fn(jax, jnp, ra, mesh, causal=args.causal,
                                           chunk=min(args.ra_chunk, n // p), dtype=dtype),
                         spec))
    return jobs


def _ring_memory(args, libs, jobs, progress) -> dict:
    """Per-device compiled memory (forward, forward+backward) of every job."""
    jax, jnp = libs.jax, libs.jnp
    itemsize = jnp.dtype(args.dtype).itemsize
    global_bytes = args.batch * args.memory_seq_len * args.heads * args.head_dim * itemsize

    def grad_of(f):
        return jax.grad(lambda q, k, v, c: jnp.sum(f(q, k, v).astype(jnp.float32)
                                                   * c.astype(jnp.float32)),
                        argnums=(0, 1, 2))

    rows = {}
    for name, devices, layout, fn, spec in jobs:
        progress.start(f"memory: {name} n={args.memory_seq_len}")
        rows[name] = {
            "devices": devices, "layout": layout,
            "forward": _memory_of(jax, fn, [spec] * 3),
            "forward_backward": _memory_of(jax, grad_of(fn), [spec] * 4),
            # the 4 inputs (q, k, v, cotangent) of a P-device program are 1/P of the
            # global arrays each: argument bytes equal to this show per-device figures
            "argument_bytes_expected_per_device": 4 * global_bytes // devices}
        progress.done()
    base = rows[SINGLE]["forward_backward"]["temp"]
    for r in rows.values():
        r["temp_vs_single"] = r["forward_backward"]["temp"] / base if base else None
    return rows


def _undo_order(inverse: np.ndarray, x) -> np.ndarray:
    """A laid-out global array back in token order (NumPy, outside the timed code)."""
    return np.asarray(x)[:, inverse]


def _ring_variants(args, libs, ra, mesh, inputs) -> dict:
    """name -> (forward fn, its q/k/v/ct inputs placed for it, output back to token order)."""
    jax, jnp, jd = libs.jax, libs.jnp, libs.jd
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_dilated.backends import KernelArgs, get_kernel
    from jax_dilated.core.layouts import global_order
    dtype = jnp.dtype(args.dtype)
    kernel = get_kernel(args.implementation)
    kargs = KernelArgs(scale=args.head_dim ** -0.5, is_causal=args.causal)
    one = mesh.devices.flat[0]
    seq = NamedSharding(mesh, P(None, "seq"))
    on_one = [jax.device_put(jnp.asarray(x, dtype), one) for x in inputs]
    sharded = [jax.device_put(jnp.asarray(x, dtype), seq) for x in inputs]
    attn = functools.partial(jd.ring_attention, is_causal=args.causal,
                             implementation=args.implementation)
    ident = np.asarray
    variants = {SINGLE: (lambda q, k, v: kernel.attention(q, k, v, kargs)[0], on_one, ident)}
    for layout in args.layouts:
        variants[layout] = (jd.sharded(attn, mesh, seq_axis="seq", layout=layout),
                            sharded, ident)
    if not args.no_prelaid:
        for layout in args.layouts:
            if layout == "contiguous":
                continue
            order = global_order(args.seq_len, args.devices, layout)
            laid = [jax.device_put(jnp.asarray(x[:, order], dtype), seq) for x in inputs]
            local = functools.partial(attn, seq_axis="seq", layout=layout)
            f = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "seq"),) * 3,
                              out_specs=P(None, "seq"))
            back = functools.partial(_undo_order, np.argsort(order))
            variants[f"{layout} pre-laid-out"] = (f, laid, back)
    if ra is not None:
        chunk = min(args.ra_chunk, args.seq_len // args.devices)
        variants[RINGATTENTION] = (_ringattention_fn(jax, jnp, ra, mesh, causal=args.causal,
                                                     chunk=chunk, dtype=dtype),
                                   sharded, ident)
    return variants


@subcommand("ring", "ring attention on a (simulated) device mesh: memory per device, "
                    "layouts, vs the ringattention package", _ring_arguments)
def run_ring(args: argparse.Namespace) -> dict:
    """The ``ring`` benchmark; returns the JSON-able results."""
    table = RING_QUICK if args.quick else RING_DEFAULTS
    for name, value in table.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for layout in args.layouts:
        if layout not in RING_LAYOUTS:
            raise SystemExit(f"--layouts: unknown layout {layout!r} ({', '.join(RING_LAYOUTS)})")
    for what, length, p in (("--seq-len", args.seq_len, args.devices),
                            *(("--memory-seq-len", args.memory_seq_len, m)
                              for m in args.memory_devices)):
        if length % (2 * p):
            raise SystemExit(f"{what} {length} must be divisible by 2 x {p} devices")
    _request_cpu_devices(max(args.devices, *args.memory_devices))
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    import jax_dilated as jd
    libs = SimpleNamespace(jax=jax, jnp=jnp, jd=jd)

    ra, ra_status = None, "skipped (--no-ringattention)"
    if not args.no_ringattention:
        ra, ra_status = _import_ringattention()
        if ra is None:
            print(f"ringattention comparison skipped: {ra_status}", file=sys.stderr)
    config = {k: getattr(args, k) for k in (
        "dtype", "batch", "heads", "head_dim", "seq_len", "devices", "layouts", "causal",
        "repeats", "warmup", "memory_seq_len", "memory_devices", "ra_chunk",
        "implementation", "quick", "seed", "threads")}
    env = environment(args.threads)
    env["ring_devices"] = str(_ring_devices(jax, args.devices)[0].device_kind)
    env["ringattention"] = ra_status
    if ra is not None:
        try:
            from importlib.metadata import version
            env["ringattention_version"] = version("ringattention")
        except Exception:  # noqa: BLE001 - metadata is optional
            pass

    mesh = Mesh(np.array(_ring_devices(jax, args.devices)), ("seq",))
    rng = np.random.default_rng(args.seed)
    shape = (args.batch, args.seq_len, args.heads, args.head_dim)
    inputs = [rng.standard_normal(shape, dtype=np.float32) for _ in range(4)]  # q, k, v, ct
    variants = _ring_variants(args, libs, ra, mesh, inputs)
    passes = ["forward_backward"] if args.no_forward else ["forward", "forward_backward"]
    jobs = _ring_memory_jobs(args, libs, ra)
    progress = Progress(len(jobs) if args.no_timing else
                        len(jobs) + len(variants) + len(passes) + 1
                        + (not args.no_projection and args.causal), "ring")
    progress.write(f"ring: B={args.batch} n={args.seq_len} H={args.heads} D={args.head_dim} "
                   f"{args.dtype} causal={args.causal} P={args.devices} "
                   f"({env['ring_devices']} devices) layouts={','.join(args.layouts)} "
                   f"threads={args.threads} repeats={args.repeats}; ringattention: {ra_status}")

    memory = _ring_memory(args, libs, jobs, progress)
    if args.no_timing:
        progress.close()
        payload = {"benchmark": "ring", "config": config, "environment": env,
                   "memory": memory, "timing": {}, "timing_reference": None,
                   "projection": None}
        _print_ring_summary(payload)
        return payload

    # --- compile every variant, forward and forward+backward ---
    results: dict = {}
    calls = {p: {} for p in passes}
    for name, (fn, xs, _) in variants.items():
        progress.start(f"compile {name}")
        def loss(q, k, v, ct, fn=fn):
            return jnp.sum(fn(q, k, v).astype(jnp.float32) * ct.astype(jnp.float32))
        res = results[name] = {}
        for label, f, a in (("forward", fn, xs[:3]),
                            ("forward_backward", jax.grad(loss, argnums=(0, 1, 2)), xs)):
            t0 = time.perf_counter()
            exe = jax.jit(f).lower(*a).compile()
            res[label] = {"compile_s": time.perf_counter() - t0}
            if label in calls:
                calls[label][name] = (functools.partial(exe, *a), jax.block_until_ready)
            res[f"_{label}_exe"] = functools.partial(exe, *a)
        progress.done()

    # --- honesty check: every variant computes the single-device result ---
    progress.start("check outputs and gradients against the single device")
    computed = {}
    for name, (_, _, back) in variants.items():
        res = results[name]
        computed[name] = [np.asarray(back(res.pop("_forward_exe")()), np.float32)] + [
            np.asarray(back(g), np.float32) for g in res.pop("_forward_backward_exe")()]
    for name, arrays in computed.items():
        check = {key: _max_rel_diff(a, r)
                 for key, a, r in zip(("output", "dq", "dk", "dv"), arrays, computed[SINGLE])}
        worst = max(rel for _, rel in check.values())
        results[name]["check_vs_single"] = {
            **{key: {"max_abs_diff": a, "rel_to_max": r} for key, (a, r) in check.items()},
            "rtol": CHECK_RTOL[args.dtype], "agree": worst <= CHECK_RTOL[args.dtype]}
    if RINGATTENTION in computed and "contiguous" in computed:
        # the same computation on the same mesh: ringattention against our ring
        results[RINGATTENTION]["check_vs_contiguous"] = {
            f"{key}_max_abs_diff": float(np.max(np.abs(a - b)))
            for key, a, b in zip(("output", "dq", "dk", "dv"), computed[RINGATTENTION],
                                 computed["contiguous"])}
    del computed
    progress.done()
    for name, res in results.items():
        c = res["check_vs_single"]
        progress.write(f"  {name}: max |diff| vs single device: out "
                       f"{c['output']['max_abs_diff']:.1e}, grads "
                       f"{max(c[g]['max_abs_diff'] for g in ('dq', 'dk', 'dv')):.1e}"
                       + ("" if c["agree"] else "  ** DISAGREE **"))

    # --- time all variants, interleaved call by call ---
    for label in passes:
        progress.start(f"time {label.replace('_', '+')} ({len(calls[label])} variants "
                       f"x {args.repeats})")
        for name, timing in time_interleaved(calls[label], repeats=args.repeats,
                                             warmup=args.warmup).items():
            results[name][label].update(timing)
        progress.done()
    ref = "contiguous" if "contiguous" in results else SINGLE
    for name, res in results.items():
        res["speedup_vs_" + ref] = {
            label: statistics.median(b / t for b, t in zip(results[ref][label]["times_s"],
                                                           res[label]["times_s"]))
            for label in passes}

    try:
        env["loadavg_after_timing"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    projection = None
    if not args.no_projection and args.causal:
        progress.start("critical-path projection (distinct ring steps on one device)")
        projection = _ring_projection(args, libs, progress)
        progress.done()
    progress.close()

    payload = {"benchmark": "ring", "config": config, "environment": env,
               "memory": memory, "timing": results, "timing_reference": ref,
               "projection": projection}
    _print_ring_summary(payload)
    return payload


def _print_ring_summary(payload: dict) -> None:
    """Memory, timing and projection tables of a ``ring`` run."""
    cfg, env = payload["config"], payload["environment"]
    print()
    print(f"ring attention: B={cfg['batch']} H={cfg['heads']} D={cfg['head_dim']} "
          f"{cfg['dtype']} causal={cfg['causal']}; {env.get('cpu', '?')}, "
          f"{cfg['threads']} threads, {env['ring_devices']} devices")
    print()
    print(f"compiled memory per device at global n={cfg['memory_seq_len']} "
          f"(memory_analysis() of the jitted program; argument bytes = 4 inputs / P "
          f"confirm it is per device)")
    rows = []
    for name, r in payload["memory"].items():
        fb, fw = r["forward_backward"], r["forward"]
        rows.append([name, fmt_bytes(fw["temp"]), fmt_bytes(fb["temp"]),
                     "-" if r["temp_vs_single"] is None else f"{r['temp_vs_single']:.3f}",
                     fmt_bytes(fb["argument"]),
                     fmt_bytes(r["argument_bytes_expected_per_device"])])
    print_table(["program", "fwd temp", "fwd+bwd temp", "vs single", "args",
                 "4 inputs / P"], rows)
    if not payload["timing"]:
        return
    print()
    ref = payload["timing_reference"]
    print(f"timing at global n={cfg['seq_len']}, ring over P={cfg['devices']} "
          f"(median of {cfg['repeats']}, all variants interleaved; speedup = paired median "
          f"of {ref} time / variant time)")
    rows = []
    for name, r in payload["timing"].items():
        fwd = r.get("forward", {}).get("median_s")
        sp = r["speedup_vs_" + ref]
        c = r["check_vs_single"]
        rows.append([name, fmt_ms(fwd), fmt_ms(r["forward_backward"]["median_s"]),
                     "-" if "forward" not in sp else f"{sp['forward']:.2f}x",
                     f"{sp['forward_backward']:.2f}x",
                     f"{c['output']['max_abs_diff']:.1e}",
                     f"{max(c[g]['max_abs_diff'] for g in ('dq', 'dk', 'dv')):.1e}"])
    print_table(["variant", "fwd ms", "fwd+bwd ms", "fwd speedup", "fwd+bwd speedup",
                 "out |diff|", "grad |diff|"], rows)
    print("(|diff| = max abs difference from the single-device kernel, output and dq/dk/dv)")
    ra = payload["timing"].get(RINGATTENTION, {}).get("check_vs_contiguous")
    if ra:
        print("ringattention vs jax-dilated contiguous ring, max |diff|: " + ", ".join(
            f"{key} {ra[f'{key}_max_abs_diff']:.1e}" for key in ("output", "dq", "dk", "dv")))
    elif RINGATTENTION not in payload["timing"]:
        print(f"ringattention: {env.get('ringattention')}")
    proj = payload.get("projection")
    if proj:
        print()
        print(f"critical path with one real device per shard (P={cfg['devices']}): sum over "
              f"ring steps of the slowest device's step, each distinct step timed on one "
              f"device (kernel fwd+bwd), communication not counted")
        rows = [[layout, str(r["block"]), f"{r['critical_path_pairs'] / 2**20:.1f}M",
                 f"{r['total_pairs'] / 2**20:.1f}M", fmt_ms(r["critical_path_s"]),
                 fmt_ms(r["total_work_s"]),
                 f"{r.get('speedup_vs_contiguous', float('nan')):.2f}x",
                 f"{r.get('pairs_speedup_vs_contiguous', float('nan')):.2f}x"]
                for layout, r in proj.items()]
        print_table(["layout", "block", "path pairs", "total pairs", "path ms", "total ms",
                     "path speedup", "pairs speedup"], rows)
        print("(path = sum over steps of the slowest device: what one real device per shard "
              "would take; total = the work all devices do, which the simulated devices of "
              "this process share; pairs = (query, key) pairs in computed kernel blocks)")


# ----------------------------------------------------------------------------
# distributed: dilated attention with the sequence sharded over P devices
# ----------------------------------------------------------------------------

DISTRIBUTED_DEFAULTS = dict(seq_len=65536, segments=(2048, 4096, 16384, 65536),
                            rates=(1, 2, 8, 16), devices=(1, 2, 4, 8), repeats=2)
DISTRIBUTED_QUICK = dict(seq_len=8192, segments=(256, 512, 2048, 8192),
                         rates=(1, 2, 8, 16), devices=(1, 2, 4, 8), repeats=1)


def _distributed_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-len", "-n", type=int, default=None,
                   help=f"global sequence length (default {DISTRIBUTED_DEFAULTS['seq_len']}; "
                        f"--quick {DISTRIBUTED_QUICK['seq_len']})")
    p.add_argument("--segments", type=int_list, default=None,
                   help="segment lengths (default 2048,4096,16384,65536)")
    p.add_argument("--rates", type=int_list, default=None, help="dilation rates (default 1,2,8,16)")
    p.add_argument("--devices", type=int_list, default=None,
                   help="device counts P to compare (default 1,2,4,8)")
    p.add_argument("--mode", default="longnet", choices=("longnet", "head_groups"))
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--repeats", type=int, default=None,
                   help="timed forward+backward calls per P, median reported (default 2)")
    p.add_argument("--no-timing", action="store_true", help="compile and report memory only")
    p.add_argument("--quick", action="store_true",
                   help=f"small configuration (n={DISTRIBUTED_QUICK['seq_len']}): about a minute")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--allgather", action="store_true",
                   help="also compile every branch that spans all devices as an all-gather "
                        "instead of a ring, at the largest P, and compare memory")


_PERMUTE = None  # compiled regex, built on first use


def _permutes_in(hlo: str) -> list[int]:
    """Bytes moved by every collective-permute of a compiled HLO module (per device)."""
    import re
    global _PERMUTE
    if _PERMUTE is None:
        _PERMUTE = re.compile(r"=\s*(\(?[^=]*?)\s+collective-permute(?:-start)?\(")
    sizes = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "pred": 1, "s32": 4, "u32": 4}
    out = []
    for m in _PERMUTE.finditer(hlo):
        total = 0
        for dt, dims in re.findall(r"(f32|bf16|f16|f64|pred|s32|u32)\[([\d,]*)\]", m.group(1)):
            total += sizes[dt] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
        out.append(total)
    return out


def run_distributed(args: argparse.Namespace) -> dict:
    """The ``distributed`` benchmark; returns the JSON-able results."""
    table = DISTRIBUTED_QUICK if args.quick else DISTRIBUTED_DEFAULTS
    for name, value in table.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    _request_cpu_devices(max(args.devices))
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_dilated as jd
    from jax_dilated.core import branch_plans
    from jax_dilated.ops import distributed

    t, h, d = args.seq_len, args.heads, args.head_dim
    dtype = jnp.dtype(args.dtype)
    cfg = dict(segment_lengths=args.segments, dilation_rates=args.rates, mode=args.mode,
               is_causal=args.causal)
    config = {k: getattr(args, k) for k in (
        "seq_len", "segments", "rates", "devices", "mode", "causal", "batch", "heads",
        "head_dim", "dtype", "repeats", "quick", "seed", "threads")}
    env = environment(args.threads)
    devices = _ring_devices(jax, max(args.devices))
    compared = 0
    if args.allgather:  # every branch that spans all of the largest P's devices, twice
        at_most = distributed.shard_branches(tuple(zip(args.segments, args.rates)),
                                             local_len=t // max(args.devices),
                                             num_devices=max(args.devices))
        compared = 2 * sum(sb.ring_size == max(args.devices) for sb in at_most)
    progress = Progress(len(args.devices) * (1 if args.no_timing else 2) + 1 + compared,
                        "distributed")
    progress.write(f"distributed: B={args.batch} n={t} H={h} D={d} {args.dtype} "
                   f"segments={args.segments} rates={args.rates} mode={args.mode} "
                   f"causal={args.causal} P={args.devices}")

    def fwd_bwd(attn):
        def run(q, k, v, ct):
            out, vjp = jax.vjp(attn, q, k, v)
            return out, vjp(ct)
        return run

    # the single-device program: plain jd.dilated_attention, no mesh
    progress.start("compile single device")
    spec = jax.ShapeDtypeStruct((args.batch, t, h, d), dtype)
    single = fwd_bwd(functools.partial(jd.dilated_attention, **cfg))
    single_mem = _memory_of(jax, single, [spec] * 4)
    progress.done()

    rng = np.random.default_rng(args.seed)
    host = [rng.standard_normal((args.batch, t, h, d)).astype(dtype) for _ in range(4)]
    rows = {}
    for p in args.devices:
        mesh = jax.sharding.Mesh(np.array(devices[:p]), ("seq",))
        sharding = NamedSharding(mesh, P(None, "seq"))
        local = functools.partial(jd.dilated_attention, seq_axis="seq", **cfg)
        attn = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "seq"),) * 3,
                             out_specs=P(None, "seq"), check_vma=True)
        step = jax.jit(fwd_bwd(attn), in_shardings=sharding)
        progress.start(f"compile P={p}")
        specs = [jax.ShapeDtypeStruct(spec.shape, dtype, sharding=sharding)] * 4
        compiled = step.lower(*specs).compile()
        m = compiled.memory_analysis()
        permutes = _permutes_in(compiled.as_text())
        progress.done()
        plan = distributed.shard_branches(tuple(zip(args.segments, args.rates)),
                                          local_len=t // p, num_devices=p)
        heads_plans = branch_plans.plan_branches(tuple(zip(args.segments, args.rates)),
                                             seq_len=t, num_heads=h, num_kv_heads=h,
                                             mode=args.mode, offsets_rule="modulo")
        branches = []
        for sb, hp in zip(plan, heads_plans):
            tokens = sb.tokens_sent_per_step()
            # k and v blocks of n/r tokens of the gathered kv heads (no mask here)
            step_bytes = 2 * args.batch * tokens * len(hp.kv_heads) * d * dtype.itemsize
            branches.append({"segment": sb.segment_length, "rate": sb.rate,
                             "ring_size": sb.ring_size, "local": sb.is_local,
                             "tokens_per_step": tokens,
                             "local_n_over_r": (t // p) // sb.rate,
                             "bytes_per_step": step_bytes,
                             "forward_steps": sb.ring_size - 1})
        row = rows[p] = {"temp_bytes": m.temp_size_in_bytes,
                         "argument_bytes": m.argument_size_in_bytes,
                         "hlo_collective_permutes": len(permutes),
                         "hlo_permute_bytes": permutes, "branches": branches}
        if not args.no_timing:
            progress.start(f"time P={p}")
            q, k, v, ct = (jax.device_put(x, sharding) for x in host)
            row["fwd_bwd"] = time_calls(lambda: step(q, k, v, ct), repeats=args.repeats,
                                        sync=jax.block_until_ready)
            progress.done()
    if args.allgather:
        payload_allgather = _allgather_comparison(args, jax, jnp, devices, progress)
    progress.close()
    payload = {"benchmark": "distributed", "config": config, "environment": env,
               "single_device": {"temp_bytes": single_mem["temp"]}, "devices": rows}
    _print_distributed_summary(payload)
    if args.allgather:
        payload["ring_vs_allgather"] = payload_allgather
        _print_allgather_summary(payload_allgather)
    return payload


def _print_distributed_summary(payload: dict) -> None:
    cfg, single = payload["config"], payload["single_device"]["temp_bytes"]
    print()
    print(f"distributed dilated attention, global n={cfg['seq_len']}, B={cfg['batch']}, "
          f"H={cfg['heads']}, D={cfg['head_dim']}, {cfg['dtype']}, {cfg['mode']}, "
          f"causal={cfg['causal']}, segments={list(cfg['segments'])}, "
          f"rates={list(cfg['rates'])}")
    print(f"single device (no mesh) forward+backward temp memory: {fmt_bytes(single)}")
    rows = []
    for p, r in payload["devices"].items():
        t = r.get("fwd_bwd", {}).get("median_s")
        rows.append([str(p), fmt_bytes(r["temp_bytes"]), f"{r['temp_bytes'] / single:.3f}x",
                     str(r["hlo_collective_permutes"]),
                     fmt_bytes(max(r["hlo_permute_bytes"], default=0)), fmt_ms(t)])
    print_table(["P", "temp / device", "vs single", "permute ops", "largest permute",
                 "fwd+bwd ms"], rows)
    print("(temp: memory_analysis() of the compiled SPMD program, i.e. per device; permute "
          "ops: collective-permutes in the compiled forward+backward HLO (an op inside the "
          "ring's scan runs once per step); largest permute: the largest single array one "
          "moves per device (XLA emits one op per array of the k, v, dk, dv tuple); fwd+bwd: the whole simulated mesh on "
          "this machine's cores, so it is no speedup measure)")
    print()
    print("communication per device per ring step, from the shapes the code sends "
          "(k and v blocks of the gathered kv heads):")
    rows = []
    for p, r in payload["devices"].items():
        for b in r["branches"]:
            rows.append([str(p), str(b["segment"]), str(b["rate"]),
                         "local" if b["local"] else f"ring of {b['ring_size']}",
                         str(b["tokens_per_step"]), str(b["local_n_over_r"]),
                         fmt_bytes(b["bytes_per_step"]), str(b["forward_steps"])])
    print_table(["P", "segment", "rate", "runs as", "tokens/step", "n/r", "bytes/step",
                 "fwd steps"], rows)


subcommand("distributed", "dilated attention over P simulated devices: memory, "
           "communication, time", _distributed_arguments)(run_distributed)


# ----------------------------------------------------------------------------
# distributed --allgather: why spanning branches use a ring, measured
# ----------------------------------------------------------------------------

_COLLECTIVE = None  # compiled regex, built on first use


def _collectives_in(hlo: str) -> dict[str, int]:
    """Number of collective ops of each kind in a compiled HLO module."""
    import re
    global _COLLECTIVE
    if _COLLECTIVE is None:
        _COLLECTIVE = re.compile(
            r"\s(collective-permute|all-gather|reduce-scatter|all-reduce|all-to-all)"
            r"(?:-start)?\(")
    counts: dict[str, int] = {}
    for m in _COLLECTIVE.finditer(hlo):
        counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


def _allgather_comparison(args, jax, jnp, devices, progress) -> list[dict]:
    """One spanning branch at ``P = max(devices)``, as a ring and as an all-gather.

    Both run the library's dilate / undilate (``dilation.attend_dilated``) around the
    spanning branch's attention; the ring variant is what ``dilated_attention``
    does (``ring_partials`` over the devices of a segment), the all-gather variant
    gathers every device's dilated key/value block and attends to all of them at
    once (its backward, by autodiff, reduce-scatters dk/dv). Reported: compiled
    per-device temp memory of forward+backward, the collectives in the HLO, and
    the key/value tokens each device receives in the forward.
    """
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_dilated.backends import KernelArgs, get_kernel
    from jax_dilated.core import branch_plans, dilation
    from jax_dilated.ops import distributed
    from jax_dilated.ops.ring import RingConfig, ring_partials

    t, h, d, p = args.seq_len, args.heads, args.head_dim, max(args.devices)
    dtype = jnp.dtype(args.dtype)
    mesh = jax.sharding.Mesh(np.array(devices[:p]), ("seq",))
    sharding = NamedSharding(mesh, P(None, "seq"))
    spec = jax.ShapeDtypeStruct((args.batch, t, h, d), dtype, sharding=sharding)
    kargs = KernelArgs(scale=d ** -0.5, is_causal=args.causal)
    kernel = get_kernel(None)
    rows = []
    for w, r in zip(args.segments, args.rates):
        sb = distributed.shard_branches(((w, r),), local_len=t // p, num_devices=p)[0]
        if sb.ring_size != p:
            continue  # local, or a ring over a subgroup: compare where all devices share
        plan = branch_plans.plan_branches(((w, r),), seq_len=t, num_heads=h, num_kv_heads=h,
                                      mode=args.mode, offsets_rule="modulo")[0]
        cfg = RingConfig("seq", p, p, "contiguous", kargs, None)

        def ring_attend(q, k, v, valid, cfg=cfg):
            return ring_partials(q, k, v, valid, None, cfg)

        def gather_attend(q, k, v, valid):
            m = q.shape[1]
            k_all = jax.lax.all_gather(k, "seq", axis=1, tiled=True)
            v_all = jax.lax.all_gather(v, "seq", axis=1, tiled=True)
            q_pos = jax.lax.axis_index("seq") * m + jnp.arange(m, dtype=jnp.int32)
            return kernel.attention(q, k_all, v_all, kargs, q_positions=q_pos,
                                    kv_valid=valid)

        for method, attend in (("ring", ring_attend), ("all-gather", gather_attend)):
            def local(q, k, v, attend=attend, sb=sb, plan=plan):
                o, _ = dilation.attend_dilated(attend, sb.cut, plan, q, k, v, None)
                return o.astype(q.dtype)

            attn = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "seq"),) * 3,
                                 out_specs=P(None, "seq"), check_vma=False)

            def run(q, k, v, ct, attn=attn):
                out, vjp = jax.vjp(attn, q, k, v)
                return out, vjp(ct)

            progress.start(f"compile {method} for branch ({w}, {r}) at P={p}")
            compiled = jax.jit(run).lower(spec, spec, spec, spec).compile()
            progress.done()
            m = t // p // r  # dilated tokens per device and head
            rows.append({"segment": w, "rate": r, "devices": p, "method": method,
                         "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
                         "collectives": _collectives_in(compiled.as_text()),
                         "kv_tokens_received_forward": (p - 1) * m,
                         "kv_tokens_held_at_once": m if method == "ring" else p * m})
    return rows


def _print_allgather_summary(rows: list[dict]) -> None:
    if not rows:
        print("(no branch spans all devices: nothing to compare)")
        return
    print()
    print("spanning branches: ring (what the library runs) vs all-gather, forward+backward, "
          "per device")
    print_table(["segment", "rate", "P", "method", "temp / device", "k/v tokens held",
                 "k/v tokens received (fwd)", "collectives in HLO"],
                [[str(r["segment"]), str(r["rate"]), str(r["devices"]), r["method"],
                  fmt_bytes(r["temp_bytes"]), str(r["kv_tokens_held_at_once"]),
                  str(r["kv_tokens_received_forward"]),
                  ", ".join(f"{k} x{n}" for k, n in sorted(r["collectives"].items()))]
                 for r in rows])
    print("(both receive the same (P-1) n/r tokens per device; the all-gather holds all "
          "P blocks of the segment at once and reduce-scatters dk/dv of that size, the "
          "ring one block at a time and overlaps the transfer with compute)")


# ----------------------------------------------------------------------------
# block_sparse: time and memory against density, next to exact attention
# ----------------------------------------------------------------------------

BLOCK_SPARSE_DEFAULTS = dict(seq_len=32768, repeats=3)
BLOCK_SPARSE_QUICK = dict(seq_len=4096, repeats=2)


def _block_sparse_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-len", "-n", type=int, default=None,
                   help=f"sequence length (default {BLOCK_SPARSE_DEFAULTS['seq_len']}; "
                        f"--quick {BLOCK_SPARSE_QUICK['seq_len']})")
    p.add_argument("--densities", default="0.05,0.1,0.25,0.5,1.0",
                   help="block densities (RandomBlocks: every query block reads exactly "
                        "round(density x blocks) key blocks)")
    p.add_argument("--block", type=int, default=512, help="block size (default 512)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--devices", type=int, default=8,
                   help="devices for the per-device ring memory (default 8)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed rounds, median reported (default 3; --quick 2)")
    p.add_argument("--memory-only", action="store_true", help="compile only, no timing")
    p.add_argument("--quick", action="store_true",
                   help=f"small configuration (n={BLOCK_SPARSE_QUICK['seq_len']})")


def run_block_sparse(args: argparse.Namespace) -> dict:
    """The ``block_sparse`` benchmark; returns the JSON-able results."""
    table = BLOCK_SPARSE_QUICK if args.quick else BLOCK_SPARSE_DEFAULTS
    for name, value in table.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    _request_cpu_devices(args.devices)
    import jax
    import jax.numpy as jnp

    import jax_dilated as jd
    from jax_dilated import block_patterns as bp
    from jax_dilated.backends import KernelArgs, xla

    densities = tuple(float(x) for x in args.densities.split(","))
    shape = (1, args.seq_len, args.heads, args.head_dim)
    q, k, v, g = (jax.random.normal(key, shape, jnp.float32)
                  for key in jax.random.split(jax.random.key(0), 4))
    block = args.block

    def exact(q, k, v):
        kargs = KernelArgs(scale=q.shape[-1] ** -0.5, block_q=block, block_k=block)
        return xla.attention(q, k, v, kargs)[0]

    def sparse(density):
        return functools.partial(jd.block_sparse_attention, block_size=block,
                                 pattern=bp.RandomBlocks(density, seed=0))

    def fwd_bwd(f):
        return jax.grad(lambda q, k, v, g: jnp.sum(g * f(q, k, v)), argnums=(0, 1, 2))

    configs = {"exact": exact, **{f"{d:g}": sparse(d) for d in densities}}
    progress = Progress(2 * len(configs) + len(densities)
                        + (0 if args.memory_only else len(configs) + args.repeats),
                        "block_sparse")
    progress.write(f"block_sparse: n={args.seq_len} H={args.heads} D={args.head_dim} "
                   f"float32 block={block} densities={densities}")
    memory = {}
    for name, f in configs.items():
        progress.start(f"memory {name}")
        memory[name] = {"forward": _memory_of(jax, f, [q, k, v])["temp"]}
        progress.done()
        progress.start(f"memory {name} fwd+bwd")
        memory[name]["forward_backward"] = _memory_of(jax, fwd_bwd(f), [q, k, v, g])["temp"]
        progress.done()
    mesh = jax.sharding.Mesh(np.array(_ring_devices(jax, args.devices)), ("seq",))
    for d in densities:
        progress.start(f"ring memory {d:g}")
        ring = jd.sharded(sparse(d), mesh, seq_axis="seq")
        memory[f"{d:g}"]["ring_per_device_forward_backward"] = _memory_of(
            jax, fwd_bwd(ring), [q, k, v, g])["temp"]
        progress.done()
    timing = {}
    if not args.memory_only:
        calls = {}
        for name, f in configs.items():
            progress.start(f"compile {name}")
            fwd, fb = jax.jit(f), jax.jit(fwd_bwd(f))
            calls[f"{name} fwd"] = (functools.partial(fwd, q, k, v), jax.block_until_ready)
            calls[f"{name} fwd+bwd"] = (functools.partial(fb, q, k, v, g),
                                        jax.block_until_ready)
            progress.done()
        progress.start(f"{args.repeats} interleaved rounds")
        timing = time_interleaved(calls, repeats=args.repeats)
        for _ in range(args.repeats):
            progress.done()
    progress.close()
    config = {k: getattr(args, k) for k in ("seq_len", "densities", "block", "heads",
                                            "head_dim", "devices", "repeats", "quick",
                                            "threads")}
    payload = {"benchmark": "block_sparse", "config": config,
               "environment": environment(args.threads), "memory": memory,
               "timing": timing}
    _print_block_sparse_summary(payload)
    return payload


def _print_block_sparse_summary(payload: dict) -> None:
    cfg, mem, tim = payload["config"], payload["memory"], payload["timing"]
    print()
    print(f"block-sparse attention, n={cfg['seq_len']}, B=1, H={cfg['heads']}, "
          f"D={cfg['head_dim']}, float32, block {cfg['block']}, RandomBlocks patterns")
    rows = []
    for name, m in mem.items():
        t_f = tim.get(f"{name} fwd", {}).get("median_s")
        t_fb = tim.get(f"{name} fwd+bwd", {}).get("median_s")
        ex_f = tim.get("exact fwd", {}).get("median_s")
        ex_fb = tim.get("exact fwd+bwd", {}).get("median_s")
        ring = m.get("ring_per_device_forward_backward")
        rows.append([name, fmt_ms(t_f), "-" if t_f is None else f"{t_f / ex_f:.3f}x",
                     fmt_ms(t_fb), "-" if t_fb is None else f"{t_fb / ex_fb:.3f}x",
                     fmt_bytes(m["forward_backward"]), fmt_bytes(ring),
                     "-" if ring is None or not m["forward_backward"]
                     else f"{ring / m['forward_backward']:.3f}x"])
    print_table(["density", "fwd ms", "vs exact", "fwd+bwd ms", "vs exact",
                 "fwd+bwd temp", f"ring temp/device (P={cfg['devices']})", "vs one device"],
                rows)
    print("(times: medians of interleaved rounds; temp: compiled memory_analysis(); the "
          "ring column is per device through jd.sharded)")


subcommand("block_sparse", "block-sparse attention: time and memory against density, "
           "next to exact attention", _block_sparse_arguments)(run_block_sparse)


# ----------------------------------------------------------------------------
# gpu: the kernels on one accelerator (implemented in scripts/benchmark_gpu.py)
# ----------------------------------------------------------------------------

def _gpu_module():
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    import benchmark_gpu
    return benchmark_gpu


def _gpu_arguments(p: argparse.ArgumentParser) -> None:
    _gpu_module().add_arguments(p, sys.modules[__name__])


@subcommand("gpu", "dilated (both modes), ring (one device's share), its segment kernels, "
            "dense cuDNN and torch SDPA per segment on one GPU: time, tokens/s, TFLOP/s, "
            "memory (--quick --allow-cpu checks it without a GPU)", _gpu_arguments)
def run_gpu(args: argparse.Namespace) -> dict:
    return _gpu_module().run_gpu(args, sys.modules[__name__])


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
        p.add_argument("--no-plot", action="store_true",
                       help="skip the PNG plot written next to the JSON (needs matplotlib)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.threads = limit_threads(args.threads)
    payload = SUBCOMMANDS[args.command].run(args)
    path = write_json(args.json, payload)
    print(f"\nresults written to {path}")
    if not args.no_plot:
        try:
            if str(SCRIPTS) not in sys.path:
                sys.path.insert(0, str(SCRIPTS))
            from benchmark_plots import plot
            for png in plot(payload, path):
                print(f"plot written to {png}")
        except ImportError as e:
            print(f"no plot ({e}; pip install matplotlib)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
