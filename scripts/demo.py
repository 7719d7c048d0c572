#!/usr/bin/env python
"""jax-dilated demo: LongNet dilated attention over a 32k-token sequence on one device,
and exact ring attention over the same sequence on an 8-device CPU mesh.

For each mode (``longnet`` and ``head_groups``) it

1. builds a dilated-attention configuration (segments 2048..16384, rates 1..8),
2. runs a ``[1, 32768, 8, 64]`` float32 sequence through ``jd.dilated_attention``
   under ``jax.jit`` (compile time, run time and compiled temp memory reported),
3. checks the output against the exact *dense* form of the same function,
   computed in float64 NumPy for ~64 query rows spread over the sequence:
   logits ``scale q.k + log m(p, t)``, ``m(p, t)`` the number of branches that
   let ``p`` attend to ``t`` (longnet), or a single branch per head group with
   the output divided by the number of groups (head_groups),

Then, for each ring layout (``contiguous``, ``zigzag``, ``striped``), it runs the
same sequence through causal ``jd.ring_attention`` sharded over a mesh of
``--ring-devices`` (default 8) simulated CPU devices with ``jd.sharded`` under
``jax.jit`` (compiled temp memory *per device* reported), and checks it against
exact causal softmax attention in float64 NumPy on ~64 query rows (shard and
chunk boundaries among them). The demo asks JAX for the CPU devices itself,
before JAX starts.

It prints a table and exits with status 1 if any error exceeds ``--tol``.

    python scripts/demo.py                  # about a minute on 2 CPU cores
    python scripts/demo.py --seq-len 8192 --segments 1024,2048 --rates 1,2 --causal
    python scripts/demo.py --ring-layouts zigzag --ring-devices 4
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_dilated as jd


@dataclasses.dataclass(frozen=True)
class DilatedAttention:
    """A dilated-attention configuration, callable on ``(query, key, value)``.

    A stand-in for the Flax layer: it holds the static configuration and calls
    :func:`jax_dilated.dilated_attention` with it. Arrays are
    ``[batch, seq, heads, head_dim]``.
    """

    segment_lengths: tuple[int, ...]
    dilation_rates: tuple[int, ...]
    mode: str = "longnet"
    is_causal: bool = False

    def __call__(self, query, key, value):
        return jd.dilated_attention(query, key, value, segment_lengths=self.segment_lengths,
                                    dilation_rates=self.dilation_rates, mode=self.mode,
                                    is_causal=self.is_causal)


def _branch_links(rows: np.ndarray, seq_len: int, w: int, r: int, offset: int,
                  causal: bool) -> np.ndarray:
    """bool [len(rows), seq_len]: which keys each query row may attend to in branch (w, r)."""
    keys = np.arange(seq_len)
    q_sel = (rows % w) % r == offset
    k_sel = (keys % w) % r == offset
    same_segment = (rows[:, None] // w) == (keys[None, :] // w)
    links = q_sel[:, None] & k_sel[None, :] & same_segment
    if causal:
        links &= keys[None, :] <= rows[:, None]
    return links


def dense_reference(q, k, v, rows, attn: DilatedAttention, scale: float | None = None):
    """Exact dilated attention at query positions ``rows``, all heads, in float64 NumPy.

    Straight from the definition (docs/semantics.md, section 2), independent of the
    library's gather/scatter code:

    * longnet: head ``j`` attends with logits ``scale q.k + log m(p, t)`` where
      ``m(p, t)`` counts the branches ``(w_i, r_i)`` (offset ``j mod r_i``) that
      link ``p`` and ``t``; rows with no key output 0.
    * head_groups: head ``j`` of group ``i`` attends over branch ``i`` (offset
      ``i mod r_i``) only; the output is divided by the number of groups.

    Args:
      q, k, v: [batch, seq, heads, head_dim] arrays (any float dtype).
      rows: int array of query positions.

    Returns:
      float64 [batch, len(rows), heads, head_dim].
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, n, h, d = q.shape
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    branches = list(zip(attn.segment_lengths, attn.dilation_rates))
    g = len(branches)
    if attn.mode == "head_groups":
        base, extra = divmod(h, g)
        group_of = np.repeat(np.arange(g), [base + (i < extra) for i in range(g)])
    out = np.zeros((b, len(rows), h, d))
    for j in range(h):
        if attn.mode == "longnet":
            m = sum(_branch_links(rows, n, w, r, j % r, attn.is_causal).astype(np.int64)
                    for w, r in branches)
        else:
            i = group_of[j]
            w, r = branches[i]
            m = _branch_links(rows, n, w, r, i % r, attn.is_causal).astype(np.int64)
        with np.errstate(divide="ignore"):
            log_m = np.log(m)  # -inf where no branch links (p, t)
        covered = m.any(axis=1)
        for bi in range(b):
            logits = scale * q[bi, rows, j] @ k[bi, :, j].T + log_m
            logits -= np.where(covered, logits.max(axis=1), 0.0)[:, None]
            p = np.exp(logits)
            denom = np.where(covered, p.sum(axis=1), 1.0)
            out[bi, :, j] = (p @ v[bi, :, j]) / denom[:, None]
    return out / g if attn.mode == "head_groups" else out


