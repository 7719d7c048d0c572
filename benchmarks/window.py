"""``python -m benchmarks window``: sliding windows, soft-capping and sinks (issue 18).

Three interleaved timing sets (``harness.time_interleaved``: medians, spread, paired
ratios), one per target of the issue, each variant with its compiled temp memory
(``harness.compiled_memory``; per device for the ring) and a PASS/FAIL line:

* **ring**: causal ``jd.ring_attention`` inside ``jax.shard_map`` over ``P``
  (simulated CPU) devices, forward+backward, with ``window=(W, 0)`` against the same
  ring without a window, on the same inputs. Also, from the positions alone (NumPy,
  nothing timed), the ring steps and kernel blocks that the skip rules execute: with
  a window, device ``d`` computes only the steps whose visiting shard meets some local
  query's window (O(W) work per device), but every shard still travels all ``P``
  hops, forward and backward, whether or not a device computes on it. Target: windowed
  time <= 0.25x unwindowed.
* **local**: one device, ``window=(W, 0)`` (causal; ``--no-local-causal``: ``(W, W)``)
  by ``jd.ring_attention`` on a one-device mesh (exact attention with a token window)
  and by ``jd.block_sparse_attention`` (the block cover below plus ``window=``), against
  ``jd.block_sparse_attention`` with the block pattern alone: the smallest
  ``LocalWindow(ceil(left / B), ceil(right / B))`` of blocks of ``B`` (``--block``)
  that covers every key of the token window (query ``p`` in block ``i`` reaches key
  ``p - left`` in block ``i - ceil(left / B)`` at worst). That pattern attends to more
  keys (up to a block more per row): it computes something else, so it is checked
  against its own (token-level) mask. Target: windowed time <= 1.2x the block cover.
* **softcap**: one device, causal ``jd.ring_attention`` on a one-device mesh (exact
  attention), plain against ``logit_soft_cap=c``, ``sinks`` (random, per head) and
  both; forward and forward+backward. Target: <= 1.10x plain.

Equality: the variants of a set compute different things (that is the point), so
every variant is checked at a small size (``--check-seq-len``; windows and blocks
scaled down with the sequence, the same devices and layout) against a dense masked
computation written here in float64 NumPy (the mask, ``c tanh(s / c)``, the sink in
the denominator and their gradients, from docs/semantics.md section 1), output and
gradients (``vjp`` with a random cotangent), and the windowed variants also against
``jax.nn.dot_product_attention(local_window_size=...)``. A result beyond the
tolerance is marked ``**`` and fails its target.

The simulated devices share this process's cores: the ring's wall time is the work
of all devices plus the transfers, which a window does not remove. The unwindowed
causal ring at n = 65536 is about 15 TFLOP forward+backward (8256 kernel blocks of
512 x 512, four times the packed op's 32768-token ring): long calls on two cores, so
``--lead-in 0`` (and few ``--repeats``) keeps the ring part short. ``--quick``:
n = 8192 (ring window 512, n / 16 as in the issue), 4096 and 2048. Timing is for a
quiet machine (the load warning says when a run was not).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable

import numpy as np

from benchmarks import devices as dev
from benchmarks import harness
from benchmarks.dilated import CHECK_RTOL
from benchmarks.harness import fmt_ms, fmt_spread, str_list
from benchmarks.ring import ring_block

DEFAULTS = dict(ring_seq_len=65536, ring_window=4096, local_seq_len=32768,
                cap_seq_len=16384)
QUICK = dict(ring_seq_len=8192, ring_window=512, local_seq_len=4096, cap_seq_len=2048)
PARTS = ("ring", "local", "softcap")
LAYOUTS = ("contiguous", "zigzag")
FWD, FWD_BWD = "forward", "forward_backward"
# the targets
RING_TARGET = 0.25   # windowed ring fwd+bwd / unwindowed ring
LOCAL_TARGET = 1.2   # token window / block-sparse LocalWindow cover
CAP_TARGET = 1.10    # soft-cap, sinks / plain

RING_FULL = "ring, no window"
RING_WINDOW = "ring, window"
COVER = "block-sparse LocalWindow cover"
EXACT_WINDOW = "window (ring_attention, 1 device)"
SPARSE_WINDOW = "window (block-sparse cover + window=)"
PLAIN = "plain"
CAP = "soft-cap"
SINKS = "sinks"
CAP_SINKS = "soft-cap + sinks"


def add_arguments(p: argparse.ArgumentParser) -> None:
    for name, what in (("ring", "ring"), ("local", "local-window part's"),
                       ("cap", "soft-cap/sinks part's")):
        p.add_argument(f"--{name}-seq-len", type=int, default=None,
                       help=f"the {what} sequence length (default "
                            f"{DEFAULTS[name + '_seq_len']}; --quick {QUICK[name + '_seq_len']})")
    p.add_argument("--ring-window", type=int, default=None,
                   help=f"the ring's window (left; causal) (default {DEFAULTS['ring_window']}; "
                        f"--quick {QUICK['ring_window']})")
    p.add_argument("--local-window", type=int, default=1024,
                   help="the local part's window (default 1024)")
    p.add_argument("--local-causal", action=argparse.BooleanOptionalAction, default=True,
                   help="local part: causal, window (W, 0) (default); else (W, W)")
    p.add_argument("--block", type=int, default=512,
                   help="block size B of the block-sparse variants (default 512); the "
                        "LocalWindow extent is the smallest that covers the window")
    p.add_argument("--devices", type=int, default=8,
                   help="ring devices P (simulated CPU devices unless the default backend "
                        "has that many; default 8)")
    p.add_argument("--layout", default="contiguous", choices=LAYOUTS,
                   help="ring layout (default contiguous)")
    p.add_argument("--soft-cap", type=float, default=50.0,
                   help="logit_soft_cap c of the softcap part (default 50, Gemma 2's)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=sorted(CHECK_RTOL))
    p.add_argument("--parts", type=str_list, default=PARTS,
                   help="comma-separated subset of ring,local,softcap (default all)")
    p.add_argument("--ring-forward", action="store_true",
                   help="also time the ring's forward pass (default forward+backward only)")
    p.add_argument("--no-forward", action="store_true",
                   help="time forward+backward only in the local and softcap parts")
    p.add_argument("--lead-in", type=int, default=harness.LEAD_IN,
                   help=f"untimed calls of a variant right before each timed call (default "
                        f"{harness.LEAD_IN}, see harness.LEAD_IN; 0 halves a long run)")
    p.add_argument("--check-seq-len", type=int, default=1024,
                   help="sequence length of the equality checks (default 1024; windows "
                        "and blocks scaled down in proportion); 0 skips them")
    p.add_argument("--seed", type=int, default=0)


def _resolve(args: argparse.Namespace) -> None:
    for name, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for x in args.parts:
        if x not in PARTS:
            raise SystemExit(f"--parts: unknown {x!r} ({', '.join(PARTS)})")
    if args.lead_in < 0:
        raise SystemExit(f"--lead-in must be >= 0, got {args.lead_in}")
    if "ring" in args.parts:
        for n in (args.ring_seq_len, *_check_len(args, args.ring_seq_len)):
            if n % (2 * args.devices):
                raise SystemExit(f"ring length {n} must be divisible by 2 x {args.devices} "
                                 f"devices (--ring-seq-len, --check-seq-len)")
    for name in ("ring_window", "local_window", "block", "batch", "heads", "head_dim"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")


def _check_len(args, n: int) -> tuple[int, ...]:
    """The check's sequence length for a part of length ``n`` (none when disabled)."""
    return () if args.check_seq_len <= 0 else (min(args.check_seq_len, n),)


