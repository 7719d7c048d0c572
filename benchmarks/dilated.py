"""``python -m benchmarks dilated``: jd.dilated_attention on one device against its peers.

For every mode (``--modes``, default head_groups and longnet) and causality
(``--causal``, default both), ONE interleaved set (harness.time_interleaved: every
round calls every entry once, in a rotating order) times forward and
forward+backward of

* ``jax-dilated``: ``jd.dilated_attention`` under ``jax.jit``;
* ``torch SDPA/seg``: torch's CPU flash SDPA per dilated segment
  (baselines/torch_sdpa.py; both modes; the way the PyTorch library works);
* ``dilated-attention-pytorch``: the PyPI library's ``DilatedAttention`` (head_groups;
  timed only, not cross-checked: it normalises differently, see its module);
* ``jax.nn/seg``: ``jax.nn.dot_product_attention(implementation="xla")`` per dilated
  segment (the naive JAX way; longnet forward only when the JAX version gives its
  log-sum-exp no gradient);
* ``tokamax/seg``: ``tokamax.dot_product_attention(implementation="xla")`` per dilated
  segment (head_groups: it returns no log-sum-exp);
* ``jax-dilated [SPEC]`` (``--native-builds``, ``--native-dtypes``): jax-dilated again
  on another build of the native CPU kernel (an instruction set, or the kernel source
  of an earlier commit) or at another input dtype, in the same interleaved set, so
  that its ratio to the default entry is paired round by round;
* ``block matmul``: the attention-block matmuls ``[N, L, D] x [N, L, D]`` (QK^T) and
  ``[N, L, L] x [N, L, D]`` (PV) with ``L = --matmul-block``, ``N`` the best of a short
  scan, run back to back inside one compiled loop (one timed call lasts about 50 ms):
  the steady-state rate of the kernel's block matmuls with nothing between them, so the
  forward's GFLOP/s is a fraction of that ceiling, measured in the same rounds.

Forward+backward is the gradient of ``sum(out * c)`` (``c`` random) with respect to
q, k and v. GFLOP/s count the flops dilated attention needs (:func:`dilated_flops`;
forward+backward = 3.5 x forward, FlashAttention's convention), for every variant
alike. Every peer's output and gradients are compared with jax-dilated's (max |diff|
relative to max |jax-dilated|, float32 tolerance 1e-4). The compiled temp memory of
jax-dilated's forward and forward+backward is reported against n (linear is the goal).
Peers that are not installed are skipped with a message (``bash benchmarks/setup.sh``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import pathlib
import sys
import time
from collections.abc import Callable

import numpy as np

from benchmarks import harness
from benchmarks.harness import fmt_bytes, fmt_ms, fmt_spread, int_list, str_list

DEFAULTS = {"seq_len": 16384, "segments": (2048, 4096, 8192), "rates": (1, 2, 4),
            "memory_seq_lens": (16384, 32768, 65536)}
QUICK = {"seq_len": 4096, "segments": (512, 1024, 2048), "rates": (1, 2, 4),
         "memory_seq_lens": (4096, 8192, 16384)}
# agreement threshold of the cross-checks: max |diff| / max |jax-dilated|
CHECK_RTOL = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 3e-3}
MODES = ("head_groups", "longnet")
PASSES = ("forward", "forward_backward")
INSTALL = "bash benchmarks/setup.sh"
MATMUL_CALL_S = 0.05  # seconds one timed block-matmul call lasts (many pairs)

JAX_DILATED = "jax-dilated"
TORCH_SDPA = "torch SDPA/seg"
DAP = "dilated-attention-pytorch"
JAX_NN = "jax.nn/seg"
TOKAMAX = "tokamax/seg"
BLOCK_MATMUL = "block matmul"
UNSHARED = "jax-dilated, unshared"  # --unshared: each longnet branch computes all its pairs
JAX_PEERS = (JAX_NN, TOKAMAX)  # timed in their own set with jax-dilated (see _run_one)
PEERS = {"torch_sdpa": TORCH_SDPA, "dilated_attention_pytorch": DAP, "jax_nn": JAX_NN,
         "tokamax": TOKAMAX}
TORCHSCALE_NOTE = ("torchscale (the PyTorch LongNet code of its authors): the PyPI releases "
                   "(0.1.0 ... 0.3.0) do not contain its dilated attention, which exists only "
                   "in the GitHub repository; not run")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="float32", choices=sorted(CHECK_RTOL))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seq-len", "-n", type=int, default=None,
                   help=f"sequence length (default {DEFAULTS['seq_len']}; --quick "
                        f"{QUICK['seq_len']})")
    p.add_argument("--segments", type=int_list, default=None,
                   help="segment lengths, comma-separated (default 2048,4096,8192; --quick "
                        "512,1024,2048)")
    p.add_argument("--rates", type=int_list, default=None,
                   help="dilation rates, comma-separated (default 1,2,4)")
    p.add_argument("--modes", type=str_list, default=MODES,
                   help="comma-separated subset of head_groups,longnet (default both)")
    p.add_argument("--causal", nargs="?", const="yes", default="both",
                   choices=("no", "yes", "both"),
                   help="non-causal (no), causal (yes; the bare flag) or both, one set each "
                        "(default both)")
    p.add_argument("--peers", type=str_list, default=tuple(PEERS),
                   help="comma-separated subset of " + ",".join(PEERS) + " (default all; "
                        "'none' for jax-dilated alone)")
    p.add_argument("--unshared", action="store_true",
                   help="longnet: also time jax-dilated with each branch computing all its "
                        "pairs (no shared pairs, docs/semantics.md section 7) in the same set")
    p.add_argument("--memory-seq-lens", type=int_list, default=None,
                   help="sequence lengths of the compiled temp-memory table (default "
                        "16384,32768,65536; --quick 4096,8192,16384; '' skips it)")
    p.add_argument("--matmul-block", type=int, default=512,
                   help="block length L of the block-matmul reference (default 512, the "
                        "kernel's CPU block)")
    p.add_argument("--matmul-batches", type=int_list, default=(1, 2, 4, 8, 16),
                   help="batch sizes N scanned for the block-matmul reference; the fastest "
                        "joins the timed set (default 1,2,4,8,16)")
    p.add_argument("--implementation", default=None,
                   help="jd.dilated_attention implementation (default: by device kind)")
    p.add_argument("--native-builds", type=str_list, default=(),
                   help="extra jax-dilated entries, each on another build of the native CPU "
                        "kernel, in the same sets: an instruction set (amx, avx512_bf16, "
                        "avx512, avx2: JAX_DILATED_NATIVE_ISA picks the default entry's; "
                        "with --dtype bfloat16, avx512 against avx512_bf16 and amx times the "
                        "CPU's bfloat16 units against conversion to float32) or git:REV, the "
                        "kernel source of commit REV (e.g. git:688b85e) built for this "
                        "machine, called by today's Python side (float32)")
    p.add_argument("--native-dtypes", type=str_list, default=(),
                   help="extra jax-dilated entries at other input dtypes (e.g. bfloat16), in "
                        "the same sets")
    p.add_argument("--seed", type=int, default=0)


def dilated_flops(*, batch: int, seq_len: int, heads: int, head_dim: int, segments,
                  rates, mode: str, causal: bool) -> int:
    """Forward FLOPs dilated attention needs (no padding, no masked-out pairs).

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
                total += num_heads * pairs(len(range(offset, seg, r)))
    return 4 * head_dim * total * batch


