"""``python -m benchmarks ring``: ring attention on a (simulated) device mesh.

Causal ring attention (``jd.sharded(jd.ring_attention, ...)`` under ``jax.jit``) on
8 simulated CPU devices (the op requests them before JAX starts) against the
single-device blockwise kernel on the same global problem:

* per-device compiled memory (``harness.compiled_memory``) of forward and
  forward+backward for P = 1, 2, 4, 8 (default global n = 32768), the other layouts
  and the ``ringattention`` peer at the largest P; argument bytes equal to 4 inputs
  / P confirm the figures are per device;
* forward and forward+backward times (``harness.time_interleaved``: every variant
  once per round, rotating order; medians and spread) of the contiguous, zigzag and
  striped layouts (through ``jd.sharded`` and on inputs already in the layout) and
  of the ``ringattention`` package from PyPI (optional peer: ``bash
  benchmarks/setup.sh``; run inside ``jax.shard_map`` on the same mesh and inputs),
  default n = 16384; every variant's output and gradients are checked against the
  single-device kernel, and ringattention's against our contiguous ring;
* a projection: the simulated devices share this process's cores, so wall time
  follows the total work, which a layout does not change. Each distinct ring step
  is timed on one device and the critical path (sum over steps of the slowest
  device) that real devices, one per shard, would see is reported.

``--quick``: n = 2048 (memory at 4096), a minute or two; ``--no-timing``: the
memory table only.
"""

from __future__ import annotations

import argparse
import functools
import sys

import numpy as np

from benchmarks import devices as dev
from benchmarks import harness
from benchmarks.baselines import ringattention as ra_peer
from benchmarks.dilated import CHECK_RTOL
from benchmarks.harness import fmt_bytes, fmt_ms, fmt_spread, int_list, str_list

DEFAULTS = dict(seq_len=16384, memory_seq_len=32768)
QUICK = dict(seq_len=2048, memory_seq_len=4096)
LAYOUTS = ("contiguous", "zigzag", "striped")
SINGLE = "single device"
RINGATTENTION = ra_peer.NAME


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="float32", choices=sorted(CHECK_RTOL))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seq-len", "-n", type=int, default=None,
                   help=f"global sequence length of the timing runs (default "
                        f"{DEFAULTS['seq_len']}; --quick {QUICK['seq_len']})")
    p.add_argument("--devices", type=int, default=8,
                   help="devices of the ring in the timing runs (default 8; simulated CPU "
                        "devices unless the default backend has that many)")
    p.add_argument("--layouts", type=str_list, default=LAYOUTS,
                   help="comma-separated subset of contiguous,zigzag,striped (default all)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True,
                   help="causal attention (default; --no-causal for full attention)")
    p.add_argument("--no-forward", action="store_true",
                   help="time forward+backward only (the forward pass is timed by default)")
    p.add_argument("--no-prelaid", action="store_true",
                   help="skip the zigzag/striped variants on inputs already in the ring "
                        "layout (which isolate the attention from jd.sharded's permutation)")
    p.add_argument("--memory-seq-len", type=int, default=None,
                   help=f"global sequence length of the compiled-memory table (default "
                        f"{DEFAULTS['memory_seq_len']}; --quick {QUICK['memory_seq_len']})")
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
    p.add_argument("--seed", type=int, default=0)


def _resolve(args: argparse.Namespace) -> None:
    for name, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for layout in args.layouts:
        if layout not in LAYOUTS:
            raise SystemExit(f"--layouts: unknown layout {layout!r} ({', '.join(LAYOUTS)})")
    for what, length, p in (("--seq-len", args.seq_len, args.devices),
                            *(("--memory-seq-len", args.memory_seq_len, m)
                              for m in args.memory_devices)):
        if length % (2 * p):
            raise SystemExit(f"{what} {length} must be divisible by 2 x {p} devices")


# ------------------------------------------------------------------ memory per device

