"""``python -m benchmarks strategies``: ring, all-gather and head-parallel (all-to-all) compared.

For every operation (exact, dilated, block-sparse attention), global length ``n`` and
number of kv heads, ``jd.sharded(..., strategy=s)`` is compiled for forward+backward
over ``P`` simulated CPU devices with ``s`` = ``"ring"``, ``"allgather"`` and
``"heads"``, and the single-device program (the plain operation) once:

* per-device compiled memory (``memory_analysis`` of the SPMD program: temp, and
  temp + arguments + outputs);
* bytes each device sends, from the shapes the strategy moves (the cost model of
  :func:`jax_dilated.ops.strategies.estimate`), and the collectives in the compiled
  HLO (a ring's ``collective-permute`` sits in a loop: the HLO shows it once);
* for dilated attention, the per-branch mix of the cost model (one strategy per
  branch, column ``per_branch``) where it differs from the three;
* what ``"auto"`` picks (:func:`jax_dilated.explain_strategy`) and whether the
  compiled ``"auto"`` program is that strategy's;
* forward+backward time of every strategy, interleaved (``--no-timing`` skips it):
  the simulated mesh runs on this process's cores, so times are the total work of
  all devices, which is what the strategies differ in on a CPU mesh.
"""

from __future__ import annotations

import argparse
import functools

import numpy as np

from benchmarks import devices as dev
from benchmarks import harness
from benchmarks.harness import fmt_bytes, fmt_ms, int_list, str_list

STRATEGIES = ("ring", "allgather", "heads")
# dilated attention: the per-branch mix of the cost model, where it differs from all three
MIX = "per_branch"
HYBRID_OPS = ("exact", "dilated")  # --hybrid compiles these through each split
COLUMNS = (*STRATEGIES, MIX)
DEFAULTS = dict(seq_lens=(8192, 32768), kv_heads=(8, 2, 1), devices=8,
                ops=("exact", "dilated", "block_sparse"))