@dataclasses.dataclass
class Variant:
    """One entry of a timed set.

    ``calls``: pass -> zero-argument callable; ``results()``: ``(out, (dq, dk, dv) or
    None)`` as float32 NumPy arrays, None for a variant that is timed only."""

    name: str
    calls: dict[str, Callable[[], object]]
    results: Callable[[], tuple] | None
    checked: bool = True
    note: str | None = None
    compile_s: dict = dataclasses.field(default_factory=dict)
    dtype: str | None = None  # its inputs' dtype where not --dtype (its check's tolerance)


def _resolve(args: argparse.Namespace) -> None:
    """Fill unset sizes from the default or --quick configuration; validate."""
    table = QUICK if args.quick else DEFAULTS
    for name, value in table.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for mode in args.modes:
        if mode not in MODES:
            raise SystemExit(f"--modes: unknown mode {mode!r} (choose from {', '.join(MODES)})")
    if len(args.segments) != len(args.rates):
        raise SystemExit(f"--segments {args.segments} and --rates {args.rates} differ in length")
    args.peers = () if args.peers == ("none",) else args.peers
    for peer in args.peers:
        if peer not in PEERS:
            raise SystemExit(f"--peers: unknown peer {peer!r} (choose from {', '.join(PEERS)})")
    args.causals = {"no": (False,), "yes": (True,), "both": (False, True)}[args.causal]
    from jax_dilated.backends.native import build
    for spec in args.native_builds:
        if (spec not in (*build.ISAS, *build.TEST_BUILDS)
                and not (spec.startswith("git:") and len(spec) > 4)):
            raise SystemExit(f"--native-builds: {spec!r} is neither an instruction set "
                             f"({', '.join(build.ISAS)}) nor git:REV")
    for dtype in args.native_dtypes:
        if dtype not in CHECK_RTOL:
            raise SystemExit(f"--native-dtypes: {dtype!r} (choose from "
                             f"{', '.join(CHECK_RTOL)})")