def exact_reference(q, k, v, rows, causal: bool, scale: float | None = None):
    """Exact softmax attention at query positions ``rows``, all heads, float64 NumPy.

    The definition of ring attention's result (docs/semantics.md, section 3): every query
    attends to every key (to the keys at or before it when causal).

    Returns:
      float64 [batch, len(rows), heads, head_dim].
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, n, h, d = q.shape
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    keys = np.arange(n)
    allowed = keys[None, :] <= rows[:, None] if causal else np.ones((len(rows), n), bool)
    out = np.zeros((b, len(rows), h, d))
    for bi in range(b):
        for j in range(h):
            logits = np.where(allowed, scale * q[bi, rows, j] @ k[bi, :, j].T, -np.inf)
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            out[bi, :, j] = (p @ v[bi, :, j]) / p.sum(axis=1, keepdims=True)
    return out


def check_rows(seq_len: int, count: int, segments, seed: int) -> np.ndarray:
    """~``count`` query positions: both ends, segment boundaries, and random ones."""
    special = {0, 1, seq_len - 1}
    for w in segments:
        for start in range(0, seq_len, w):
            special.update({start, max(start - 1, 0)})
    special = sorted(p for p in special if p < seq_len)
    rng = np.random.default_rng(seed)
    special = rng.permutation(special)[: count // 2]
    others = np.setdiff1d(np.arange(seq_len), special)
    rest = rng.choice(others, size=min(max(count - len(special), 0), len(others)),
                      replace=False)
    return np.sort(np.concatenate([special, rest]).astype(np.int64))


def int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", "-n", type=int, default=32768)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--segments", type=int_list, default=(2048, 4096, 8192, 16384))
    p.add_argument("--rates", type=int_list, default=(1, 2, 4, 8))
    p.add_argument("--modes", default="longnet,head_groups",
                   help="comma-separated modes to run (default longnet,head_groups)")
    p.add_argument("--causal", action="store_true", help="causal attention")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--num-checks", type=int, default=64,
                   help="query positions checked against the dense reference")
    p.add_argument("--tol", type=float, default=None,
                   help="max allowed |jax - dense reference| (default 1e-5 for float32, "
                        "2e-2 for bfloat16)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs after compiling")
    p.add_argument("--ring-layouts", default="contiguous,zigzag,striped",
                   help="comma-separated ring layouts to run (default all three; '' for none)")
    p.add_argument("--ring-devices", type=int, default=8,
                   help="devices of the ring mesh (simulated CPU devices; default 8)")
    p.add_argument("--ring-non-causal", action="store_true",
                   help="full (non-causal) ring attention instead of causal")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.ring_layouts = [m.strip() for m in args.ring_layouts.split(",") if m.strip()]
    if args.tol is None:
        args.tol = 1e-5 if args.dtype == "float32" else 2e-2
    return args


def request_cpu_devices(count: int) -> None:
    """Ask JAX for ``count`` CPU devices; only works before JAX creates its backends."""
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except AttributeError:  # JAX without the option: the XLA flag does the same
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={count}")


def ring_mesh(count: int):
    """A 1-D mesh ``("seq",)`` of ``count`` devices (CPU ones if the default backend has fewer)."""
    devices = jax.devices()
    if len(devices) < count:
        devices = jax.devices("cpu")
    if len(devices) < count:
        raise SystemExit(f"need {count} devices for the ring, JAX has {len(devices)}: run the "
                         f"demo in a fresh process (it sets the CPU device count itself)")
    return jax.sharding.Mesh(np.array(devices[:count]), ("seq",))


def compile_and_time(fn, inputs, repeats: int):
    """``(output, compile seconds, median run seconds, compiled temp bytes)`` of ``jax.jit(fn)``."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*inputs).compile()
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        out = jax.block_until_ready(compiled(*inputs))
        times.append(time.perf_counter() - t0)
    temp = compiled.memory_analysis().temp_size_in_bytes
    return out, compile_s, statistics.median(times), temp