def _memory_jobs(args, ra) -> list[tuple]:
    """``(name, devices, layout, forward fn, input spec)`` of every compiled-memory row."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_dilated as jd
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
        mesh = dev.seq_mesh(p)
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
                         ra_peer.ring_fn(ra, mesh, causal=args.causal,
                                         chunk=min(args.ra_chunk, n // p), dtype=dtype),
                         spec))
    return jobs


def _memory(args, jobs, progress) -> dict:
    """Per-device compiled memory (forward, forward+backward) of every job."""
    import jax.numpy as jnp
    itemsize = jnp.dtype(args.dtype).itemsize
    global_bytes = args.batch * args.memory_seq_len * args.heads * args.head_dim * itemsize
    rows = {}
    for name, devices, layout, fn, spec in jobs:
        progress.start(f"memory: {name} n={args.memory_seq_len}")
        rows[name] = {
            "devices": devices, "layout": layout,
            "forward": harness.compiled_memory(fn, spec, spec, spec).to_json(),
            "forward_backward": harness.compiled_memory(dev.grad_of(fn), *[spec] * 4).to_json(),
            # the 4 inputs (q, k, v, cotangent) of a P-device program are 1/P of the
            # global arrays each: argument bytes equal to this show per-device figures
            "argument_bytes_expected_per_device": 4 * global_bytes // devices}
        progress.done()
    base = rows[SINGLE]["forward_backward"]["temp"]
    for r in rows.values():
        r["temp_vs_single"] = r["forward_backward"]["temp"] / base if base else None
    return rows


# ------------------------------------------------------------------------- timing

def _undo_order(inverse: np.ndarray, x) -> np.ndarray:
    """A laid-out global array back in token order (NumPy, outside the timed code)."""
    return np.asarray(x)[:, inverse]


def _variants(args, ra, mesh, inputs) -> dict:
    """name -> (forward fn, its q/k/v/ct inputs placed for it, output back to token order)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_dilated as jd
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
        variants[RINGATTENTION] = (ra_peer.ring_fn(ra, mesh, causal=args.causal, chunk=chunk,
                                                   dtype=dtype), sharded, ident)
    return variants


def _compile(variants, passes, progress) -> tuple[dict, dict, dict]:
    """Compile every variant's forward and forward+backward.

    Returns ``(results, calls, runs)``: compile seconds per variant and pass, the
    timed calls ``{pass: {name: fn}}``, and ``{name: (forward, forward+backward)}``
    zero-argument calls for the cross-check."""
    import time

    import jax
    results, runs = {}, {}
    calls = {p: {} for p in passes}
    for name, (fn, xs, _) in variants.items():
        progress.start(f"compile {name}")
        res = results[name] = {}
        bound = []
        for label, f, a in (("forward", fn, xs[:3]), ("forward_backward", dev.grad_of(fn), xs)):
            t0 = time.perf_counter()
            exe = jax.jit(f).lower(*a).compile()
            res[label] = {"compile_s": time.perf_counter() - t0}
            bound.append(functools.partial(exe, *a))
            if label in calls:
                calls[label][name] = bound[-1]
        runs[name] = tuple(bound)
        progress.done()
    return results, calls, runs


def _cross_check(args, variants, runs, results) -> None:
    """Every variant's output and gradients against the single device (in ``results``)."""
    rtol = CHECK_RTOL[args.dtype]
    computed = {}
    for name, (_, _, back) in variants.items():
        fwd, fwd_bwd = runs[name]
        computed[name] = [np.asarray(back(fwd()), np.float32)] + [
            np.asarray(back(g), np.float32) for g in fwd_bwd()]
    keys = ("output", "dq", "dk", "dv")
    for name, arrays in computed.items():
        check = {key: harness.max_rel_diff(a, r)
                 for key, a, r in zip(keys, arrays, computed[SINGLE])}
        worst = max(c["rel_to_max"] for c in check.values())
        results[name]["check_vs_single"] = {**check, "rtol": rtol, "agree": worst <= rtol}
    if RINGATTENTION in computed and "contiguous" in computed:
        # the same computation on the same mesh: ringattention against our ring
        results[RINGATTENTION]["check_vs_contiguous"] = {
            f"{key}_max_abs_diff": float(np.max(np.abs(a - b)))
            for key, a, b in zip(keys, computed[RINGATTENTION], computed["contiguous"])}


# --------------------------------------------------------------------- projection

def ring_block(local_len: int, layout: str, target: int = 512) -> int:
    """Kernel block of a ring step: the largest divisor of the chunk not above ``target``.

    Mirrors jax-dilated's choice (zigzag blocks are aligned to the two chunks of a
    shard; the kernel's default 512 otherwise) for lengths it divides.
    """
    chunk = local_len // 2 if layout == "zigzag" else local_len
    return max(d for d in range(1, min(chunk, target) + 1) if chunk % d == 0)