# --------------------------------------------------------------------- the variants

def _jax_variant(name, fn, inputs, *, dtype, passes=PASSES, note=None) -> Variant:
    """Compile ``fn(q, k, v)`` (forward) and the gradient of ``sum(fn * c)``."""
    import jax
    import jax.numpy as jnp
    q, k, v, c = (jnp.asarray(x, dtype) for x in inputs)

    def loss(q_, k_, v_, c_):
        return jnp.sum(fn(q_, k_, v_).astype(jnp.float32) * c_.astype(jnp.float32))

    programs = {"forward": (fn, (q, k, v)),
                "forward_backward": (jax.grad(loss, argnums=(0, 1, 2)), (q, k, v, c))}
    calls, compile_s = {}, {}
    for p in passes:
        f, f_args = programs[p]
        t0 = time.perf_counter()
        exe = jax.jit(f).lower(*f_args).compile()
        compile_s[p] = time.perf_counter() - t0
        calls[p] = functools.partial(exe, *f_args)

    def results():
        out = np.asarray(calls["forward"](), np.float32)
        grads = (tuple(np.asarray(g, np.float32) for g in calls["forward_backward"]())
                 if "forward_backward" in calls else None)
        return out, grads

    return Variant(name, calls, results, note=note, compile_s=compile_s)


def _torch_variant(name, fn, inputs, torch, *, dtype, checked=True, note=None) -> Variant:
    """``fn(q, k, v)`` on torch tensors: forward under no_grad, and autograd gradients."""
    tdtype = getattr(torch, dtype)
    q, k, v = (torch.tensor(x).to(tdtype).requires_grad_(True) for x in inputs[:3])
    c = torch.tensor(inputs[3]).to(tdtype)

    def forward():
        with torch.no_grad():
            return fn(q, k, v)

    def forward_backward():  # the gradient of sum(out * c), as on the JAX side
        return torch.autograd.grad(fn(q, k, v), (q, k, v), grad_outputs=c)

    def results():
        return (forward().float().numpy(), tuple(g.float().numpy() for g in forward_backward()))

    return Variant(name, {"forward": forward, "forward_backward": forward_backward},
                   results if checked else None, checked=checked, note=note)


def _block_matmul(args, dtype, progress) -> tuple[dict, Callable[[], object]]:
    """Scan N for the attention-block matmuls; return the scan and the timed callable.

    The reference is the kernel's own loop with the softmax taken out: one query block
    ``Q`` [N, L, D] against ``reps`` key/value blocks in one compiled loop
    (``lax.fori_loop``), each round ``S = Q K_i^T`` ([N, L, L]) and ``acc += S V_i``,
    ``K_i``/``V_i`` cycling through 8 distinct blocks (nothing can be hoisted out of
    the loop). No dispatch or allocation between the products: the steady-state rate
    the kernel's matmuls could reach if the softmax cost nothing, the ceiling
    "forward as % of block matmul" is measured against. ``reps`` makes a call last
    about ``MATMUL_CALL_S``.
    """
    import jax
    import jax.numpy as jnp
    L, D = args.matmul_block, args.head_dim
    keys = jax.random.split(jax.random.key(1), 3)

    def pairs(n, reps):
        q = jax.random.normal(keys[0], (n, L, D), dtype)
        ks = jax.random.normal(keys[1], (8, n, L, D), dtype)
        vs = jax.random.normal(keys[2], (8, n, L, D), dtype)

        @jax.jit
        def run(q, ks, vs):
            def one(i, acc):
                k = jax.lax.dynamic_index_in_dim(ks, i % 8, 0, keepdims=False)
                v = jax.lax.dynamic_index_in_dim(vs, i % 8, 0, keepdims=False)
                s = jnp.einsum("nqd,nkd->nqk", q, k, preferred_element_type=jnp.float32)
                return acc + jnp.einsum("nqk,nkd->nqd", s.astype(dtype), v,
                                        preferred_element_type=jnp.float32)
            return jax.lax.fori_loop(0, reps, one, jnp.zeros(q.shape, jnp.float32))

        return lambda: run(q, ks, vs)

    scan, pair_s = {}, {}
    probe = 8
    for n in args.matmul_batches:
        t = harness.time_calls(pairs(n, probe), repeats=max(5, args.repeats), warmup=1)
        pair_s[n] = t.median / probe
        scan[n] = 4 * n * L * L * D / pair_s[n] / 1e9
    best = max(scan, key=scan.get)
    reps = max(1, round(MATMUL_CALL_S / pair_s[best]))
    progress.write(f"block matmul L={L} D={D} (in one compiled loop): GFLOP/s by N "
                   + ", ".join(f"{n}: {g:.1f}" for n, g in scan.items())
                   + f"; timed: N={best}, {reps} pairs per call")
    info = {"block": L, "head_dim": D, "scan_gflops": scan, "batch": best,
            "pairs_per_call": reps, "flops": 4 * best * L * L * D * reps,
            "method": "one query block against reps key/value blocks in one lax.fori_loop: "
                      "S = Q K^T, acc += S V"}
    return info, pairs(best, reps)


