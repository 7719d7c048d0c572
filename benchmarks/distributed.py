"""``python -m benchmarks distributed``: dilated attention with the sequence sharded.

``jd.dilated_attention(seq_axis=...)`` inside ``jax.shard_map`` over P = 1, 2, 4, 8
simulated CPU devices on one global problem (default n = 65536, longnet, causal,
segments 2048/4096/16384/65536 at rates 1/2/8/16), against the single-device
program (plain ``jd.dilated_attention``, no mesh):

* per-device compiled temp memory of forward+backward (``harness.compiled_memory``
  of the SPMD program is per device);
* the collective-permutes in the compiled HLO and the bytes the largest one moves;
* the key/value bytes each device sends per ring step for every branch, computed
  from the shapes the code sends, next to the O(n/r) expectation;
* forward+backward time of every P, interleaved (``--no-timing`` skips it): the
  whole simulated mesh runs on this process's cores, so it is no speedup measure.

``--allgather`` also compiles every branch that spans all devices of the largest P
twice, as the ring the library runs and as an all-gather of the dilated keys and
values, and compares per-device memory and the collectives in the HLO.
"""

from __future__ import annotations

import argparse
import functools
import re

import numpy as np

from benchmarks import devices as dev
from benchmarks import harness
from benchmarks.harness import fmt_bytes, fmt_ms, fmt_spread, int_list

DEFAULTS = dict(seq_len=65536, segments=(2048, 4096, 16384, 65536), rates=(1, 2, 8, 16),
                devices=(1, 2, 4, 8))
QUICK = dict(seq_len=8192, segments=(256, 512, 2048, 8192), rates=(1, 2, 8, 16),
             devices=(1, 2, 4, 8))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-len", "-n", type=int, default=None,
                   help=f"global sequence length (default {DEFAULTS['seq_len']}; "
                        f"--quick {QUICK['seq_len']})")
    p.add_argument("--segments", type=int_list, default=None,
                   help="segment lengths (default 2048,4096,16384,65536; --quick "
                        "256,512,2048,8192)")
    p.add_argument("--rates", type=int_list, default=None, help="dilation rates (default 1,2,8,16)")
    p.add_argument("--devices", type=int_list, default=None,
                   help="device counts P to compare (default 1,2,4,8)")
    p.add_argument("--mode", default="longnet", choices=("longnet", "head_groups"))
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--no-timing", action="store_true", help="compile and report memory only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--allgather", action="store_true",
                   help="also compile every branch that spans all devices as an all-gather "
                        "instead of a ring, at the largest P, and compare memory")


# --------------------------------------------------------------------------- HLO

_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "pred": 1, "s32": 4, "u32": 4}
_PERMUTE = re.compile(r"=\s*(\(?[^=]*?)\s+collective-permute(?:-start)?\(")
_SHAPE = re.compile(r"(f32|bf16|f16|f64|pred|s32|u32)\[([\d,]*)\]")
_COLLECTIVE = re.compile(r"\s(collective-permute|all-gather|reduce-scatter|all-reduce|"
                         r"all-to-all)(?:-start)?\(")


def permutes_in(hlo: str) -> list[int]:
    """Bytes moved by every collective-permute of a compiled HLO module (per device)."""
    out = []
    for m in _PERMUTE.finditer(hlo):
        total = 0
        for dt, dims in _SHAPE.findall(m.group(1)):
            total += _DTYPE_BYTES[dt] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
        out.append(total)
    return out


def collectives_in(hlo: str) -> dict[str, int]:
    """Number of collective ops of each kind in a compiled HLO module."""
    counts: dict[str, int] = {}
    for m in _COLLECTIVE.finditer(hlo):
        counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


# --------------------------------------------------------------------------- run

