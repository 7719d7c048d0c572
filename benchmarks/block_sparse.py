"""``python -m benchmarks block_sparse``: block-sparse attention against density.

``jd.block_sparse_attention`` with ``RandomBlocks`` patterns at densities 0.05 ...
1.0 (every query block reads exactly ``round(density x blocks)`` key blocks) next
to exact blockwise attention (the XLA kernel) on one device, float32, B=1:

* forward and forward+backward time of every density and of exact attention, all
  in one interleaved set (``harness.time_interleaved``: medians and spread);
* compiled temp memory (``harness.compiled_memory``) of forward and
  forward+backward, and per device of the block-sparse ring through
  ``jd.sharded`` on 8 simulated CPU devices against one device.

``--memory-only`` compiles without timing; ``--quick``: n = 4096.
"""

from __future__ import annotations

import argparse
import functools

from benchmarks import devices as dev
from benchmarks import harness
from benchmarks.harness import fmt_bytes, fmt_ms, fmt_spread

DEFAULTS = dict(seq_len=32768)
QUICK = dict(seq_len=4096)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-len", "-n", type=int, default=None,
                   help=f"sequence length (default {DEFAULTS['seq_len']}; "
                        f"--quick {QUICK['seq_len']})")
    p.add_argument("--densities", default="0.05,0.1,0.25,0.5,1.0",
                   help="block densities (RandomBlocks: every query block reads exactly "
                        "round(density x blocks) key blocks)")
    p.add_argument("--block", type=int, default=512, help="block size (default 512)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--devices", type=int, default=8,
                   help="devices for the per-device ring memory (default 8)")
    p.add_argument("--memory-only", action="store_true", help="compile only, no timing")
    p.add_argument("--seed", type=int, default=0)


@harness.register("block_sparse", "block-sparse attention: time and memory against density, "
                                  "next to exact attention", add_arguments,
                  repeats=5, quick_repeats=2)
def run(args: argparse.Namespace) -> dict:
    """The ``block_sparse`` benchmark; returns the JSON-able results."""
    for name, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    try:
        densities = tuple(float(x) for x in args.densities.split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"--densities: expected comma-separated floats, got "
                         f"{args.densities!r}") from None
    dev.request_cpu_devices(args.devices)
    import jax
    import jax.numpy as jnp

    import jax_dilated as jd
    from jax_dilated import block_patterns as bp
    from jax_dilated.backends import KernelArgs, xla

    shape = (1, args.seq_len, args.heads, args.head_dim)
    q, k, v, g = (jax.random.normal(key, shape, jnp.float32)
                  for key in jax.random.split(jax.random.key(args.seed), 4))
    block = args.block

    def exact(q, k, v):
        kargs = KernelArgs(scale=q.shape[-1] ** -0.5, block_q=block, block_k=block)
        return xla.attention(q, k, v, kargs)[0]

    def sparse(density):
        return functools.partial(jd.block_sparse_attention, block_size=block,
                                 pattern=bp.RandomBlocks(density, seed=0))

    configs = {"exact": exact, **{f"{d:g}": sparse(d) for d in densities}}
    progress = harness.Progress(2 * len(configs) + len(densities)
                                + (0 if args.memory_only else len(configs) + 1),
                                "block_sparse")
    progress.write(f"block_sparse: n={args.seq_len} H={args.heads} D={args.head_dim} "
                   f"float32 block={block} densities={densities} repeats={args.repeats}")
    memory = {}
    for name, f in configs.items():
        progress.start(f"memory {name}")
        memory[name] = {"forward": harness.temp_bytes(f, q, k, v)}
        progress.done()
        progress.start(f"memory {name} fwd+bwd")
        memory[name]["forward_backward"] = harness.temp_bytes(dev.grad_of(f), q, k, v, g)
        progress.done()
    mesh = dev.seq_mesh(args.devices)
    for d in densities:
        progress.start(f"ring memory {d:g}")
        ring = jd.sharded(sparse(d), mesh, seq_axis="seq")
        memory[f"{d:g}"]["ring_per_device_forward_backward"] = harness.temp_bytes(
            dev.grad_of(ring), q, k, v, g)
        progress.done()
    timing = {}
    if not args.memory_only:
        calls = {}
        for name, f in configs.items():
            progress.start(f"compile {name}")
            fwd = jax.jit(f).lower(q, k, v).compile()
            fb = jax.jit(dev.grad_of(f)).lower(q, k, v, g).compile()
            calls[f"{name} fwd"] = functools.partial(fwd, q, k, v)
            calls[f"{name} fwd+bwd"] = functools.partial(fb, q, k, v, g)
            progress.done()
        progress.start(f"{args.repeats} interleaved rounds of {len(calls)} variants")
        timing = {name: t.to_json() for name, t in harness.time_interleaved(
            calls, repeats=args.repeats, warmup=args.warmup).items()}
        progress.done()
    progress.close()
    config = {k: getattr(args, k) for k in ("seq_len", "densities", "block", "heads",
                                            "head_dim", "devices", "repeats", "warmup",
                                            "quick", "seed", "threads")}
    payload = {"benchmark": "block_sparse", "config": config,
               "environment": harness.environment(args.threads, args.load),
               "memory": memory, "timing": timing}
    print_summary(payload)
    return payload


def print_summary(payload: dict) -> None:
    """The density table of a ``block_sparse`` run."""
    cfg, mem, tim, env = (payload["config"], payload["memory"], payload["timing"],
                          payload["environment"])
    ex_f = tim.get("exact fwd", {}).get("median_s")
    ex_fb = tim.get("exact fwd+bwd", {}).get("median_s")
    rows = []
    for name, m in mem.items():
        t_f, t_fb = tim.get(f"{name} fwd", {}), tim.get(f"{name} fwd+bwd", {})
        ring = m.get("ring_per_device_forward_backward")
        rows.append([name, fmt_ms(t_f.get("median_s")), fmt_spread(t_f.get("spread")),
                     "-" if not t_f else f"{t_f['median_s'] / ex_f:.3f}x",
                     fmt_ms(t_fb.get("median_s")), fmt_spread(t_fb.get("spread")),
                     "-" if not t_fb else f"{t_fb['median_s'] / ex_fb:.3f}x",
                     fmt_bytes(m["forward_backward"]), fmt_bytes(ring),
                     "-" if ring is None or not m["forward_backward"]
                     else f"{ring / m['forward_backward']:.3f}x"])
    print()
    harness.print_table(
        f"block-sparse attention, n={cfg['seq_len']}, B=1, H={cfg['heads']}, "
        f"D={cfg['head_dim']}, float32, block {cfg['block']}, RandomBlocks patterns; "
        f"{env.get('cpu', '?')}, {cfg['threads']} threads, commit "
        f"{str(env.get('git_commit'))[:8]}, {env.get('date_utc')}",
        ["density", "fwd ms", "spread", "vs exact", "fwd+bwd ms", "spread", "vs exact",
         "fwd+bwd temp", f"ring temp/device (P={cfg['devices']})", "vs one device"],
        rows, env=env)
    print(f"(times: medians of {cfg['repeats']} interleaved rounds, spread = (max - min) / "
          f"median; temp: compiled memory_analysis(); the ring column is per device "
          f"through jd.sharded)")