@contextlib.contextmanager
def _native_build(spec: str):
    """Programs compiled inside run on the native kernel's build ``spec``
    (``--native-builds``): an instruction set, or ``git:REV``, the kernel source of
    commit REV written to a temporary file and built for this machine."""
    from jax_dilated.backends.native import build
    if spec.startswith("git:"):
        source = _git_kernel_source(spec[4:])
        switch = build.using(source=source)
    else:
        switch = build.using(isa=spec)
    with switch:
        why = build.load()
        if why is not None:
            raise SystemExit(f"--native-builds {spec}: the native kernel cannot run: {why}")
        yield


@functools.lru_cache(maxsize=None)
def _git_kernel_source(rev: str) -> str:
    """The native kernel's source at commit ``rev`` in a temporary file (kept for the
    process: the build is cached by its content)."""
    import subprocess
    import tempfile
    from jax_dilated.backends.native import build
    relative = build.SOURCE.relative_to(harness.ROOT).as_posix()
    run = subprocess.run(["git", "-C", str(harness.ROOT), "show", f"{rev}:{relative}"],
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"--native-builds git:{rev}: {run.stderr.strip()}")
    path = pathlib.Path(tempfile.mkdtemp(prefix="jax_dilated_kernel_")) / f"attention_cpu-{rev}.cc"
    path.write_text(run.stdout)
    return str(path)


@contextlib.contextmanager
def _each_branch_all_pairs():
    """Programs traced inside compute every longnet branch's pairs, shared ones
    included: ``nested_order`` answers None, as for branches that do not nest."""
    from jax_dilated.core import branch_plans as plans
    nested_order = plans.nested_order
    plans.nested_order = lambda *args, **kw: None
    try:
        yield
    finally:
        plans.nested_order = nested_order