def _branches(args, p: int) -> list[dict]:
    """Per branch: how it runs over ``p`` devices and the k/v bytes a ring step sends."""
    import jax.numpy as jnp

    from jax_dilated.core import branch_plans
    from jax_dilated.ops import distributed
    t, d = args.seq_len, args.head_dim
    itemsize = jnp.dtype(args.dtype).itemsize
    plan = distributed.shard_branches(tuple(zip(args.segments, args.rates)),
                                      local_len=t // p, num_devices=p)
    heads_plans = branch_plans.plan_branches(tuple(zip(args.segments, args.rates)),
                                             seq_len=t, num_heads=args.heads,
                                             num_kv_heads=args.heads, mode=args.mode,
                                             offsets_rule="modulo")
    branches = []
    for sb, hp in zip(plan, heads_plans):
        tokens = sb.tokens_sent_per_step()
        # k and v blocks of n/r tokens of the gathered kv heads (no mask here)
        step_bytes = 2 * args.batch * tokens * len(hp.kv_heads) * d * itemsize
        branches.append({"segment": sb.segment_length, "rate": sb.rate,
                         "ring_size": sb.ring_size, "local": sb.is_local,
                         "tokens_per_step": tokens, "local_n_over_r": (t // p) // sb.rate,
                         "bytes_per_step": step_bytes, "forward_steps": sb.ring_size - 1})
    return branches


@harness.register("distributed", "dilated attention over P simulated devices: memory, "
                                 "communication, time", add_arguments,
                  repeats=3, quick_repeats=1)
def run(args: argparse.Namespace) -> dict:
    """The ``distributed`` benchmark; returns the JSON-able results."""
    for name, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if len(args.segments) != len(args.rates):
        raise SystemExit(f"--segments {args.segments} and --rates {args.rates} differ in length")
    dev.request_cpu_devices(max(args.devices))
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_dilated as jd
    from jax_dilated.ops import distributed

    t, h, d = args.seq_len, args.heads, args.head_dim
    dtype = jnp.dtype(args.dtype)
    cfg = dict(segment_lengths=args.segments, dilation_rates=args.rates, mode=args.mode,
               is_causal=args.causal)
    config = {k: getattr(args, k) for k in (
        "seq_len", "segments", "rates", "devices", "mode", "causal", "batch", "heads",
        "head_dim", "dtype", "repeats", "warmup", "quick", "seed", "threads")}
    devices = dev.take_devices(max(args.devices))
    compared = 0
    if args.allgather:  # every branch that spans all of the largest P's devices, twice
        at_most = distributed.shard_branches(tuple(zip(args.segments, args.rates)),
                                             local_len=t // max(args.devices),
                                             num_devices=max(args.devices))
        compared = 2 * sum(sb.ring_size == max(args.devices) for sb in at_most)
    progress = harness.Progress(len(args.devices) + (0 if args.no_timing else 1) + 1
                                + compared, "distributed")
    progress.write(f"distributed: B={args.batch} n={t} H={h} D={d} {args.dtype} "
                   f"segments={args.segments} rates={args.rates} mode={args.mode} "
                   f"causal={args.causal} P={args.devices}")

    # the single-device program: plain jd.dilated_attention, no mesh
    progress.start("compile single device")
    spec = jax.ShapeDtypeStruct((args.batch, t, h, d), dtype)
    single = dev.vjp_of(functools.partial(jd.dilated_attention, **cfg))
    single_mem = harness.compiled_memory(single, *[spec] * 4)
    progress.done()

    rng = np.random.default_rng(args.seed)
    host = [rng.standard_normal((args.batch, t, h, d)).astype(dtype) for _ in range(4)]
    rows, calls = {}, {}
    for p in args.devices:
        mesh = jax.sharding.Mesh(np.array(devices[:p]), ("seq",))
        sharding = NamedSharding(mesh, P(None, "seq"))
        local = functools.partial(jd.dilated_attention, seq_axis="seq", **cfg)
        attn = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "seq"),) * 3,
                             out_specs=P(None, "seq"), check_vma=True)
        step = dev.vjp_of(attn)
        progress.start(f"compile P={p}")
        specs = [jax.ShapeDtypeStruct(spec.shape, dtype, sharding=sharding)] * 4
        mem = harness.compiled_memory(step, *specs, in_shardings=sharding)
        # the same jit and specs: served from JAX's cache, not compiled again
        compiled = jax.jit(step, in_shardings=sharding).lower(*specs).compile()
        permutes = permutes_in(compiled.as_text())
        progress.done()
        rows[p] = {"temp_bytes": mem.temp, "argument_bytes": mem.argument,
                   "memory": mem.to_json(), "hlo_collective_permutes": len(permutes),
                   "hlo_permute_bytes": permutes, "branches": _branches(args, p)}
        if not args.no_timing:
            q, k, v, ct = (jax.device_put(x, sharding) for x in host)
            calls[p] = functools.partial(compiled, q, k, v, ct)
    if calls:
        progress.start(f"time P={','.join(map(str, calls))} ({args.repeats} interleaved rounds)")
        for p, timing in harness.time_interleaved(
                {str(p): c for p, c in calls.items()}, repeats=args.repeats,
                warmup=args.warmup).items():
            rows[int(p)]["fwd_bwd"] = timing.to_json()
        progress.done()
        calls.clear()
    allgather = _allgather_comparison(args, devices, progress) if args.allgather else None
    progress.close()
    env = harness.environment(args.threads, args.load)
    payload = {"benchmark": "distributed", "config": config, "environment": env,
               "single_device": {"temp_bytes": single_mem.temp,
                                 "memory": single_mem.to_json()},
               "devices": rows}
    if allgather is not None:
        payload["ring_vs_allgather"] = allgather
    print_summary(payload)
    return payload


# ---------------------------------------------------------------- --allgather