def run_ring(args, q, k, v) -> list[dict]:
    """Causal ring attention per layout on a CPU mesh, checked against exact attention."""
    n, h, p = q.shape[1], q.shape[2], args.ring_devices
    causal = not args.ring_non_causal
    mesh = ring_mesh(p)
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "seq"))
    q, k, v = (jax.device_put(x, spec) for x in (q, k, v))
    # query rows at shard and zigzag-chunk boundaries, both ends, and random ones
    rows = check_rows(n, args.num_checks, (n // (2 * p),), args.seed + 1)
    ref = exact_reference(q, k, v, rows, causal)
    print(f"ring attention over {p} {mesh.devices.flat[0].device_kind} devices "
          f"({n // p} tokens each), causal={causal}:")
    results = []
    for layout in args.ring_layouts:
        attn = jd.sharded(functools.partial(jd.ring_attention, is_causal=causal), mesh,
                          seq_axis="seq", layout=layout)
        out, compile_s, run_s, temp = compile_and_time(attn, (q, k, v), args.repeats)
        # memory_analysis() of a program over the mesh is per device
        err = float(np.max(np.abs(np.asarray(out[:, rows], np.float64) - ref)))
        results.append(dict(mode=f"ring {layout} x{p}", causal=causal, compile_s=compile_s,
                            run_s=run_s, temp=temp, err=err,
                            ok=err <= args.tol, per_device=True))
        print(f"  {layout}: compiled in {compile_s:.1f}s, ran in {results[-1]['run_s']:.2f}s, "
              f"max |err| {err:.2e} over {len(rows)} rows x {h} heads "
              f"(max |reference| {np.max(np.abs(ref)):.2e})", flush=True)
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.ring_layouts:
        request_cpu_devices(args.ring_devices)  # before JAX starts (first use below)
    b, n, h, d = args.batch, args.seq_len, args.heads, args.head_dim
    dtype = jnp.dtype(args.dtype)
    kq, kk, kv = jax.random.split(jax.random.key(args.seed), 3)
    q, k, v = (jax.random.normal(key, (b, n, h, d), dtype) for key in (kq, kk, kv))
    rows = check_rows(n, args.num_checks, args.segments, args.seed)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; q/k/v {b}x{n}x{h}x{d} "
          f"{args.dtype}; segments {list(args.segments)}, rates {list(args.rates)}; "
          f"dense logits would need {b * n * n * h * 4 / 2**30:.1f} GiB")

    results = []
    for mode in args.modes:
        attn = DilatedAttention(tuple(args.segments), tuple(args.rates), mode, args.causal)
        out, compile_s, run_s, temp = compile_and_time(attn, (q, k, v), args.repeats)
        ref = dense_reference(q, k, v, rows, attn)
        err = float(np.max(np.abs(np.asarray(out[:, rows], np.float64) - ref)))
        results.append(dict(mode=mode, causal=args.causal, compile_s=compile_s,
                            run_s=run_s, temp=temp, err=err,
                            ok=err <= args.tol, per_device=False))
        print(f"  {mode}: compiled in {compile_s:.1f}s, ran in {results[-1]['run_s']:.2f}s, "
              f"max |err| {err:.2e} over {len(rows)} rows x {h} heads "
              f"(max |reference| {np.max(np.abs(ref)):.2e})", flush=True)

    if args.ring_layouts:
        results += run_ring(args, q, k, v)

    header = ["shape", "mode", "causal", "compile s", "run s", "temp memory",
              "max |err| vs dense", "ok"]
    table = [[f"{b}x{n}x{h}x{d}", r["mode"], str(r["causal"]), f"{r['compile_s']:.1f}",
              f"{r['run_s']:.2f}",
              f"{r['temp'] / 2**20:.0f} MiB" + (" /device" if r["per_device"] else ""),
              f"{r['err']:.2e}", "yes" if r["ok"] else "NO"] for r in results]
    widths = [max(len(x), *(len(row[i]) for row in table)) for i, x in enumerate(header)]
    print()
    print("  ".join(x.rjust(w) for x, w in zip(header, widths)))
    print("-" * (sum(widths) + 2 * (len(widths) - 1)))
    for row in table:
        print("  ".join(x.rjust(w) for x, w in zip(row, widths)))
    print(f"\ntolerance: max |jax - float64 dense reference| <= {args.tol:g} "
          f"({len(rows)} query positions, all heads; ring rows: exact attention, "
          f"{args.ring_devices} CPU devices, temp memory per device)")
    if not all(r["ok"] for r in results):
        print("FAILED: error above tolerance", file=sys.stderr)
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