def _variants(args, mode, causal, inputs, libs, notes) -> list[Variant]:
    """jax-dilated and the available peers for one (mode, causal)."""
    jd = libs["jd"]
    cfg = {"segment_lengths": args.segments, "dilation_rates": args.rates, "is_causal": causal}
    out = [_jax_variant(JAX_DILATED, functools.partial(
        jd.dilated_attention, mode=mode, implementation=args.implementation, **cfg),
        inputs, dtype=args.dtype)]
    if args.unshared and mode == "longnet":
        with _each_branch_all_pairs():  # compiled here, so the program keeps it
            out.append(_jax_variant(UNSHARED, functools.partial(
                jd.dilated_attention, mode=mode, implementation=args.implementation, **cfg),
                inputs, dtype=args.dtype))
    for spec in args.native_builds:
        with _native_build(spec):  # compiled here, so the program keeps that build
            out.append(_jax_variant(f"{JAX_DILATED} [{spec}]", functools.partial(
                jd.dilated_attention, mode=mode, implementation=args.implementation, **cfg),
                inputs, dtype=args.dtype))
    for dtype in args.native_dtypes:
        out.append(_jax_variant(f"{JAX_DILATED} [{dtype}]", functools.partial(
            jd.dilated_attention, mode=mode, implementation=args.implementation, **cfg),
            inputs, dtype=dtype))
        out[-1].dtype = dtype
    torch = libs.get("torch")
    if "torch_sdpa" in libs:
        td = libs["torch_sdpa"]
        out.append(_torch_variant(TORCH_SDPA, functools.partial(td.dilated_attention, mode=mode,
                                                                **cfg),
                                  inputs, torch, dtype=args.dtype))
    if "dilated_attention_pytorch" in libs:
        if mode == "head_groups":
            dap = libs["dilated_attention_pytorch"].load()(
                segment_lengths=list(args.segments), dilation_rates=list(args.rates))
            out.append(_torch_variant(
                DAP, functools.partial(dap, is_causal=causal), inputs, torch, dtype=args.dtype,
                checked=False, note="timed only: divides each branch by its sum over the "
                "segment and mis-places unequal head groups (see its module)"))
        else:
            notes.add(f"{DAP}: head_groups only (the library has no longnet mode)")
    if "jax_nn" in libs:
        jp = libs["jax_nn"]
        passes, note = PASSES, None
        if mode == "longnet" and not jp.lse_has_gradient():
            passes = ("forward",)
            note = ("forward only: jax.nn.dot_product_attention's log-sum-exp has no "
                    "gradient in this JAX version")
            notes.add(f"{JAX_NN} longnet: {note}")
        out.append(_jax_variant(JAX_NN, functools.partial(jp.dilated_attention, mode=mode,
                                                          **cfg),
                                inputs, dtype=args.dtype, passes=passes, note=note))
    if "tokamax" in libs:
        tp = libs["tokamax"]
        if mode in tp.MODES:
            out.append(_jax_variant(TOKAMAX, functools.partial(tp.dilated_attention, mode=mode,
                                                               **cfg),
                                    inputs, dtype=args.dtype))
        else:
            notes.add(f"{TOKAMAX}: head_groups only ({tp.LONGNET_UNSUPPORTED})")
    return out


def _load_peers(args, progress, notes) -> dict:
    """Import jax_dilated and the requested peers; a missing peer is skipped with a note."""
    import jax_dilated as jd
    libs = {"jd": jd}
    peers = set(args.peers)
    if peers & {"torch_sdpa", "dilated_attention_pytorch"}:
        torch = harness.torch_threads(args.threads)
        if torch is None:
            notes.add(f"peer torch not installed: torch SDPA and {DAP} skipped "
                      "(pip install torch==2.13.0)")
            peers -= {"torch_sdpa", "dilated_attention_pytorch"}
        libs["torch"] = torch
    if "torch_sdpa" in peers:
        from benchmarks.baselines import torch_sdpa
        try:
            torch_sdpa.check_config(args.seq_len, args.segments, args.rates)
            libs["torch_sdpa"] = torch_sdpa
        except ValueError as err:
            notes.add(f"{TORCH_SDPA} skipped: {err}")
    if "dilated_attention_pytorch" in peers:
        from benchmarks.baselines import dilated_attention_pytorch as dap
        why = dap.available()
        if why is None:
            libs["dilated_attention_pytorch"] = dap
        else:
            notes.add(why)
    from benchmarks.baselines import jax_per_segment
    if peers & {"jax_nn", "tokamax"}:
        try:
            jax_per_segment.check_config(args.seq_len, args.segments, args.rates)
        except ValueError as err:
            names = [PEERS[p] for p in ("jax_nn", "tokamax") if p in peers]
            notes.add(f"{' and '.join(names)} skipped: {err}")
            peers -= {"jax_nn", "tokamax"}
    if "jax_nn" in peers:
        libs["jax_nn"] = jax_per_segment
    if "tokamax" in peers:
        from benchmarks.baselines import tokamax_per_segment
        why = tokamax_per_segment.available()
        if why is None:
            libs["tokamax"] = tokamax_per_segment
        else:
            notes.add(why)
    notes.add(TORCHSCALE_NOTE)
    for note in sorted(notes):
        progress.write(note)
    return libs


class _Notes(list):
    """Ordered set of notes printed once."""

    def add(self, note: str) -> None:
        if note not in self:
            self.append(note)


# ------------------------------------------------------------------------ one run