QUICK = dict(seq_lens=(2048,), kv_heads=(8, 1), devices=4, ops=("exact", "dilated"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-lens", type=int_list, default=None,
                   help="global sequence lengths (default 8192,32768; --quick 2048)")
    p.add_argument("--kv-heads", type=int_list, default=None,
                   help="numbers of kv heads (default 8,2,1; --quick 8,1)")
    p.add_argument("--devices", type=int, default=None, help="P (default 8; --quick 4)")
    p.add_argument("--ops", type=str_list, default=None,
                   help="exact, dilated, block_sparse (default all three)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--layout", default="zigzag", choices=("contiguous", "zigzag"),
                   help="layout for exact and block-sparse attention (dilated: contiguous)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--no-timing", action="store_true", help="compile and report memory only")
    p.add_argument("--hybrid", type=str_list, default=(),
                   help="two-axis splits P_a x P_b of the devices (e.g. 2x4,4x2): exact "
                        "and dilated attention also through strategy='hybrid' over each, "
                        "in the same cells (docs/semantics.md, section 8)")
    p.add_argument("--seed", type=int, default=0)


def operation(name: str, n: int, causal: bool):
    """The operation benchmarked under ``name`` for a global length ``n``: dilated with
    segments ``n/16, n/4, n`` at rates 1, 2, 4 (at P = 8: local, a ring of 2, a ring
    of all 8); block-sparse a local window of 2 blocks of 128 plus a global block."""
    import jax_dilated as jd
    from jax_dilated import block_patterns as bp
    if name == "exact":
        return functools.partial(jd.ring_attention, is_causal=causal)
    if name == "dilated":
        return functools.partial(jd.dilated_attention, segment_lengths=(n // 16, n // 4, n),
                                 dilation_rates=(1, 2, 4), is_causal=causal)
    if name == "block_sparse":
        return functools.partial(jd.block_sparse_attention, block_size=128,
                                 pattern=bp.LocalWindow(2) | bp.GlobalBlocks([0]),
                                 is_causal=causal)
    raise SystemExit(f"unknown op {name!r}: exact, dilated or block_sparse")


@harness.register("strategies", "context-parallel strategies (ring, allgather, heads, "
                                "auto): memory, bytes sent, time", add_arguments,
                  repeats=3, quick_repeats=1)
def run(args: argparse.Namespace) -> dict:
    """The ``strategies`` benchmark; returns the JSON-able results."""
    for name, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    p = args.devices
    dev.request_cpu_devices(p)
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_dilated as jd
    from benchmarks.distributed import collectives_in

    dtype = jnp.dtype(args.dtype)
    mesh = jax.sharding.Mesh(np.array(dev.take_devices(p)), ("seq",))
    sharding = NamedSharding(mesh, P(None, "seq"))
    config = {k: getattr(args, k) for k in (
        "seq_lens", "kv_heads", "devices", "ops", "heads", "head_dim", "batch", "causal",
        "layout", "dtype", "repeats", "warmup", "quick", "seed", "threads", "hybrid")}
    splits = [tuple(int(x) for x in s.split("x")) for s in args.hybrid]
    if any(len(s) != 2 or s[0] * s[1] != p for s in splits):
        raise SystemExit(f"--hybrid: each split is P_axP_b with P_a P_b = {p}, got "
                         f"{args.hybrid}")
    cells = [(o, n, hkv) for o in args.ops for n in args.seq_lens for hkv in args.kv_heads]
    picks = {}  # what auto picks, and the per-branch mix where it is a candidate
    for op_name, n, hkv in cells:
        layout = "contiguous" if op_name == "dilated" else args.layout
        picks[op_name, n, hkv] = jd.explain_strategy(
            operation(op_name, n, args.causal), (args.batch, n, args.heads, args.head_dim),
            (args.batch, n, hkv, args.head_dim), num_devices=p, dtype=dtype,
            layout=layout, quiet=True)
    # per cell: one device, the strategies, the mix where there is one, auto, the timing
    steps = sum(5 + (MIX in costs) + (not args.no_timing) for _, costs, _ in picks.values())
    steps += len(splits) * sum(o in HYBRID_OPS for o, _, _ in cells)
    progress = harness.Progress(steps, "strategies")
    rng = np.random.default_rng(args.seed)
    rows = []
    for op_name, n, hkv in cells:
        fn = operation(op_name, n, args.causal)
        layout = "contiguous" if op_name == "dilated" else args.layout
        qshape = (args.batch, n, args.heads, args.head_dim)
        kshape = (args.batch, n, hkv, args.head_dim)
        pick, costs, why = picks[op_name, n, hkv]
        row = {"op": op_name, "seq_len": n, "kv_heads": hkv, "layout": layout,
               "auto": _label(pick), "auto_why": why, "strategies": {}}
        progress.start(f"{op_name} n={n} kv={hkv}: compile single device")
        specs1 = [jax.ShapeDtypeStruct(s, dtype) for s in (qshape, kshape, kshape, qshape)]
        # one device: the operation itself (exact attention as one dilated segment of n)
        one = (functools.partial(jd.dilated_attention, segment_lengths=(n,),
                                 dilation_rates=(1,), is_causal=args.causal)
               if op_name == "exact" else fn)
        mem1 = harness.compiled_memory(dev.vjp_of(one), *specs1)
        row["single_device"] = {"memory": mem1.to_json()}
        progress.done()
        host = [rng.standard_normal(s.shape).astype(dtype) for s in specs1]
        calls = {}
        variants = {s: s for s in STRATEGIES}
        if MIX in costs:
            variants[MIX] = costs[MIX].strategy
        variants["auto"] = "auto"
        if op_name in HYBRID_OPS:
            for pa, pb in splits:
                variants[f"hybrid {pa}x{pb}"] = (pa, pb)
        for strategy, given in variants.items():
            progress.start(f"{op_name} n={n} kv={hkv}: compile {strategy}")
            cost = costs.get(strategy)
            attn, shard = None, sharding
            if strategy.startswith("hybrid"):
                cost = jd.explain_strategy(fn, qshape, kshape, num_devices=p, dtype=dtype,
                                           layout=layout, quiet=True,
                                           axis_sizes=given)[1]["hybrid"]
                grid = jax.sharding.Mesh(np.array(dev.take_devices(p)).reshape(given),
                                         ("a", "b"))
                shard = NamedSharding(grid, P(None, ("b", "a")))
                attn = jd.sharded(fn, grid, seq_axis=("a", "b"), layout=layout,
                                  strategy="hybrid")
            entry = {"estimate": None if cost is None else {
                "strategy": _label(cost.strategy), "sent_bytes": cost.sent_bytes,
                "held_bytes": cost.held_bytes, "overlap": cost.overlap, "work": cost.work,
                "reason": cost.reason}}
            if cost is not None and cost.reason is not None:
                row["strategies"][strategy] = entry
                progress.done()
                continue
            if attn is None:
                attn = jd.sharded(fn, mesh, seq_axis="seq", layout=layout, strategy=given)
            step = jax.jit(dev.vjp_of(attn), in_shardings=shard)
            compiled = step.lower(*[jax.ShapeDtypeStruct(s.shape, dtype, sharding=shard)
                                    for s in specs1]).compile()
            mem = compiled.memory_analysis()
            entry["memory"] = {
                "temp": int(mem.temp_size_in_bytes),
                "total": int(mem.temp_size_in_bytes + mem.argument_size_in_bytes
                             + mem.output_size_in_bytes - mem.alias_size_in_bytes)}
            entry["hlo_collectives"] = collectives_in(compiled.as_text())
            row["strategies"][strategy] = entry
            if not args.no_timing:
                arrays = [jax.device_put(x, shard) for x in host]
                calls[strategy] = functools.partial(compiled, *arrays)
            progress.done()
        if calls:
            progress.start(f"{op_name} n={n} kv={hkv}: time {','.join(calls)}")
            for s, timing in harness.time_interleaved(calls, repeats=args.repeats,
                                                      warmup=args.warmup).items():
                row["strategies"][s]["fwd_bwd"] = timing.to_json()
            progress.done()
            calls.clear()
        rows.append(row)
    progress.close()
    payload = {"benchmark": "strategies", "config": config,
               "environment": harness.environment(args.threads, args.load), "rows": rows}
    print_summary(payload)
    return payload


def _label(strategy) -> str:
    """A strategy as text: a per-branch tuple as ``ring+heads+ring``, a hybrid split as
    ``hybrid 2x4``."""
    if isinstance(strategy, str):
        return strategy
    if strategy[0] == "hybrid":
        return f"hybrid {strategy[1]}x{strategy[2]}"
    return "+".join(strategy)


def print_summary(payload: dict) -> None:
    cfg = payload["config"]
    headers = ["op", "n", "kv", "1 device", *(f"{s} mem" for s in COLUMNS),
               *(f"{s} sent" for s in COLUMNS), "auto", "heads/1"]
    timed = any("fwd_bwd" in e for r in payload["rows"] for e in r["strategies"].values())
    if timed:
        headers += [f"{s} ms" for s in (*COLUMNS, "auto")]
    table = []
    for r in payload["rows"]:
        single = r["single_device"]["memory"]
        single_total = single["temp"] + single["argument"] + single["output"] - single["alias"]
        mem, sent, times = [], [], []
        for s in COLUMNS:
            e = r["strategies"].get(s, {})
            mem.append(fmt_bytes(e["memory"]["total"]) if "memory" in e else "-")
            est = e.get("estimate")
            sent.append(fmt_bytes(est["sent_bytes"]) if est and est["reason"] is None
                        else "-")
        heads = r["strategies"].get("heads", {})
        ratio = (f"{heads['memory']['total'] / single_total:.2f}" if "memory" in heads
                 else "-")
        if timed:
            for s in (*COLUMNS, "auto"):
                t = r["strategies"].get(s, {}).get("fwd_bwd")
                times.append(fmt_ms(t["median_s"]) if t else "-")
        table.append([r["op"], str(r["seq_len"]), str(r["kv_heads"]),
                      fmt_bytes(single_total), *mem, *sent, r["auto"], ratio, *times])
    harness.print_table(
        f"strategies over P={cfg['devices']} (B={cfg['batch']}, H={cfg['heads']}, "
        f"D={cfg['head_dim']}, {cfg['dtype']}, causal={cfg['causal']}): per-device "
        f"compiled memory (temp+args+outputs), bytes sent per device (fwd+bwd)",
        headers, table)
    hybrid = [(r, s, e) for r in payload["rows"] for s, e in r["strategies"].items()
              if s.startswith("hybrid") and "memory" in e]
    if hybrid:
        harness.print_table(
            "hybrid splits beside the ring over all P: per-device "
            "compiled memory, bytes sent per device (fwd+bwd)",
            ["op", "n", "kv", "split", "mem", "sent", "ring mem", "ring sent"],
            [[r["op"], str(r["seq_len"]), str(r["kv_heads"]), s, fmt_bytes(e["memory"]["total"]),
              fmt_bytes(e["estimate"]["sent_bytes"]),
              fmt_bytes(r["strategies"]["ring"]["memory"]["total"]),
              fmt_bytes(r["strategies"]["ring"]["estimate"]["sent_bytes"])]
             for r, s, e in hybrid])
