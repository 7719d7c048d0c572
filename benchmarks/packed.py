"""``python -m benchmarks packed``: packed sequences (``segment_ids``, issue 17).

``D`` documents of ``L = n / D`` tokens packed in one row of ``n`` (ids
``0 ... D-1``, each a contiguous run), against the costs the issue compares them
with, in three interleaved sets (``harness.time_interleaved``: medians, spread,
paired ratios), each variant's compiled temp memory (``harness.compiled_memory``;
per device for the ring) and results checked for equality:

* **ring**: causal ``jd.ring_attention`` inside ``jax.shard_map`` over ``P``
  (simulated CPU) devices, forward+backward: one ``n``-token document (no ids; the
  reference), the packed row in each layout (``--layouts``, ids laid out with their
  tokens), and the documents as a batch of ``D`` rows on one device (the work a
  perfect packed ring would do). Also, from the ids alone (NumPy, nothing timed),
  the ring steps and kernel blocks that the skip rules execute, packed against one
  document. Target: packed time <= 0.25x one document, same per-device temp memory.
* **dilated**: ``jd.dilated_attention`` on one device, per mode, forward and
  forward+backward: the documents as a batch of ``D`` rows of ``L`` (reference), the
  packed row with ``segment_ids``, and with ``max_documents=D``; segments scaled to
  the document (default ``L/4, L/2, L`` at rates 1, 2, 4: the README's configuration
  for ``L = 8192`` scaled down). Target: packed <= 1.3x batched, equal results (max
  |packed - batched|).
* **block_sparse**: ``jd.block_sparse_attention`` on one device with the full
  (causal) block pattern (the reference), the same with the packed ids (blocks with
  no same-document pair skipped at run time), the static pattern of exactly those
  blocks (what density costs today) and the documents as a batch. Target: packed <=
  1.3x the static pattern with the same active blocks (time falls with the active
  pairs as it does with density).

The simulated devices share this process's cores: the ring's wall time is the work
of all devices plus what every ring step costs whether or not it computes (sending
keys and values on, the step's conditional), which packing does not remove.
The ring runs ``jd.ring_attention`` in ``jax.shard_map`` on inputs and ids already
in the layout (like the ring op's pre-laid-out variants: the attention alone, without
``jd.sharded``'s permutation into the layout and back).
``--quick``: n = 8192 (documents of 512). Timing is for a quiet machine (the load
warning says when a run was not).
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
from benchmarks.harness import fmt_ms, fmt_spread, int_list, str_list
from benchmarks.ring import ring_block

DEFAULTS = dict(seq_len=32768)
QUICK = dict(seq_len=8192)
PARTS = ("ring", "dilated", "block_sparse")
LAYOUTS = ("contiguous", "zigzag")
MODES = ("head_groups", "longnet")
FWD, FWD_BWD = "forward", "forward_backward"
# the targets
RING_TARGET = 0.25        # packed ring fwd+bwd time / one document
RING_MEMORY_SLACK = 1.05  # packed per-device temp / one document ("same bound")
DILATED_TARGET = 1.3      # packed / batched
SPARSE_TARGET = 1.3       # packed (run-time skip) / static pattern of the same blocks

ONE_DOC = "one document"
ONE_DOC_IDS = "one document, ids all 0"
BATCH_RING = "documents as a batch, 1 device"
BATCHED = "batched"
PACKED = "packed"
PACKED_BOUND = "packed, max_documents=D"
FULL = "full pattern"
PACKED_FULL = "full pattern + ids"
STATIC = "document blocks (static pattern)"
BATCH_SPARSE = "full pattern, documents as a batch"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-len", "-n", type=int, default=None,
                   help=f"packed row length n (default {DEFAULTS['seq_len']}; --quick "
                        f"{QUICK['seq_len']})")
    p.add_argument("--documents", type=int, default=16,
                   help="documents D packed in the row, n / D tokens each (default 16)")
    p.add_argument("--devices", type=int, default=8,
                   help="ring devices P (simulated CPU devices unless the default backend "
                        "has that many; default 8)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=sorted(CHECK_RTOL))
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True,
                   help="causal attention in every part (default; the ring target is causal)")
    p.add_argument("--parts", type=str_list, default=PARTS,
                   help="comma-separated subset of ring,dilated,block_sparse (default all)")
    p.add_argument("--layouts", type=str_list, default=LAYOUTS,
                   help="ring layouts of the packed row (default contiguous,zigzag)")
    p.add_argument("--ring-forward", action="store_true",
                   help="also time the ring's forward pass (default forward+backward only)")
    p.add_argument("--ring-ids-overhead", action="store_true",
                   help="also time the one-document ring with ids (all 0): the cost of the "
                        "id checks alone (as expensive as the reference)")
    p.add_argument("--segment-lengths", type=int_list, default=None,
                   help="dilated segment lengths (default L/4,L/2,L for documents of L)")
    p.add_argument("--dilation-rates", type=int_list, default=(1, 2, 4),
                   help="dilation rates (default 1,2,4)")
    p.add_argument("--modes", type=str_list, default=MODES,
                   help="dilated modes (default head_groups,longnet)")
    p.add_argument("--block", type=int, default=512,
                   help="block-sparse block size (default 512)")
    p.add_argument("--no-forward", action="store_true",
                   help="time forward+backward only in the dilated and block-sparse parts "
                        "(one compilation per variant instead of two)")
    p.add_argument("--seed", type=int, default=0)


def _resolve(args: argparse.Namespace) -> None:
    for name, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    n, d, p = args.seq_len, args.documents, args.devices
    for what, given, allowed in (("--parts", args.parts, PARTS),
                                 ("--layouts", args.layouts, LAYOUTS + ("striped",)),
                                 ("--modes", args.modes, MODES)):
        for x in given:
            if x not in allowed:
                raise SystemExit(f"{what}: unknown {x!r} ({', '.join(allowed)})")
    if d < 1 or n % d:
        raise SystemExit(f"--seq-len {n} must be divisible by --documents {d}")
    if "ring" in args.parts and n % (2 * p):
        raise SystemExit(f"--seq-len {n} must be divisible by 2 x {p} devices")
    doc = n // d
    if args.segment_lengths is None:
        args.segment_lengths = (max(doc // 4, 1), max(doc // 2, 1), doc)
    if len(args.segment_lengths) != len(args.dilation_rates):
        raise SystemExit("--segment-lengths and --dilation-rates differ in length")


def document_ids(seq_len: int, documents: int) -> np.ndarray:
    """[seq_len] int32: ``documents`` contiguous runs of equal length, ids 0 ... D-1."""
    return np.repeat(np.arange(documents, dtype=np.int32), seq_len // documents)


def _meets(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[na, nb] bool: whether block i of ``a`` [na, la] shares an id with block j of ``b``."""
    ids, inv = np.unique(np.concatenate([a.ravel(), b.ravel()]), return_inverse=True)
    inv_a, inv_b = inv[:a.size].reshape(a.shape), inv[a.size:].reshape(b.shape)
    has_a = np.zeros((a.shape[0], ids.size), bool)
    has_b = np.zeros((b.shape[0], ids.size), bool)
    np.put_along_axis(has_a, inv_a, True, axis=1)
    np.put_along_axis(has_b, inv_b, True, axis=1)
    return (has_a.astype(np.int32) @ has_b.T.astype(np.int32)) > 0