def step_patterns(seq_len: int, devices: int, layout: str, block: int,
                  causal: bool) -> list[list[bytes | None]]:
    """``[step][device]``: the kernel blocks a ring step computes, as a key.

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


def _projection(args, progress) -> dict:
    """Critical path of a ring with one real device per shard, from measured steps.

    On real devices every step ends at a collective (the ``ppermute``), so a ring
    takes ``sum over steps of max over devices`` of the step times: that is what
    load balancing (zigzag, striped) shortens. Each distinct step (its set of
    computed kernel blocks) is timed on one device as a kernel forward and backward
    with the positions the ring uses; communication is not counted (it overlaps
    with compute in the ring).
    """
    import jax
    import jax.numpy as jnp

    from jax_dilated.backends import KernelArgs, Masks, get_kernel
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
        block = ring_block(n, layout)
        steps = step_patterns(args.seq_len, p, layout, block, args.causal)
        pos = global_order(args.seq_len, p, layout).reshape(p, n).astype(np.int32)
        plans[layout] = steps
        for s, row in enumerate(steps):
            for d, key in enumerate(row):
                if key is None or (block, key) in calls:
                    continue
                kargs = KernelArgs(scale=args.head_dim ** -0.5, is_causal=args.causal,
                                   block_q=block, block_k=block)
                qp, kp = jnp.asarray(pos[d]), jnp.asarray(pos[(d - s) % p])

                def step(q_, k_, v_, qp=qp, kp=kp, kargs=kargs):
                    return kernel.attention(q_, k_, v_, kargs,
                                            Masks(q_positions=qp, k_positions=kp))[0]

                exe = jax.jit(dev.grad_of(step)).lower(q, k, v, ct).compile()
                calls[(block, key)] = functools.partial(exe, q, k, v, ct)
                blocks[(block, key)] = int(np.frombuffer(key, bool).sum())
    progress.write(f"projection: {len(calls)} distinct ring steps, timing each")
    timed = harness.time_interleaved({str(i): c for i, c in enumerate(calls.values())},
                                     repeats=max(args.repeats, 3), warmup=args.warmup)
    step_s = {key: timed[str(i)].median for i, key in enumerate(calls)}
    result = {}
    for layout, steps in plans.items():
        block = ring_block(n, layout)
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


# ---------------------------------------------------------------------------- run

@harness.register("ring", "ring attention on a (simulated) device mesh: memory per device, "
                          "layouts, vs the ringattention package", add_arguments,
                  repeats=7, quick_repeats=2)
def run(args: argparse.Namespace) -> dict:
    """The ``ring`` benchmark; returns the JSON-able results."""
    _resolve(args)
    dev.request_cpu_devices(max(args.devices, *args.memory_devices))

    ra, ra_status = None, "skipped (--no-ringattention)"
    if not args.no_ringattention:
        ra, ra_status = ra_peer.load()
        if ra is None:
            print(f"ringattention comparison skipped: {ra_status}", file=sys.stderr)
    config = {k: getattr(args, k) for k in (
        "dtype", "batch", "heads", "head_dim", "seq_len", "devices", "layouts", "causal",
        "repeats", "warmup", "memory_seq_len", "memory_devices", "ra_chunk",
        "implementation", "quick", "seed", "threads")}
    mesh = dev.seq_mesh(args.devices)
    ring_devices = str(mesh.devices.flat[0].device_kind)
    rng = np.random.default_rng(args.seed)
    shape = (args.batch, args.seq_len, args.heads, args.head_dim)
    inputs = [rng.standard_normal(shape, dtype=np.float32) for _ in range(4)]  # q, k, v, ct
    variants = _variants(args, ra, mesh, inputs)
    passes = ["forward_backward"] if args.no_forward else ["forward", "forward_backward"]
    jobs = _memory_jobs(args, ra)
    projection_on = not args.no_projection and args.causal
    progress = harness.Progress(len(jobs) if args.no_timing else
                                len(jobs) + len(variants) + len(passes) + 1 + projection_on,
                                "ring")
    progress.write(f"ring: B={args.batch} n={args.seq_len} H={args.heads} D={args.head_dim} "
                   f"{args.dtype} causal={args.causal} P={args.devices} ({ring_devices} "
                   f"devices) layouts={','.join(args.layouts)} threads={args.threads} "
                   f"repeats={args.repeats}; ringattention: {ra_status}")

    memory = _memory(args, jobs, progress)
    results, ref, projection = {}, None, None
    if not args.no_timing:
        results, calls, runs = _compile(variants, passes, progress)
        # honesty check: every variant computes the single-device result
        progress.start("check outputs and gradients against the single device")
        _cross_check(args, variants, runs, results)
        del runs
        progress.done()
        for name, res in results.items():
            c = res["check_vs_single"]
            progress.write(f"  {name}: max |diff| vs single device: out "
                           f"{c['output']['max_abs_diff']:.1e}, grads "
                           f"{max(c[g]['max_abs_diff'] for g in ('dq', 'dk', 'dv')):.1e}"
                           + ("" if c["agree"] else "  ** DISAGREE **"))
        timings = {}
        for label in passes:
            progress.start(f"time {label.replace('_', '+')} ({len(calls[label])} variants "
                           f"x {args.repeats})")
            timings[label] = harness.time_interleaved(calls[label], repeats=args.repeats,
                                                      warmup=args.warmup)
            for name, timing in timings[label].items():
                results[name][label].update(timing.to_json())
            progress.done()
        ref = "contiguous" if "contiguous" in results else SINGLE
        for name, res in results.items():
            # paired median over the interleaved rounds of reference time / variant time
            res["speedup_vs_" + ref] = {
                label: harness.paired_ratio(timings[label][ref], timings[label][name])
                for label in passes}
        if projection_on:
            progress.start("critical-path projection (distinct ring steps on one device)")
            projection = _projection(args, progress)
            progress.done()
    progress.close()

    env = harness.environment(args.threads, args.load)
    env["ring_devices"] = ring_devices
    env["ringattention"] = ra_status
    if ra is not None:
        env["ringattention_version"] = ra_peer.version()
    payload = {"benchmark": "ring", "config": config, "environment": env,
               "memory": memory, "timing": results, "timing_reference": ref,
               "projection": projection}
    print_summary(payload)
    return payload


def print_summary(payload: dict) -> None:
    """Memory, timing and projection tables of a ``ring`` run."""
    cfg, env = payload["config"], payload["environment"]
    print()
    print(f"ring attention: B={cfg['batch']} H={cfg['heads']} D={cfg['head_dim']} "
          f"{cfg['dtype']} causal={cfg['causal']}; {env.get('cpu', '?')}, "
          f"{cfg['threads']} threads, {env['ring_devices']} devices, commit "
          f"{str(env.get('git_commit'))[:8]}{' (dirty)' if env.get('git_dirty') else ''}, "
          f"{env.get('date_utc')}")
    print()
    rows = []
    for name, r in payload["memory"].items():
        fb, fw = r["forward_backward"], r["forward"]
        rows.append([name, fmt_bytes(fw["temp"]), fmt_bytes(fb["temp"]),
                     "-" if r["temp_vs_single"] is None else f"{r['temp_vs_single']:.3f}",
                     fmt_bytes(fb["argument"]),
                     fmt_bytes(r["argument_bytes_expected_per_device"])])
    harness.print_table(
        f"compiled memory per device at global n={cfg['memory_seq_len']} (memory_analysis() "
        f"of the jitted program; argument bytes = 4 inputs / P confirm it is per device)",
        ["program", "fwd temp", "fwd+bwd temp", "vs single", "args", "4 inputs / P"], rows,
        env=env)
    if not payload["timing"]:
        if not any(RINGATTENTION in name for name in payload["memory"]):
            print(f"ringattention: {env.get('ringattention')}")
        return
    ref = payload["timing_reference"]
    rows = []
    for name, r in payload["timing"].items():
        fwd = r.get("forward", {})
        sp = r["speedup_vs_" + ref]
        c = r["check_vs_single"]
        rows.append([name, fmt_ms(fwd.get("median_s")), fmt_spread(fwd.get("spread")),
                     fmt_ms(r["forward_backward"]["median_s"]),
                     fmt_spread(r["forward_backward"]["spread"]),
                     "-" if "forward" not in sp else f"{sp['forward']:.2f}x",
                     f"{sp['forward_backward']:.2f}x",
                     f"{c['output']['max_abs_diff']:.1e}",
                     f"{max(c[g]['max_abs_diff'] for g in ('dq', 'dk', 'dv')):.1e}"])
    harness.print_table(
        f"timing at global n={cfg['seq_len']}, ring over P={cfg['devices']} (median of "
        f"{cfg['repeats']} interleaved rounds, spread = (max - min) / median; speedup = "
        f"paired median of {ref} time / variant time)",
        ["variant", "fwd ms", "spread", "fwd+bwd ms", "spread", "fwd speedup",
         "fwd+bwd speedup", "out |diff|", "grad |diff|"], rows, env=env)
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
        rows = [[layout, str(r["block"]), f"{r['critical_path_pairs'] / 2**20:.1f}M",
                 f"{r['total_pairs'] / 2**20:.1f}M", fmt_ms(r["critical_path_s"]),
                 fmt_ms(r["total_work_s"]),
                 f"{r.get('speedup_vs_contiguous', float('nan')):.2f}x",
                 f"{r.get('pairs_speedup_vs_contiguous', float('nan')):.2f}x"]
                for layout, r in proj.items()]
        harness.print_table(
            f"critical path with one real device per shard (P={cfg['devices']}): sum over "
            f"ring steps of the slowest device's step, each distinct step timed on one "
            f"device (kernel fwd+bwd), communication not counted",
            ["layout", "block", "path pairs", "total pairs", "path ms", "total ms",
             "path speedup", "pairs speedup"], rows, env=env)
        print("(path = sum over steps of the slowest device: what one real device per shard "
              "would take; total = the work all devices do, which the simulated devices of "
              "this process share; pairs = (query, key) pairs in computed kernel blocks)")