def _scaled(x: int, n_small: int, n: int) -> int:
    """``x`` (a window or a block) scaled from length ``n`` down to ``n_small``."""
    return max(1, round(x * n_small / n))


def cover(window: tuple[int, int], block: int) -> tuple[int, int]:
    """The smallest ``LocalWindow(before, after)`` of ``block``-token blocks that holds
    every key of the token ``window = (left, right)``: query ``p`` of block ``i`` reaches
    keys down to block ``floor((p - left) / B) >= i - ceil(left / B)`` and up to block
    ``i + ceil(right / B)``, each bound met by some ``p`` of the block."""
    return -(-window[0] // block), -(-window[1] // block)


# ------------------------------------------------------------- reference, checks

def dense_reference(q, k, v, ct, *, scale: float, causal: bool = False, window=None,
                    block_mask=None, block: int | None = None, soft_cap=None, sinks=None):
    """``(out, dq, dk, dv)``: attention as docs/semantics.md section 1 defines it and its
    gradients (vjp with the cotangent ``ct``), dense, in float64 NumPy.

    q, k, v, ct [B, n, H, D]. Query ``p`` may attend key ``t`` when ``t <= p``
    (``causal``), ``p - left <= t <= p + right`` (``window``) and ``block_mask[p // B,
    t // B]`` (blocks of ``block`` tokens). Logits ``x = scale q.k``, soft-capped to
    ``s = c tanh(x / c)``; weights ``P_t = e^{s_t} / (e^{s_h} + sum_t e^{s_t})`` with
    head ``h``'s sink ``s_h`` (none: no such term); ``O = P V``, zero for a row
    without keys. Backward: ``dV = P^T dO``, ``dS = P (dO V^T - rowsum(dO O))`` (the
    sink has no value: it takes no part in ``rowsum(dO O)``), ``dX = dS (1 - tanh^2(x /
    c))``, ``dQ = scale dX K``, ``dK = scale dX^T Q``.
    """
    q, k, v, ct = (np.asarray(x, np.float64) for x in (q, k, v, ct))
    n = q.shape[1]
    x = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = x if soft_cap is None else soft_cap * np.tanh(x / soft_cap)
    p, t = np.arange(n)[:, None], np.arange(n)[None, :]
    allowed = np.ones((n, n), bool)
    if causal:
        allowed &= t <= p
    if window is not None:
        allowed &= (t >= p - window[0]) & (t <= p + window[1])
    if block_mask is not None:
        allowed &= np.asarray(block_mask, bool)[p // block, t // block]
    m = np.max(np.where(allowed, s, -np.inf), axis=-1, keepdims=True)
    sink = None if sinks is None else np.asarray(sinks, np.float64)[None, :, None, None]
    if sink is not None:
        m = np.maximum(m, sink)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(allowed, np.exp(np.where(allowed, s, m) - m), 0.0)
    denom = e.sum(-1, keepdims=True) + (0.0 if sink is None else np.exp(sink - m))
    w = e / np.where(denom > 0, denom, 1.0)
    out = np.einsum("bhqk,bkhd->bqhd", w, v)
    dv = np.einsum("bhqk,bqhd->bkhd", w, ct)
    dp = np.einsum("bqhd,bkhd->bhqk", ct, v)
    delta = np.einsum("bqhd,bqhd->bhq", ct, out)[..., None]
    dx = w * (dp - delta)
    if soft_cap is not None:
        dx = dx * (1.0 - np.tanh(x / soft_cap) ** 2)
    dq = np.einsum("bhqk,bkhd->bqhd", dx, k) * scale
    dk = np.einsum("bhqk,bqhd->bkhd", dx, q) * scale
    return out, dq, dk, dv


def _with_grads(fwd_bwd, q, k, v, ct):
    """``(out, dq, dk, dv)`` of ``fwd_bwd`` (a :func:`_forward_backward`) at (q, k, v)
    with cotangent ``ct`` (jitted: eager would dispatch the kernel's pieces one by one)."""
    import jax
    out, grads = jax.jit(fwd_bwd)(q, k, v, ct)
    return (out, *grads)


# ----------------------------------------------------------------- the variants

@dataclasses.dataclass
class Variant:
    """``fn(q, k, v) -> out`` on ``place``d inputs; ``computes`` the keyword arguments
    of :func:`dense_reference` that state what it computes (``scale`` aside);
    ``back`` turns its output or gradient into ``[B, n, H, D]`` token order."""

    fn: Callable
    computes: dict
    place: Callable
    back: Callable = np.asarray
    time_forward: bool = True

    @functools.cached_property
    def fwd_bwd(self) -> Callable:
        """:func:`_forward_backward` of ``fn``, one function object: the check, the
        memory analysis and the timed call of the same shapes compile it once."""
        return _forward_backward(self.fn)


def _forward_backward(fn):
    """``(q, k, v, ct) -> (out, (dq, dk, dv))``: the output and its VJP with ``ct``
    (the forward+backward pass that is timed and measured: one program)."""
    import jax

    def run(q, k, v, ct):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(ct.astype(out.dtype))

    return run


def _ring_fn(mesh, layout: str, **kwargs):
    """``jd.ring_attention(..., **kwargs)`` in ``jax.shard_map`` over ``mesh`` ("seq")."""
    import jax
    from jax.sharding import PartitionSpec as P

    import jax_dilated as jd
    spec = P(None, "seq")

    def local(q, k, v):
        return jd.ring_attention(q, k, v, seq_axis="seq", layout=layout, **kwargs)

    return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)


def _placer(mesh, order, dtype):
    """Host [B, n, H, D] -> laid out (``order``) and sharded over ``mesh``'s "seq"."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    sharding = NamedSharding(mesh, P(None, "seq"))
    return lambda x: jax.device_put(jnp.asarray(x[:, order], dtype), sharding)


def ring_variants(args, n: int, window: int) -> dict[str, Variant]:
    """The ring part at length ``n``: causal, P devices, with and without the window."""
    import jax.numpy as jnp

    from jax_dilated.core.layouts import global_order
    mesh = dev.seq_mesh(args.devices)
    order = global_order(n, args.devices, args.layout)
    place = _placer(mesh, order, jnp.dtype(args.dtype))
    inverse = np.argsort(order)

    def back(x):
        return np.asarray(x)[:, inverse]

    return {
        RING_FULL: Variant(_ring_fn(mesh, args.layout, is_causal=True), {"causal": True},
                           place, back, args.ring_forward),
        RING_WINDOW: Variant(_ring_fn(mesh, args.layout, is_causal=True, window=(window, 0)),
                             {"causal": True, "window": (window, 0)}, place, back,
                             args.ring_forward),
    }


def _one_device(dtype):
    import jax
    import jax.numpy as jnp
    one = dev.take_devices(1)[0]
    return lambda x: jax.device_put(jnp.asarray(x, dtype), one)


def local_variants(args, n: int, window: int, block: int) -> dict[str, Variant]:
    """The local part at length ``n``: the token window against its block cover."""
    import jax.numpy as jnp

    import jax_dilated as jd
    from jax_dilated import block_patterns as bp
    causal = args.local_causal
    win = (window, 0) if causal else (window, window)
    before, after = cover(win, block)
    pattern = bp.LocalWindow(before, after)
    mask = pattern.to_mask(-(-n // block))
    place = _one_device(jnp.dtype(args.dtype))
    mesh = dev.seq_mesh(1)
    sparse = functools.partial(jd.block_sparse_attention, block_size=block, pattern=pattern,
                               is_causal=causal)
    timed = not args.no_forward
    return {
        COVER: Variant(sparse, {"causal": causal, "block_mask": mask, "block": block}, place,
                       time_forward=timed),
        EXACT_WINDOW: Variant(_ring_fn(mesh, "contiguous", is_causal=causal, window=win),
                              {"causal": causal, "window": win}, place, time_forward=timed),
        SPARSE_WINDOW: Variant(functools.partial(sparse, window=win),
                               {"causal": causal, "window": win}, place, time_forward=timed),
    }


def cap_variants(args, n: int, sinks: np.ndarray) -> dict[str, Variant]:
    """The softcap part at length ``n``: exact causal attention on one device."""
    import jax.numpy as jnp
    mesh = dev.seq_mesh(1)
    place = _one_device(jnp.dtype(args.dtype))
    c = args.soft_cap
    timed = not args.no_forward
    out = {}
    for name, extra in ((PLAIN, {}), (CAP, {"logit_soft_cap": c}),
                        (SINKS, {"sinks": sinks}), (CAP_SINKS, {"logit_soft_cap": c,
                                                                "sinks": sinks})):
        computes = {"causal": True, "soft_cap": extra.get("logit_soft_cap"),
                    "sinks": extra.get("sinks")}
        kwargs = dict(extra)
        if "sinks" in kwargs:
            kwargs["sinks"] = jnp.asarray(sinks, jnp.float32)
        out[name] = Variant(_ring_fn(mesh, "contiguous", is_causal=True, **kwargs), computes,
                            place, time_forward=timed)
    return out


# ---------------------------------------------------------------- checks, timing

def check_variants(variants: dict[str, Variant], host: list[np.ndarray], args) -> dict:
    """Every variant's output and gradients against :func:`dense_reference` of what it
    computes, and the windowed ones (no block mask, soft-cap or sinks) also against
    ``jax.nn.dot_product_attention(local_window_size=...)``: ``{variant: {reference:
    {output, dq, dk, dv: max_rel_diff}, rtol, agree}}``."""
    import jax
    import jax.numpy as jnp
    dtype = jnp.dtype(args.dtype)
    rtol = CHECK_RTOL[args.dtype]
    # the references see the inputs as the variants do (rounded to the dtype)
    q, k, v, ct = (np.asarray(jnp.asarray(x, dtype), np.float32) for x in host)
    scale = args.head_dim ** -0.5
    out, nn_cache = {}, {}
    for name, var in variants.items():
        placed = [var.place(x) for x in host]
        got = [np.asarray(var.back(x), np.float64)
               for x in _with_grads(var.fwd_bwd, *placed)]
        wants = {"dense": dense_reference(q, k, v, ct, scale=scale, **var.computes)}
        c = var.computes
        if c.get("window") and not any(c.get(x) is not None
                                       for x in ("block_mask", "soft_cap", "sinks")):
            key = (c.get("causal", False), tuple(c["window"]), q.shape)
            if key not in nn_cache:  # one program per window (and shapes)
                nn_cache[key] = _with_grads(_forward_backward(functools.partial(
                    jax.nn.dot_product_attention, scale=scale, is_causal=key[0],
                    local_window_size=key[1])), *(jnp.asarray(x) for x in (q, k, v, ct)))
            wants["jax.nn local_window_size"] = nn_cache[key]
        res = {}
        for ref_name, want in wants.items():
            res[ref_name] = {key: harness.max_rel_diff(a, np.asarray(r, np.float64))
                             for key, a, r in zip(("output", "dq", "dk", "dv"), got, want)}
        worst = max(d["rel_to_max"] for r in res.values() for d in r.values())
        out[name] = {**res, "rtol": rtol, "worst_rel": worst, "agree": worst <= rtol,
                     "seq_len": int(host[0].shape[1])}
    return out


def time_variants(name: str, variants: dict[str, Variant], reference: str, host, args,
                  progress) -> dict:
    """Compile every variant (temp memory of its forward+backward), then one
    interleaved set per pass; ``vs_reference`` is the paired per-round ratio."""
    import jax
    results, calls = {}, {FWD: {}, FWD_BWD: {}}
    for vname, var in variants.items():
        progress.start(f"{name}: {vname}: compile")
        inputs = [var.place(x) for x in host]
        results[vname] = {"memory_forward_backward":
                          harness.compiled_memory(var.fwd_bwd, *inputs).to_json()}
        # the same function on the same shapes: JAX's cache returns that executable
        fb = jax.jit(var.fwd_bwd).lower(*inputs).compile()
        calls[FWD_BWD][vname] = functools.partial(fb, *inputs)
        if var.time_forward:
            fw = jax.jit(var.fn).lower(*inputs[:3]).compile()
            calls[FWD][vname] = functools.partial(fw, *inputs[:3])
        progress.done()
    for label in (FWD, FWD_BWD):
        if not calls[label]:
            continue
        progress.start(f"{name}: time {label.replace('_', '+')} ({len(calls[label])} "
                       f"variants x {args.repeats})")
        timings = harness.time_interleaved(calls[label], repeats=args.repeats,
                                           warmup=args.warmup, lead_in=args.lead_in)
        for vname, t in timings.items():
            results[vname][label] = t.to_json()
            if reference in timings:
                results[vname][label]["vs_reference"] = harness.paired_ratio(
                    t, timings[reference])
        progress.done()
    return {"reference": reference, "variants": results}


def _host(rng, args, n: int) -> list[np.ndarray]:
    """q, k, v and the cotangent, float32 [B, n, H, D] (rounded to the dtype when placed)."""
    shape = (args.batch, n, args.heads, args.head_dim)
    return [rng.standard_normal(shape, dtype=np.float32) for _ in range(4)]


def _part(name, build, reference, args, rng, progress, n, *, amplitude: float = 1.0,
          **sizes) -> dict:
    """A part: the checks at the small size (``build`` with scaled sizes; queries times
    ``amplitude``), then timing."""
    out = {"seq_len": n, **sizes}
    variants = build(n, **sizes)
    for small in _check_len(args, n):
        progress.start(f"{name}: equality checks at n={small}")
        scaled = {key: _scaled(x, small, n) for key, x in sizes.items()}
        checked = variants if small == n else build(small, **scaled)
        host = _host(rng, args, small)
        host[0] = host[0] * np.float32(amplitude)
        out["check"] = {"seq_len": small, "query_amplitude": amplitude, **scaled,
                        "variants": check_variants(checked, host, args)}
        progress.done()
    out.update(time_variants(name, variants, reference, _host(rng, args, n), args,
                             progress))
    return out


def cap_amplitude(soft_cap: float) -> float:
    """Query amplitude of the softcap part's check: random inputs give scaled logits of
    about unit size (``scale = 1 / sqrt(head_dim)``), where ``c tanh(s / c)`` barely differs from ``s`` for the default
    ``c = 50`` (by ``s^3 / 3c^2``, near the float32 tolerance); queries times ``c / 2``
    give logits of about ``c / 2``, which the cap visibly bends (the timed inputs are
    not scaled: the cost does not depend on the values)."""
    return max(1.0, soft_cap / 2)


# ------------------------------------------------------------------ ring work

def ring_work(seq_len: int, devices: int, layout: str, window: int | None) -> dict:
    """Ring steps (device x step) and kernel blocks a causal ring executes, from the
    positions alone: the rules of ``any_pair_allowed`` (causal: the visiting shard's
    earliest key <= the latest local query; window: the position ranges of some piece
    of each side, its contiguous chunks, meet when widened by the window), applied to
    whole shards (steps) and to the kernel blocks of a running step (block size of
    :func:`benchmarks.ring.ring_block`). Shards travel every hop whatever runs."""
    from jax_dilated.core.layouts import global_order
    m = seq_len // devices
    block = ring_block(m, layout)
    pieces = 2 if layout == "zigzag" else 1
    pos = global_order(seq_len, devices, layout).reshape(devices, m)

    def allowed(qs, ks):  # [a, L], [b, L] contiguous runs -> bool [a, b]
        ok = ks.min(-1)[None, :] <= qs.max(-1)[:, None]
        if window is not None:
            ok &= ks.max(-1)[None, :] >= qs.min(-1)[:, None] - window
        return ok

    steps = blocks = 0
    for d in range(devices):
        for s in range(devices):
            src = (d - s) % devices
            q, k = pos[d], pos[src]
            if not (k.min() <= q.max() and allowed(q.reshape(pieces, -1),
                                                   k.reshape(pieces, -1)).any()):
                continue
            steps += 1
            blocks += int(allowed(q.reshape(-1, block), k.reshape(-1, block)).sum())
    nb = m // block
    return {"layout": layout, "block": block, "window": window, "steps_run": steps,
            "steps_total": devices ** 2, "blocks_run": blocks,
            "blocks_total": devices ** 2 * nb * nb, "hops_forward": devices,
            "hops_backward": devices}


# ---------------------------------------------------------------------------- run

@harness.register("window", "sliding windows, soft-capping and sinks: windowed ring against "
                            "the full ring, token window against its block-sparse cover, "
                            "soft-cap/sinks against plain attention", add_arguments,
                  repeats=5, quick_repeats=2)
def run(args: argparse.Namespace) -> dict:
    """The ``window`` benchmark; returns the JSON-able results."""
    _resolve(args)
    if "ring" in args.parts:
        try:
            dev.request_cpu_devices(args.devices)
        except RuntimeError:  # JAX already started (a test): take_devices checks the count
            pass
    config = {k: getattr(args, k) for k in (
        "ring_seq_len", "ring_window", "local_seq_len", "local_window", "local_causal",
        "cap_seq_len", "block", "devices", "layout", "soft_cap", "batch", "heads",
        "head_dim", "dtype", "parts", "ring_forward", "no_forward", "lead_in",
        "check_seq_len", "repeats", "warmup", "quick", "seed", "threads")}
    rng = np.random.default_rng(args.seed)
    sinks = rng.standard_normal(args.heads).astype(np.float32)
    checks = 1 if _check_len(args, 1) else 0
    timed = 1 if args.no_forward else 2
    per_part = {"ring": checks + 2 + 1 + args.ring_forward, "local": checks + 3 + timed,
                "softcap": checks + 4 + timed}
    progress = harness.Progress(sum(per_part[p] for p in args.parts), "window")
    progress.write(f"window: parts={','.join(args.parts)} B={args.batch} H={args.heads} "
                   f"hd={args.head_dim} {args.dtype} threads={args.threads} repeats="
                   f"{args.repeats} warmup={args.warmup} lead-in={args.lead_in}")
    payload = {"benchmark": "window", "config": config}
    if "ring" in args.parts:
        payload["ring"] = _part(
            "ring", lambda n, window: ring_variants(args, n, window), RING_FULL, args, rng,
            progress, args.ring_seq_len, window=args.ring_window)
        payload["ring"]["work"] = {
            name: ring_work(args.ring_seq_len, args.devices, args.layout, w)
            for name, w in ((RING_FULL, None), (RING_WINDOW, args.ring_window))}
    if "local" in args.parts:
        n = args.local_seq_len
        payload["local"] = _part(
            "local", lambda n, window, block: local_variants(args, n, window, block), COVER,
            args, rng, progress, n, window=args.local_window, block=args.block)
        win = (args.local_window, 0 if args.local_causal else args.local_window)
        before, after = cover(win, args.block)
        payload["local"]["cover"] = {"block": args.block, "before": before, "after": after,
                                     "pattern": f"LocalWindow({before}, {after})",
                                     "keys_per_query": _keys_per_query(n, win, args.block,
                                                                       args.local_causal)}
    if "softcap" in args.parts:
        payload["softcap"] = _part(
            "softcap", lambda n: cap_variants(args, n, sinks), PLAIN, args, rng, progress,
            args.cap_seq_len, amplitude=cap_amplitude(args.soft_cap))
        payload["softcap"]["sinks"] = sinks.tolist()
    progress.close()
    payload["environment"] = harness.environment(args.threads, args.load)
    if "ring" in args.parts:
        payload["environment"]["ring_devices"] = str(dev.take_devices(args.devices)[0]
                                                     .device_kind)
    payload["targets"] = targets(payload)
    print_summary(payload)
    return payload


def _keys_per_query(n: int, window: tuple[int, int], block: int, causal: bool) -> dict:
    """Mean keys a query attends to: the token window against its block cover."""
    p = np.arange(n)
    lo_w, hi_w = np.maximum(p - window[0], 0), np.minimum(p + window[1], n - 1)
    before, after = cover(window, block)
    i = p // block
    lo_c = np.maximum((i - before) * block, 0)
    hi_c = np.minimum((i + after + 1) * block - 1, n - 1)
    if causal:
        hi_c = np.minimum(hi_c, p)
    return {"window": float(np.mean(hi_w - lo_w + 1)), "cover": float(np.mean(hi_c - lo_c + 1))}


# ------------------------------------------------------------------------ targets

def targets(payload: dict) -> list[dict]:
    """The issue's targets against this run's figures: ``{target, value, bound, pass}``;
    a variant whose equality check failed fails its targets."""
    out = []

    def agree(part, name):
        check = part.get("check", {}).get("variants", {}).get(name)
        return True if check is None else check["agree"]

    def add(part, name, label, bound, what):
        res = part["variants"][name].get(label)
        if res is None or "vs_reference" not in res:
            return
        ok = agree(part, name) and agree(part, part["reference"])
        out.append({"target": f"{what}: {label.replace('_', '+')} time / "
                              f"{part['reference']}", "value": res["vs_reference"],
                    "bound": bound, "pass": res["vs_reference"] <= bound and ok,
                    "note": "" if ok else "equality check failed"})

    ring = payload.get("ring")
    if ring:
        for label in (FWD_BWD, FWD):
            add(ring, RING_WINDOW, label, RING_TARGET, f"ring window {ring['window']}")
    local = payload.get("local")
    if local:
        for name in (EXACT_WINDOW, SPARSE_WINDOW):
            for label in (FWD_BWD, FWD):
                add(local, name, label, LOCAL_TARGET, f"local {name}")
    cap = payload.get("softcap")
    if cap:
        for name in (CAP, SINKS, CAP_SINKS):
            for label in (FWD_BWD, FWD):
                add(cap, name, label, CAP_TARGET, name)
    for part_name in PARTS:
        part = payload.get(part_name)
        for name, check in ((part or {}).get("check") or {}).get("variants", {}).items():
            out.append({"target": f"check ({part_name}) {name}: max rel diff against the "
                                  f"references (n={check['seq_len']})",
                        "value": check["worst_rel"],
                        "bound": check["rtol"], "pass": check["agree"], "note": ""})
    return out


# -------------------------------------------------------------------------- tables

HEADERS = ["variant", "fwd+bwd ms", "spread", "vs ref", "fwd ms", "spread", "vs ref",
           "fwd+bwd temp MiB", "check rel diff"]


def _rows(part: dict) -> list[list[str]]:
    checks = (part.get("check") or {}).get("variants", {})
    rows = []
    for name, res in part["variants"].items():
        row = [name]
        for label in (FWD_BWD, FWD):
            t = res.get(label)
            row += ["-", "-", "-"] if t is None else [
                fmt_ms(t["median_s"]), fmt_spread(t["spread"]),
                "-" if "vs_reference" not in t else f"{t['vs_reference']:.3f}x"]
        mem = res["memory_forward_backward"]["temp"] / 2 ** 20
        check = checks.get(name)
        diff = "-" if check is None else (f"{check['worst_rel']:.1e}"
                                          + ("" if check["agree"] else " **"))
        rows.append(row + [f"{mem:.1f}", diff])
    return rows


def print_summary(payload: dict) -> None:
    """The tables of a ``window`` run and the targets."""
    cfg, env = payload["config"], payload["environment"]
    print()
    print(f"sliding windows, soft-capping, sinks: B={cfg['batch']}, H={cfg['heads']}, "
          f"hd={cfg['head_dim']}, {cfg['dtype']}; {env.get('cpu', '?')}, {cfg['threads']} "
          f"threads, commit {str(env.get('git_commit'))[:8]}"
          f"{' (dirty)' if env.get('git_dirty') else ''}, {env.get('date_utc')}")
    print(f"(times: medians of {cfg['repeats']} interleaved rounds, each timed call after "
          f"{cfg['lead_in']} untimed one(s); spread = (max - min) / median; vs ref = paired "
          f"median of variant / reference time per round; temp: compiled memory_analysis(); "
          f"check rel diff: worst max |diff| / max |reference| of output and gradients "
          f"against a dense masked computation (and jax.nn local_window_size for windows) "
          f"at the check length, ** = beyond the tolerance)")
    print()
    ring = payload.get("ring")
    if ring:
        harness.print_table(
            f"ring attention, causal, n={ring['seq_len']}, P={cfg['devices']} "
            f"({env.get('ring_devices', '?')} devices; temp per device), layout "
            f"{cfg['layout']}, window ({ring['window']}, 0); reference: {RING_FULL}",
            HEADERS, _rows(ring), env=env)
        rows = []
        base = ring["work"][RING_FULL]
        for name, w in ring["work"].items():
            rows.append([name, str(w["block"]), f"{w['steps_run']}/{w['steps_total']}",
                         f"{w['blocks_run']}/{w['blocks_total']}",
                         f"{w['blocks_run'] / base['blocks_run']:.3f}",
                         f"{w['hops_forward']} + {w['hops_backward']}"])
        harness.print_table(
            "ring work the skip rules execute (from the positions, nothing timed): steps "
            "(device x step) and kernel blocks computed, blocks against the unwindowed "
            "ring's, and the hops every shard travels (forward + backward) regardless",
            ["ring", "block", "steps run", "blocks run", "blocks vs no window", "hops"], rows)
    local = payload.get("local")
    if local:
        c = local["cover"]
        k = c["keys_per_query"]
        harness.print_table(
            f"token window against its block cover, one device, n={local['seq_len']}, window "
            f"{local['window']} ({'causal' if cfg['local_causal'] else 'both sides'}); "
            f"reference: {COVER} = {c['pattern']} of blocks of {c['block']} (the smallest "
            f"cover; keys per query {k['cover']:.0f} against the window's {k['window']:.0f})",
            HEADERS, _rows(local), env=env)
    cap = payload.get("softcap")
    if cap:
        harness.print_table(
            f"soft-cap (c={cfg['soft_cap']:g}) and sinks, exact causal attention "
            f"(jd.ring_attention, one device), n={cap['seq_len']}; reference: {PLAIN}",
            HEADERS, _rows(cap), env=env)
    rows = [[t["target"], f"{t['value']:.3g}", f"<= {t['bound']:g}",
             "PASS" if t["pass"] else "FAIL", t["note"]] for t in payload["targets"]]
    harness.print_table("issue 18 targets", ["target", "value", "bound", "", "note"], rows,
                        env=env)