def _allowed(q_pos, k_pos, q_ids, k_ids, causal: bool) -> np.ndarray:
    """[nq, nk] bool: the library's skip rule per (query block, key block): causal
    (earliest key <= latest query) and a shared document id (ids None: no id test)."""
    ok = np.ones((q_pos.shape[0], k_pos.shape[0]), bool)
    if causal:
        ok &= k_pos.min(-1)[None, :] <= q_pos.max(-1)[:, None]
    if q_ids is not None:
        ok &= _meets(q_ids, k_ids)
    return ok


def ring_work(ids: np.ndarray | None, seq_len: int, devices: int, layout: str,
              causal: bool) -> dict:
    """Ring steps and kernel blocks the skip rules execute (from positions and ids only).

    Device ``d`` at step ``s`` holds the keys of device ``(d - s) mod P``; the step
    runs when any (query, key) pair passes the causal test and shares an id (the
    rule of ``any_pair_allowed``, applied to whole shards), and inside a running
    step a kernel block (block size of :func:`benchmarks.ring.ring_block`) runs
    under the same rule. ``ids`` None: one document (no id test).
    """
    from jax_dilated.core.layouts import global_order
    m = seq_len // devices
    block = ring_block(m, layout)
    order = global_order(seq_len, devices, layout)
    pos = order.reshape(devices, m)
    seg = None if ids is None else ids[order].reshape(devices, m)
    steps = blocks = 0
    per_step = []
    for s in range(devices):
        row = 0
        for d in range(devices):
            src = (d - s) % devices
            q_ids = None if seg is None else seg[d][None]
            k_ids = None if seg is None else seg[src][None]
            if not _allowed(pos[d][None], pos[src][None], q_ids, k_ids, causal)[0, 0]:
                continue
            steps += 1
            qb, kb = pos[d].reshape(-1, block), pos[src].reshape(-1, block)
            row += int(_allowed(qb, kb, None if seg is None else seg[d].reshape(-1, block),
                                None if seg is None else seg[src].reshape(-1, block),
                                causal).sum())
        per_step.append(row)
        blocks += row
    nb = m // block
    return {"layout": layout, "block": block, "steps_run": steps, "steps_total": devices ** 2,
            "blocks_run": blocks, "blocks_total": devices ** 2 * nb * nb,
            "blocks_per_step": per_step}