def _allgather_comparison(args, devices, progress) -> list[dict]:
    """One spanning branch at ``P = max(devices)``, as a ring and as an all-gather.

    Both run the library's dilate / undilate (``dilation.attend_dilated``) around the
    spanning branch's attention; the ring variant is what ``dilated_attention``
    does (``ring_partials`` over the devices of a segment), the all-gather variant
    gathers every device's dilated key/value block and attends to all of them at
    once (its backward, by autodiff, reduce-scatters dk/dv). Reported: compiled
    per-device temp memory of forward+backward, the collectives in the HLO, and
    the key/value tokens each device receives in the forward.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_dilated.backends import KernelArgs, Masks, get_kernel
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
            return kernel.attention(q, k_all, v_all, kargs,
                                    Masks(q_positions=q_pos, kv_valid=valid))

        for method, attend in (("ring", ring_attend), ("all-gather", gather_attend)):
            def local(q, k, v, attend=attend, sb=sb, plan=plan):
                o, *_ = dilation.attend_dilated(attend, sb.cut, plan, q, k, v, None)
                return o.astype(q.dtype)

            attn = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "seq"),) * 3,
                                 out_specs=P(None, "seq"), check_vma=False)
            step = dev.vjp_of(attn)
            progress.start(f"compile {method} for branch ({w}, {r}) at P={p}")
            mem = harness.compiled_memory(step, spec, spec, spec, spec)
            hlo = jax.jit(step).lower(spec, spec, spec, spec).compile().as_text()  # cached
            progress.done()
            m = t // p // r  # dilated tokens per device and head
            rows.append({"segment": w, "rate": r, "devices": p, "method": method,
                         "temp_bytes": mem.temp, "collectives": collectives_in(hlo),
                         "kv_tokens_received_forward": (p - 1) * m,
                         "kv_tokens_held_at_once": m if method == "ring" else p * m})
    return rows


# ------------------------------------------------------------------------ tables

def print_summary(payload: dict) -> None:
    """Memory/communication tables of a ``distributed`` run (and ``--allgather``'s)."""
    cfg, env = payload["config"], payload["environment"]
    single = payload["single_device"]["temp_bytes"]
    print()
    print(f"distributed dilated attention, global n={cfg['seq_len']}, B={cfg['batch']}, "
          f"H={cfg['heads']}, D={cfg['head_dim']}, {cfg['dtype']}, {cfg['mode']}, "
          f"causal={cfg['causal']}, segments={list(cfg['segments'])}, "
          f"rates={list(cfg['rates'])}; {env.get('cpu', '?')}, {cfg['threads']} threads, "
          f"commit {str(env.get('git_commit'))[:8]}, {env.get('date_utc')}")
    print(f"single device (no mesh) forward+backward temp memory: {fmt_bytes(single)}")
    print()
    rows = []
    for p, r in payload["devices"].items():
        t = r.get("fwd_bwd", {})
        rows.append([str(p), fmt_bytes(r["temp_bytes"]), f"{r['temp_bytes'] / single:.3f}x",
                     str(r["hlo_collective_permutes"]),
                     fmt_bytes(max(r["hlo_permute_bytes"], default=0)),
                     fmt_ms(t.get("median_s")), fmt_spread(t.get("spread"))])
    harness.print_table(
        "per device, forward+backward",
        ["P", "temp / device", "vs single", "permute ops", "largest permute", "fwd+bwd ms",
         "spread"], rows, env=env)
    print("(temp: memory_analysis() of the compiled SPMD program, i.e. per device; permute "
          "ops: collective-permutes in the compiled forward+backward HLO (an op inside the "
          "ring's scan runs once per step); largest permute: the largest single array one "
          "moves per device (XLA emits one op per array of the k, v, dk, dv tuple); fwd+bwd: "
          "median of interleaved rounds over all P, the whole simulated mesh on this "
          "machine's cores, so it is no speedup measure)")
    print()
    rows = []
    for p, r in payload["devices"].items():
        for b in r["branches"]:
            rows.append([str(p), str(b["segment"]), str(b["rate"]),
                         "local" if b["local"] else f"ring of {b['ring_size']}",
                         str(b["tokens_per_step"]), str(b["local_n_over_r"]),
                         fmt_bytes(b["bytes_per_step"]), str(b["forward_steps"])])
    harness.print_table(
        "communication per device per ring step, from the shapes the code sends (k and v "
        "blocks of the gathered kv heads)",
        ["P", "segment", "rate", "runs as", "tokens/step", "n/r", "bytes/step", "fwd steps"],
        rows, env=env)
    if "ring_vs_allgather" in payload:
        _print_allgather(payload["ring_vs_allgather"], env)


def _print_allgather(rows: list[dict], env: dict) -> None:
    if not rows:
        print("(no branch spans all devices: nothing to compare)")
        return
    harness.print_table(
        "spanning branches: ring (what the library runs) vs all-gather, forward+backward, "
        "per device",
        ["segment", "rate", "P", "method", "temp / device", "k/v tokens held",
         "k/v tokens received (fwd)", "collectives in HLO"],
        [[str(r["segment"]), str(r["rate"]), str(r["devices"]), r["method"],
          fmt_bytes(r["temp_bytes"]), str(r["kv_tokens_held_at_once"]),
          str(r["kv_tokens_received_forward"]),
          ", ".join(f"{k} x{n}" for k, n in sorted(r["collectives"].items()))]
         for r in rows], env=env)
    print("(both receive the same (P-1) n/r tokens per device; the all-gather holds all "
          "P blocks of the segment at once and reduce-scatters dk/dv of that size, the "
          "ring one block at a time and overlaps the transfer with compute)")