def _cross_check(variants: list[Variant], dtype: str) -> dict:
    """Each checked peer's output and gradients against jax-dilated's."""
    ref_out, ref_grads = variants[0].results()
    checks = {}
    for var in variants[1:]:
        if var.results is None:
            checks[var.name] = {"checked": False, "why": var.note}
            continue
        out, grads = var.results()
        check = {"output": harness.max_rel_diff(out, ref_out)}
        if grads is not None:
            for name, g, ref in zip("qkv", grads, ref_grads):
                check[f"d{name}"] = harness.max_rel_diff(g, ref)
        worst = max(c["rel_to_max"] for c in check.values())
        rtol = CHECK_RTOL[var.dtype or dtype]
        checks[var.name] = {"checked": True, **check, "worst_rel": worst,
                            "rtol": rtol, "agree": worst <= rtol}
    return checks


def _run_one(args, mode, causal, inputs, libs, matmul, progress, notes) -> dict:
    """Compile, cross-check and time every variant of one (mode, causal) in one set."""
    label = f"{mode}{' causal' if causal else ''}"
    progress.start(f"{label}: compile and cross-check")
    variants = _variants(args, mode, causal, inputs, libs, notes)
    checks = _cross_check(variants, args.dtype)
    for name, c in checks.items():
        if c["checked"]:
            progress.write(f"{label}: {name} vs {JAX_DILATED}: max rel diff {c['worst_rel']:.1e}"
                           + ("" if c["agree"] else "  ** DISAGREE **"))
    progress.done()

    # Two interleaved sets, jax-dilated in both: the PyTorch peers with the block-matmul
    # reference, then the JAX per-segment peers, which materialise gigabytes of logits.
    # After such a call the kernel's page work in the background slowed whatever ran
    # next (a 120 ms jax-dilated call took 215 ms right after jax.nn/seg, 135 ms even
    # 0.5 s later; the lead-in call of time_interleaved absorbs only part of it), so in
    # one set those peers taxed the JAX programs that followed them, jax-dilated and the
    # reference, more than the PyTorch ones. Each peer is compared with jax-dilated of its
    # own set; the table's jax-dilated row is the first set's.
    timings = {}
    groups = [[v for v in variants if v.name not in JAX_PEERS],
              [v for v in variants if v.name == JAX_DILATED or v.name in JAX_PEERS]]
    for g, group in enumerate(groups):
        if g and len(group) < 2:
            continue
        progress.start(f"{label}: time {', '.join(v.name for v in group)}"
                       + ("" if g else " + block matmul") + f", {args.repeats} rounds")
        calls = {f"{var.name}|{p}": fn for var in group for p, fn in var.calls.items()}
        if not g:
            calls[BLOCK_MATMUL] = matmul["call"]
        got = harness.time_interleaved(calls, repeats=args.repeats, warmup=args.warmup)
        if g:  # keep the first set's jax-dilated as the reference row
            got = {(f"{JAX_DILATED} (JAX-peer set)|" + key.split("|")[1]
                    if key.startswith(JAX_DILATED + "|") else key): t for key, t in got.items()}
        timings.update(got)
        progress.done()

    flops = dilated_flops(batch=args.batch, seq_len=args.seq_len, heads=args.heads,
                          head_dim=args.head_dim, segments=args.segments, rates=args.rates,
                          mode=mode, causal=causal)
    pass_flops = {"forward": flops, "forward_backward": 3.5 * flops}
    block = timings[BLOCK_MATMUL]
    block_gflops = matmul["info"]["flops"] / block.median / 1e9
    ref = {p: timings.get(f"{JAX_DILATED}|{p}") for p in PASSES}
    result = {"mode": mode, "causal": causal, "flops": pass_flops,
              "flops_convention": "needed pairs only; forward+backward = 3.5 x forward",
              "block_matmul": {**block.to_json(), "gflops": block_gflops},
              "variants": {}, "checks": checks}
    for var in variants:
        entry = result["variants"][var.name] = {"compile_s": var.compile_s, "note": var.note}
        for p in var.calls:
            t = timings[f"{var.name}|{p}"]
            gflops = pass_flops[p] / t.median / 1e9
            entry[p] = {**t.to_json(), "gflops": gflops,
                        "fraction_of_block_matmul": gflops / block_gflops}
            if var.name != JAX_DILATED:
                own = ref if var.name not in JAX_PEERS else {
                    q: timings.get(f"{JAX_DILATED} (JAX-peer set)|{q}") for q in PASSES}
                entry[p]["over_jax_dilated"] = t.median / own[p].median
                entry[p]["over_jax_dilated_paired"] = harness.paired_ratio(t, own[p])
                entry[p]["timing_set"] = "jax-peers" if var.name in JAX_PEERS else "torch"
    second = {p: timings.get(f"{JAX_DILATED} (JAX-peer set)|{p}") for p in PASSES}
    if any(second.values()):
        result["jax_dilated_in_jax_peer_set"] = {p: t.to_json() for p, t in second.items() if t}
    return result