def active_blocks(ids: np.ndarray, block: int, causal: bool) -> np.ndarray:
    """[nb, nb] bool: the blocks of a row with a same-document (causal) pair."""
    n = ids.size
    nb = -(-n // block)
    pad = nb * block - n
    pos = np.concatenate([np.arange(n), np.full(pad, -1)]).reshape(nb, block)
    seg = np.concatenate([ids, np.full(pad, ids[-1])]).reshape(nb, block)
    kpos = np.where(pos < 0, np.iinfo(np.int32).max, pos)
    return _allowed(pos, kpos, seg, seg, causal)


def allowed_pairs(ids: np.ndarray, causal: bool) -> int:
    """(query, key) pairs of one row that attention computes (same document, causal)."""
    _, counts = np.unique(ids, return_counts=True)
    return int(sum(c * (c + 1) // 2 if causal else c * c for c in counts))


# ----------------------------------------------------------------- the variants

@dataclasses.dataclass
class Variant:
    """``fn(q, k, v, ids) -> out`` on ``inputs = (q, k, v, ct, ids)`` (placed);
    ``back`` turns an output or gradient into ``[1, n, H, D]`` token order."""

    fn: Callable
    inputs: tuple
    back: Callable = np.asarray
    time_forward: bool = True


def _forward(fn):
    return lambda q, k, v, ct, ids: fn(q, k, v, ids)


def _forward_backward(fn):
    """``(q, k, v, ct, ids) -> (out, (dq, dk, dv))``: the output and its VJP with ``ct``
    (the forward+backward pass that is timed, measured and checked: one program)."""
    import jax

    def run(q, k, v, ct, ids):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, ids), q, k, v)
        return out, vjp(ct.astype(out.dtype))

    return run


def _run_part(name: str, variants: dict[str, Variant], reference: str, check_against: str,
              args, progress, rtol: float) -> dict:
    """Memory, compile, cross-check and one interleaved timing set of a part's variants.

    Each variant's forward+backward program is compiled once: ``harness.compiled_memory``
    compiles it, and the executable that is timed comes from JAX's compilation cache
    (the same function object on the same inputs)."""
    import jax
    results, calls, computed = {}, {FWD: {}, FWD_BWD: {}}, {}
    for vname, var in variants.items():
        progress.start(f"{name}: {vname}: compile")
        res = results[vname] = {}
        fwd_bwd = _forward_backward(var.fn)
        res["memory_forward_backward"] = harness.compiled_memory(
            fwd_bwd, *var.inputs).to_json()
        fb = jax.jit(fwd_bwd).lower(*var.inputs).compile()
        calls[FWD_BWD][vname] = functools.partial(fb, *var.inputs)
        if var.time_forward:
            fw = jax.jit(_forward(var.fn)).lower(*var.inputs).compile()
            calls[FWD][vname] = functools.partial(fw, *var.inputs)
        out, grads = fb(*var.inputs)
        computed[vname] = [np.asarray(var.back(x), np.float64) for x in (out, *grads)]
        progress.done()
    if check_against is not None:
        for vname, arrays in computed.items():
            check = {key: harness.max_rel_diff(a, r) for key, a, r in
                     zip(("output", "dq", "dk", "dv"), arrays, computed[check_against])}
            worst = max(c["rel_to_max"] for c in check.values())
            results[vname]["check_vs_" + check_against] = {**check, "rtol": rtol,
                                                           "agree": worst <= rtol}
    del computed
    for label in (FWD, FWD_BWD):
        if not calls[label]:
            continue
        progress.start(f"{name}: time {label.replace('_', '+')} ({len(calls[label])} "
                       f"variants x {args.repeats})")
        timings = harness.time_interleaved(calls[label], repeats=args.repeats,
                                           warmup=args.warmup)
        for vname, t in timings.items():
            results[vname][label] = t.to_json()
            if reference in timings:
                # paired: median over the interleaved rounds of variant / reference
                results[vname][label]["vs_reference"] = harness.paired_ratio(
                    t, timings[reference])
        progress.done()
    return {"reference": reference, "checked_against": check_against, "variants": results}


def _random_inputs(args, rng, shape):
    """q, k, v, ct as float32 NumPy arrays (rounded to the dtype when placed)."""
    return [rng.standard_normal(shape, dtype=np.float32) for _ in range(4)]


def _ring_part(args, host, ids, progress) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_dilated as jd
    from jax_dilated.backends import KernelArgs, get_kernel
    from jax_dilated.core.layouts import global_order
    n, p, d = args.seq_len, args.devices, args.documents
    dtype = jnp.dtype(args.dtype)
    mesh = dev.seq_mesh(p)
    spec = P(None, "seq")
    seq = NamedSharding(mesh, spec)

    def ring(layout, with_ids):
        def local(q, k, v, seg):
            return jd.ring_attention(q, k, v, seq_axis="seq", is_causal=args.causal,
                                     layout=layout, segment_ids=seg if with_ids else None)
        return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 4,
                             out_specs=spec)

    def placed(order, seg):
        xs = [jax.device_put(jnp.asarray(x[:, order], dtype), seq) for x in host]
        return (*xs, jax.device_put(jnp.asarray(seg[None, order], jnp.int32), seq))

    ident = np.arange(n)
    variants = {ONE_DOC: Variant(ring("contiguous", False), placed(ident, ids),
                                 time_forward=args.ring_forward)}
    if args.ring_ids_overhead:
        variants[ONE_DOC_IDS] = Variant(ring("contiguous", True),
                                        placed(ident, np.zeros_like(ids)),
                                        time_forward=args.ring_forward)
    for layout in args.layouts:
        order = global_order(n, p, layout)
        back = functools.partial(_undo_order, np.argsort(order))
        variants[f"{PACKED} {layout}"] = Variant(ring(layout, True), placed(order, ids), back,
                                                 time_forward=args.ring_forward)
    # the documents alone, as a batch, through the kernel on one device: the work a
    # packed ring cannot go below, and the cross-check of its results
    kernel = get_kernel(None)
    kargs = KernelArgs(scale=args.head_dim ** -0.5, is_causal=args.causal)
    one = mesh.devices.flat[0]
    batch = (d, n // d, args.heads, args.head_dim)
    xs = [jax.device_put(jnp.asarray(x.reshape(batch), dtype), one) for x in host]
    variants[BATCH_RING] = Variant(
        lambda q, k, v, seg: kernel.attention(q, k, v, kargs)[0],
        (*xs, jax.device_put(jnp.asarray(ids.reshape(d, -1)), one)),
        lambda a: np.asarray(a).reshape(1, n, *np.shape(a)[2:]), time_forward=args.ring_forward)
    out = _run_part("ring", variants, ONE_DOC, BATCH_RING, args, progress,
                    CHECK_RTOL[args.dtype])
    # one document computes other numbers (attention across documents): no equality check
    for name in (ONE_DOC, ONE_DOC_IDS):
        out["variants"].get(name, {}).pop("check_vs_" + BATCH_RING, None)
    work = {}
    for layout in dict.fromkeys(("contiguous", *args.layouts)):
        work[f"{PACKED} {layout}"] = ring_work(ids, n, p, layout, args.causal)
        work[f"{ONE_DOC} {layout}"] = ring_work(None, n, p, layout, args.causal)
    out["work"] = work
    out["allowed_pairs"] = {"packed": allowed_pairs(ids, args.causal),
                            "one_document": allowed_pairs(np.zeros_like(ids), args.causal)}
    return out


def _undo_order(inverse: np.ndarray, x) -> np.ndarray:
    """A laid-out global array back in token order (NumPy, outside the timed code)."""
    return np.asarray(x)[:, inverse]


def _dilated_part(args, host, ids, progress) -> dict:
    import jax
    import jax.numpy as jnp

    import jax_dilated as jd
    n, d = args.seq_len, args.documents
    dtype = jnp.dtype(args.dtype)
    one = dev.take_devices(1)[0]
    batch = (d, n // d, args.heads, args.head_dim)
    packed_in = (*[jax.device_put(jnp.asarray(x, dtype), one) for x in host],
                 jax.device_put(jnp.asarray(ids[None], jnp.int32), one))
    batched_in = (*[jax.device_put(jnp.asarray(x.reshape(batch), dtype), one) for x in host],
                  jax.device_put(jnp.asarray(ids.reshape(d, -1), jnp.int32), one))

    def unbatch(a):
        return np.asarray(a).reshape(1, n, *np.shape(a)[2:])

    out = {}
    for mode in args.modes:
        attn = functools.partial(jd.dilated_attention, segment_lengths=args.segment_lengths,
                                 dilation_rates=args.dilation_rates, mode=mode,
                                 is_causal=args.causal)
        variants = {
            BATCHED: Variant(lambda q, k, v, seg, attn=attn: attn(q, k, v), batched_in,
                             unbatch),
            PACKED: Variant(lambda q, k, v, seg, attn=attn: attn(q, k, v, segment_ids=seg),
                            packed_in),
            PACKED_BOUND: Variant(lambda q, k, v, seg, attn=attn: attn(
                q, k, v, segment_ids=seg, max_documents=d), packed_in),
        }
        for var in variants.values():
            var.time_forward = not args.no_forward
        out[mode] = _run_part(f"dilated {mode}", variants, BATCHED, BATCHED, args, progress,
                              CHECK_RTOL[args.dtype])
    return out


def _block_sparse_part(args, host, ids, progress) -> dict:
    import jax
    import jax.numpy as jnp

    import jax_dilated as jd
    n, d, block = args.seq_len, args.documents, args.block
    dtype = jnp.dtype(args.dtype)
    one = dev.take_devices(1)[0]
    nb = -(-n // block)
    full = np.ones((nb, nb), bool)
    diag = active_blocks(ids, block, args.causal)
    doc = n // d
    batch = (d, doc, args.heads, args.head_dim)
    packed_in = (*[jax.device_put(jnp.asarray(x, dtype), one) for x in host],
                 jax.device_put(jnp.asarray(ids[None], jnp.int32), one))
    batched_in = (*[jax.device_put(jnp.asarray(x.reshape(batch), dtype), one) for x in host],
                  jax.device_put(jnp.asarray(ids.reshape(d, -1), jnp.int32), one))
    attn = functools.partial(jd.block_sparse_attention, block_size=block, is_causal=args.causal)
    nbd = -(-doc // block)
    variants = {
        FULL: Variant(lambda q, k, v, seg: attn(q, k, v, pattern=full), packed_in),
        PACKED_FULL: Variant(lambda q, k, v, seg: attn(q, k, v, pattern=full, segment_ids=seg),
                             packed_in),
        STATIC: Variant(lambda q, k, v, seg: attn(q, k, v, pattern=diag), packed_in),
        BATCH_SPARSE: Variant(lambda q, k, v, seg: attn(q, k, v, pattern=np.ones((nbd, nbd),
                                                                                  bool)),
                              batched_in, lambda a: np.asarray(a).reshape(1, n, *np.shape(a)[2:])),
    }
    for var in variants.values():
        var.time_forward = not args.no_forward
    out = _run_part("block_sparse", variants, FULL, BATCH_SPARSE, args, progress,
                    CHECK_RTOL[args.dtype])
    res = out["variants"]
    res[FULL].pop("check_vs_" + BATCH_SPARSE, None)  # attends across documents
    if doc % block:  # a block holds two documents: the static pattern crosses them
        res[STATIC].pop("check_vs_" + BATCH_SPARSE, None)
    causal_full = active_blocks(np.zeros_like(ids), block, args.causal)
    out["blocks"] = {"full": int(causal_full.sum()), "active": int(diag.sum()),
                     "fraction": float(diag.sum() / causal_full.sum())}
    out["pairs_fraction"] = (allowed_pairs(ids, args.causal)
                             / allowed_pairs(np.zeros_like(ids), args.causal))
    return out


# ------------------------------------------------------------------------ targets

def targets(payload: dict) -> list[dict]:
    """The issue's targets against this run's figures: ``{name, value, bound, pass}``."""
    out = []

    def add(name, value, bound, note=""):
        if value is None:  # a pass that was not timed (--no-forward)
            return
        out.append({"target": name, "value": value, "bound": bound,
                    "pass": value <= bound, "note": note})

    def ratio(res, label=FWD_BWD):
        return res.get(label, {}).get("vs_reference")

    ring = payload.get("ring")
    if ring:
        ref = ring["variants"][ONE_DOC]
        for name, res in ring["variants"].items():
            if not name.startswith(PACKED):
                continue
            add(f"ring {name}: fwd+bwd time / one document", ratio(res), RING_TARGET)
            if "memory_forward_backward" in res:
                add(f"ring {name}: per-device fwd+bwd temp / one document",
                    res["memory_forward_backward"]["temp"]
                    / max(ref["memory_forward_backward"]["temp"], 1), RING_MEMORY_SLACK)
            check = res.get("check_vs_" + BATCH_RING)
            if check:
                add(f"ring {name}: max |packed - batch| / max |batch|",
                    max(c["rel_to_max"] for k, c in check.items() if isinstance(c, dict)),
                    check["rtol"])
    for mode, part in (payload.get("dilated") or {}).items():
        for name in (PACKED, PACKED_BOUND):
            res = part["variants"][name]
            for label in (FWD, FWD_BWD):
                add(f"dilated {mode} {name}: {label.replace('_', '+')} time / batched",
                    ratio(res, label), DILATED_TARGET)
            check = res["check_vs_" + BATCHED]
            add(f"dilated {mode} {name}: max |packed - batched| / max |batched|",
                max(c["rel_to_max"] for c in check.values() if isinstance(c, dict)),
                check["rtol"])
    sparse = payload.get("block_sparse")
    if sparse:
        res = sparse["variants"]
        for label in (FWD, FWD_BWD):
            a, b = res[PACKED_FULL].get(label), res[STATIC].get(label)
            value = None if not a or not b else a["median_s"] / b["median_s"]
            add(f"block_sparse packed: {label.replace('_', '+')} time / static pattern of "
                f"the same blocks", value, SPARSE_TARGET,
                f"active blocks {sparse['blocks']['fraction']:.3f} of the full pattern")
        check = res[PACKED_FULL].get("check_vs_" + BATCH_SPARSE)
        if check:
            add("block_sparse packed: max |packed - batch| / max |batch|",
                max(c["rel_to_max"] for c in check.values() if isinstance(c, dict)),
                check["rtol"])
    return out


# ---------------------------------------------------------------------------- run

@harness.register("packed", "packed sequences (segment_ids): ring, dilated and block-sparse "
                            "against one document / the documents as a batch", add_arguments,
                  repeats=5, quick_repeats=2)
def run(args: argparse.Namespace) -> dict:
    """The ``packed`` benchmark; returns the JSON-able results."""
    _resolve(args)
    if "ring" in args.parts:
        try:
            dev.request_cpu_devices(args.devices)
        except RuntimeError:  # JAX already started (a test): take_devices checks the count
            pass
    config = {k: getattr(args, k) for k in (
        "seq_len", "documents", "devices", "heads", "head_dim", "dtype", "causal", "parts",
        "layouts", "ring_forward", "ring_ids_overhead", "no_forward", "segment_lengths", "dilation_rates",
        "modes", "block", "repeats", "warmup", "quick", "seed", "threads")}
    rng = np.random.default_rng(args.seed)
    shape = (1, args.seq_len, args.heads, args.head_dim)
    host = _random_inputs(args, rng, shape)
    ids = document_ids(args.seq_len, args.documents)
    timed = 1 if args.no_forward else 2  # interleaved sets per part (one per pass)
    per_part = {"ring": 2 + len(args.layouts) + args.ring_ids_overhead + 1 + args.ring_forward,
                "dilated": len(args.modes) * (3 + timed), "block_sparse": 4 + timed}
    progress = harness.Progress(sum(per_part[p] for p in args.parts), "packed")
    progress.write(f"packed: n={args.seq_len} D={args.documents} documents of "
                   f"{args.seq_len // args.documents}, H={args.heads} hd={args.head_dim} "
                   f"{args.dtype} causal={args.causal} P={args.devices} parts="
                   f"{','.join(args.parts)} threads={args.threads} repeats={args.repeats}")
    payload = {"benchmark": "packed", "config": config}
    parts = {"ring": _ring_part, "dilated": _dilated_part, "block_sparse": _block_sparse_part}
    for name in PARTS:
        if name in args.parts:
            payload[name] = parts[name](args, host, ids, progress)
    progress.close()
    payload["environment"] = harness.environment(args.threads, args.load)
    if "ring" in args.parts:
        payload["environment"]["ring_devices"] = str(dev.take_devices(args.devices)[0]
                                                     .device_kind)
    payload["targets"] = targets(payload)
    print_summary(payload)
    return payload


# -------------------------------------------------------------------------- tables

def _mib(res: dict) -> str:
    mem = res.get("memory_forward_backward")
    return "-" if mem is None else f"{mem['temp'] / 2 ** 20:.1f}"


def _diff(res: dict) -> str:
    check = next((v for k, v in res.items() if k.startswith("check_vs_")), None)
    if check is None:
        return "-"
    worst = max(c["max_abs_diff"] for c in check.values() if isinstance(c, dict))
    return f"{worst:.1e}" + ("" if check["agree"] else " **")


def _rows(part: dict) -> list[list[str]]:
    rows = []
    for name, res in part["variants"].items():
        row = [name]
        for label in (FWD_BWD, FWD):
            t = res.get(label)
            row += ["-", "-", "-"] if t is None else [
                fmt_ms(t["median_s"]), fmt_spread(t["spread"]),
                "-" if "vs_reference" not in t else f"{t['vs_reference']:.3f}x"]
        rows.append(row + [_mib(res), _diff(res)])
    return rows


HEADERS = ["variant", "fwd+bwd ms", "spread", "vs ref", "fwd ms", "spread", "vs ref",
           "fwd+bwd temp MiB", "max |diff|"]


def print_summary(payload: dict) -> None:
    """The tables of a ``packed`` run, the ring's executed work and the targets."""
    cfg, env = payload["config"], payload["environment"]
    n, d = cfg["seq_len"], cfg["documents"]
    print()
    print(f"packed sequences: n={n}, {d} documents of {n // d}, H={cfg['heads']}, "
          f"hd={cfg['head_dim']}, {cfg['dtype']}, causal={cfg['causal']}; "
          f"{env.get('cpu', '?')}, {cfg['threads']} threads, commit "
          f"{str(env.get('git_commit'))[:8]}{' (dirty)' if env.get('git_dirty') else ''}, "
          f"{env.get('date_utc')}")
    print(f"(times: medians of {cfg['repeats']} interleaved rounds; spread = (max - min) / "
          f"median; vs ref = paired median of variant / reference time per round; temp: "
          f"compiled memory_analysis(); max |diff|: outputs and gradients against the "
          f"checked-against variant, ** = beyond the tolerance)")
    print()
    ring = payload.get("ring")
    if ring:
        harness.print_table(
            f"ring attention over P={cfg['devices']} ({env.get('ring_devices', '?')} "
            f"devices; temp per device), reference: {ONE_DOC}; |diff| against "
            f"{BATCH_RING}", HEADERS, _rows(ring), env=env)
        rows = []
        for name, w in ring["work"].items():
            base = ring["work"][f"{ONE_DOC} {w['layout']}"]
            rows.append([name, str(w["block"]), f"{w['steps_run']}/{w['steps_total']}",
                         f"{w['blocks_run']}/{w['blocks_total']}",
                         f"{w['steps_run'] / base['steps_run']:.3f}",
                         f"{w['blocks_run'] / base['blocks_run']:.3f}"])
        pairs = ring["allowed_pairs"]
        harness.print_table(
            "ring work the skip rules execute (from the ids, nothing timed): ring steps "
            "(device x step) and kernel blocks run, and their fraction of one document's "
            f"in the same layout; allowed pairs {pairs['packed'] / pairs['one_document']:.4f} "
            "of one document's",
            ["ring", "block", "steps run", "blocks run", "steps vs one doc",
             "blocks vs one doc"], rows)
    for mode, part in (payload.get("dilated") or {}).items():
        harness.print_table(
            f"dilated attention, mode={mode}, segments {tuple(cfg['segment_lengths'])} rates "
            f"{tuple(cfg['dilation_rates'])}, one device; reference and |diff| against: "
            f"{BATCHED} ({d} rows of {n // d})", HEADERS, _rows(part), env=env)
    sparse = payload.get("block_sparse")
    if sparse:
        b = sparse["blocks"]
        harness.print_table(
            f"block-sparse attention, block {cfg['block']}, one device; reference: {FULL}; "
            f"active blocks {b['active']}/{b['full']} = {b['fraction']:.3f}, allowed pairs "
            f"{sparse['pairs_fraction']:.4f} of the full pattern's; |diff| against "
            f"{BATCH_SPARSE}", HEADERS, _rows(sparse), env=env)
    rows = [[t["target"], f"{t['value']:.3g}",
             f"<= {t['bound']:g}", "PASS" if t["pass"] else "FAIL",
             t["note"]] for t in payload["targets"]]
    harness.print_table("issue 17 targets", ["target", "value", "bound", "", "note"], rows,
                        env=env)