def _memory(args, mode, causal, libs, progress) -> dict:
    """Compiled temp memory of jax-dilated's forward and forward+backward against n."""
    import jax
    import jax.numpy as jnp
    jd = libs["jd"]
    attn = functools.partial(jd.dilated_attention, segment_lengths=args.segments,
                             dilation_rates=args.rates, mode=mode, is_causal=causal,
                             implementation=args.implementation)

    def loss(q, k, v, c):
        return jnp.sum(attn(q, k, v).astype(jnp.float32) * c.astype(jnp.float32))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    by_n = {}
    for n in args.memory_seq_lens:
        progress.start(f"{mode}{' causal' if causal else ''}: memory n={n}")
        spec = jax.ShapeDtypeStruct((args.batch, n, args.heads, args.head_dim),
                                    jnp.dtype(args.dtype))
        by_n[str(n)] = {"forward": harness.compiled_memory(attn, spec, spec, spec).to_json(),
                        "forward_backward": harness.compiled_memory(
                            grad, spec, spec, spec, spec).to_json()}
        progress.done()
    lens = sorted(args.memory_seq_lens)
    res = {"mode": mode, "causal": causal, "by_seq_len": by_n}
    if len(lens) > 1:
        lo, hi = by_n[str(lens[0])], by_n[str(lens[-1])]
        res["growth"] = {"length_ratio": lens[-1] / lens[0],
                         **{p: hi[p]["temp"] / lo[p]["temp"] if lo[p]["temp"] else None
                            for p in PASSES}}
    return res


@harness.register("dilated", "dilated attention on one device against torch SDPA per segment, "
                  "dilated-attention-pytorch, jax.nn and tokamax per segment: time, GFLOP/s "
                  "vs block matmul, memory", add_arguments, repeats=7, quick_repeats=3)
def run(args: argparse.Namespace) -> dict:
    """The ``dilated`` benchmark; returns the JSON-able payload."""
    _resolve(args)
    import jax.numpy as jnp
    notes = _Notes()
    combos = [(m, c) for m in args.modes for c in args.causals]
    progress = harness.Progress(
        1 + 2 * len(combos) + len(combos) * len(args.memory_seq_lens), "dilated")
    progress.write(f"dilated: B={args.batch} n={args.seq_len} H={args.heads} D={args.head_dim} "
                   f"{args.dtype} segments={args.segments} rates={args.rates} "
                   f"modes={','.join(args.modes)} causal={args.causal} threads={args.threads} "
                   f"repeats={args.repeats}")
    libs = _load_peers(args, progress, notes)

    progress.start("block matmul scan")
    info, call = _block_matmul(args, jnp.dtype(args.dtype), progress)
    matmul = {"info": info, "call": call}
    progress.done()

    rng = np.random.default_rng(args.seed)
    shape = (args.batch, args.seq_len, args.heads, args.head_dim)
    inputs = [rng.standard_normal(shape, dtype=np.float32) for _ in range(4)]  # q, k, v, c
    runs = [_run_one(args, m, c, inputs, libs, matmul, progress, notes) for m, c in combos]
    memory = {}
    if args.memory_seq_lens:
        for m, c in combos:
            memory[f"{m}{' causal' if c else ''}"] = _memory(args, m, c, libs, progress)
    progress.close()

    env = harness.environment(args.threads, args.load)
    from jax_dilated.backends import native
    env["native_kernel"] = native.instruction_set() or f"not used: {native.unavailable_reason()}"
    config = {k: getattr(args, k) for k in (
        "dtype", "batch", "heads", "head_dim", "seq_len", "segments", "rates", "modes",
        "causal", "peers", "repeats", "warmup", "memory_seq_lens", "matmul_block",
        "matmul_batches", "implementation", "native_builds", "native_dtypes", "quick",
        "seed", "threads")}
    payload = {"benchmark": "dilated", "config": config, "environment": env,
               "notes": list(notes), "block_matmul": info, "runs": runs, "memory": memory}
    print_summary(payload)
    return payload


# ----------------------------------------------------------------------- the tables

def print_summary(payload: dict) -> None:
    """One timing table per (mode, causal), the cross-checks, notes and the memory table."""
    cfg, env = payload["config"], payload["environment"]
    print()
    print(f"dilated attention: B={cfg['batch']} n={cfg['seq_len']} H={cfg['heads']} "
          f"D={cfg['head_dim']} {cfg['dtype']} segments={list(cfg['segments'])} "
          f"rates={list(cfg['rates'])}, {cfg['threads']} threads, median of {cfg['repeats']} "
          f"interleaved rounds; {env.get('cpu')}, native kernel "
          f"{env.get('native_kernel', '-')}, jax {env.get('jax')}, torch "
          f"{env.get('torch')}, commit {str(env.get('git_commit'))[:10]}"
          f"{' (dirty)' if env.get('git_dirty') else ''}, {env.get('date_utc')}")
    print()
    headers = ["variant", "fwd ms", "spread", "fwd+bwd ms", "spread", "fwd x", "fwd+bwd x",
               "fwd GF/s", "% blk mm", "f+b GF/s", "check"]
    for run in payload["runs"]:
        rows = []
        for name, var in run["variants"].items():
            fwd, fb = var.get("forward"), var.get("forward_backward")
            check = run["checks"].get(name)
            rows.append([
                name, fmt_ms(fwd and fwd["median_s"]), fmt_spread(fwd and fwd["spread"]),
                fmt_ms(fb and fb["median_s"]), fmt_spread(fb and fb["spread"]),
                _ratio(fwd), _ratio(fb),
                f"{fwd['gflops']:.1f}" if fwd else "-",
                f"{100 * fwd['fraction_of_block_matmul']:.0f}%" if fwd else "-",
                f"{fb['gflops']:.1f}" if fb else "-",
                "ref" if check is None else ("timed only" if not check["checked"] else
                                             f"{check['worst_rel']:.0e}"
                                             + ("" if check["agree"] else " DISAGREE"))])
        bm = run["block_matmul"]
        mm = payload["block_matmul"]
        rows.append([f"{BLOCK_MATMUL} N={mm['batch']} x{mm['pairs_per_call']}",
                     fmt_ms(bm["median_s"]), fmt_spread(bm["spread"]), "-", "-", "-", "-",
                     f"{bm['gflops']:.1f}", "100%", "-", "-"])
        print_title = (f"{run['mode']}, {'causal' if run['causal'] else 'non-causal'}: "
                       f"{run['flops']['forward'] / 1e9:.1f} GFLOP forward")
        harness.print_table(print_title, headers, rows, env=env)
    print(f"x = variant time / {JAX_DILATED} time (> 1: {JAX_DILATED} is faster; "
          f"{', '.join(JAX_PEERS)} timed in a second interleaved set with {JAX_DILATED} "
          f"and compared with its time there); spread = "
          f"(max - min) / median; GF/s = needed flops / median time (forward+backward "
          f"counted as 3.5 x forward); % blk mm = forward GFLOP/s / block-matmul GFLOP/s of "
          f"the same rounds ([N,{cfg['matmul_block']},{cfg['head_dim']}] QK^T + PV in one compiled loop); check = "
          f"max |diff| / max |{JAX_DILATED}| of output and gradients (tolerance "
          f"{CHECK_RTOL[cfg['dtype']]:g})")
    for note in payload["notes"]:
        print(f"note: {note}")
    print()
    if payload["memory"]:
        lens = [str(n) for n in cfg["memory_seq_lens"]]
        rows = []
        for key, mem in payload["memory"].items():
            for p in ("forward_backward", "forward"):
                growth = mem.get("growth", {}).get(p)
                rows.append([key, p.replace("_", "+")]
                            + [fmt_bytes(mem["by_seq_len"][n][p]["temp"]) for n in lens]
                            + ["-" if growth is None else f"{growth:.2f}"])
        head = f"n={lens[-1]}/n={lens[0]}" if len(lens) > 1 else "growth"
        harness.print_table(f"{JAX_DILATED} compiled temp memory (memory_analysis)",
                            ["config", "pass"] + [f"n={n}" for n in lens] + [head], rows,
                            env=env)


def _ratio(entry) -> str:
    if not entry or "over_jax_dilated" not in entry:
        return "-"
    return f"{entry['over_jax_dilated']:.2f}"


if __name__ == "__main__":
    sys.exit("run it as: python -m benchmarks dilated [options]")
