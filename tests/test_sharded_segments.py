"""Packed sequences (``segment_ids``) through the sequence-parallel paths.

``jd.sharded(fn, mesh, strategy=...)(q, k, v, kv_mask=, segment_ids=)`` for every
strategy and operation, and ``jd.dilated_attention(seq_axis=, segment_ids=)`` inside
``shard_map``, must equal the single-device result (docs/semantics.md, sections 1, 2
and 8): output and the gradients of q, k, v through a random cotangent, float64, at
1e-10. Exact attention is checked against the PyTorch reference
(``torch_reference.dense_attention`` with the document mask built here from the ids);
dilated and block-sparse attention against the library's single-device call with the
same ids (parity-tested against PyTorch in test_dilated_packed.py / test_segments.py),
so that these also run where PyTorch is not installed.

The ids (T = 32, batch 2): row 0 holds sorted documents of 3, 1, 13, 9 and 6 tokens
(the 13-token one spans shards and zigzag chunks on 2 and 4 devices); row 1 has ids
that are not sorted, and ids 5 and 3 each name two documents. Random padding masks on top.
Shapes are tiny: the module runs in seconds.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _mesh import build_mesh
from jax.sharding import PartitionSpec as P

import jax_dilated as jd
from jax_dilated import block_patterns as bp

from _helpers import TOL, as_np, assert_close, output_and_grads, to_torch

B, T, D = 2, 32, 4


def _ids():
    row0 = np.repeat([4, 0, 7, 2, 9], [3, 1, 13, 9, 6])
    row1 = np.repeat([5, 3, 5, 1, 8, 3], [6, 5, 7, 4, 8, 2])  # 5 and 3 repeat
    return np.stack([row0, row1]).astype(np.int32)


def _inputs(h, hkv, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, h, D))
    k, v = (rng.standard_normal((B, T, hkv, D)) for _ in range(2))
    g = rng.standard_normal((B, T, h, D))
    mask = rng.random((B, T)) < 0.85
    return q, k, v, g, mask


def _torch_exact(q, k, v, g, mask, ids, causal):
    # only the exact cases need PyTorch: the others still run without it (Python 3.12)
    torch = pytest.importorskip("torch")
    import torch_reference as ref

    tq, tk, tv = (to_torch(x, requires_grad=True) for x in (q, k, v))
    # a document is a maximal run of equal ids: number the runs, then compare
    runs = np.cumsum(np.concatenate([np.ones_like(ids[:, :1]), ids[:, 1:] != ids[:, :-1]],
                                    axis=1), axis=1)
    same = torch.as_tensor(runs[:, :, None] == runs[:, None, :])[:, None]
    out = ref.dense_attention(tq, tk, tv, is_causal=causal, kv_mask=torch.as_tensor(mask),
                              allowed=same)
    (to_torch(g) * out).sum().backward()
    return [as_np(out)] + [as_np(x.grad) for x in (tq, tk, tv)]


def _check(got, want):
    for what, a, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(a, w, TOL["float64"], what)


DILATED = dict(segment_lengths=(8, 16), dilation_rates=(2, 4))
SPARSE = dict(block_size=4, pattern=bp.LocalWindow(1) | bp.GlobalBlocks([0]))
PER_HEAD = dict(block_size=4, pattern=bp.RandomBlocks(density=0.5, seed=3, per_head=True))
_FNS = {"exact": jd.ring_attention, "dilated": jd.dilated_attention,
        "block_sparse": jd.block_sparse_attention}

CASES = [
    # (op, options, strategy, P, layout, heads, kv heads)
    ("exact", dict(is_causal=True), "ring", 4, "zigzag", 4, 2),
    # 4-token shards on 8 devices: striped is permuted globally, not inside shard_map
    ("exact", dict(is_causal=False), "allgather", 8, "striped", 8, 4),
    ("exact", dict(is_causal=True), "allgather", 4, "zigzag", 4, 1),
    ("exact", dict(is_causal=True), "heads", 2, "contiguous", 6, 3),
    ("block_sparse", dict(SPARSE, is_causal=True), "ring", 2, "zigzag", 4, 2),
    ("block_sparse", dict(SPARSE, is_causal=True), "allgather", 2, "contiguous", 4, 2),
    ("block_sparse", dict(PER_HEAD, is_causal=False), "heads", 4, "contiguous", 4, 4),
    # dilated: one program under every strategy (the single-device packed call on the
    # whole sequence of some heads); "ring", the operation's own seq_axis path (all-to-all
    # to heads, 4 % 2 == 0), "auto" and a strategy per branch run in test_documents.py
    # against the documents alone, the gathered path (3 heads on 2 devices) in the
    # seq_axis test below. Segments (8, 12) for allgather: 8 does not divide 12, so no
    # padded layout (dilated_packed.slots_capacity). With (8, 16) its program traced a
    # lax.cond of the padded layout and the streams for each device's plan (5 s), and
    # ran the streams (these rows hold more documents than the slots); the heads case
    # below and test_auto_serves_packed_rows still trace that cond on the devices.
    ("dilated", dict(DILATED, segment_lengths=(8, 12), head_offsets="blocked",
                     is_causal=False), "allgather", 2, "contiguous", 4, 2),
    ("dilated", dict(DILATED, mode="head_groups", is_causal=True), "heads", 4,
     "contiguous", 4, 4),
]


# The single-device results by operation, options, heads and seed: the cases that
# share them (the block-sparse ring and allgather cases) compute them once.
_SINGLE = {}


@pytest.mark.parametrize("op,options,strategy,p,layout,h,hkv", CASES,
                         ids=[f"{c[0]}-{c[2]}-P{c[3]}-{c[4]}-H{c[5]}" for c in CASES])
def test_sharded_packed_equals_single_device(op, options, strategy, p, layout, h, hkv):
    q, k, v, g, mask = _inputs(h, hkv, seed=p + h)
    ids = _ids()
    key = (op, repr(sorted(options.items())), h, hkv, p + h)
    if op == "exact":
        want = _torch_exact(q, k, v, g, mask, ids, options["is_causal"])
    elif key in _SINGLE:
        want = _SINGLE[key]
    else:
        single = functools.partial(_FNS[op], **options)
        want = _SINGLE[key] = output_and_grads(
            lambda q, k, v: single(q, k, v, kv_mask=mask, segment_ids=ids), q, k, v, g)
    mesh = build_mesh((p,), ("seq",), "explicit" if p >= 4 else "auto")
    attn = jd.sharded(functools.partial(_FNS[op], **options), mesh, seq_axis="seq",
                      layout=layout, strategy=strategy)
    got = output_and_grads(lambda q, k, v: attn(q, k, v, kv_mask=mask, segment_ids=ids),
                           q, k, v, g)
    _check(got, want)


@pytest.mark.parametrize("cap", [None, 0.5])
def test_dilated_seq_axis_packed_equals_one_device(cap):
    """Inside shard_map (contiguous shards of 16 on 2 devices, a document across the
    boundary): output, lse and gradients equal the one-device call. 3 heads on 2
    devices take the gathered path (2 heads per device, head 2 computed twice).
    Segment lengths the unpacked sharded path would refuse (6 straddles shards of 16)
    are fine: packed segments follow the documents. A soft-cap (0.5, below most
    logits) reaches the devices' kernels."""
    q, k, v, g, mask = _inputs(3, 1, seed=3)
    ids = np.repeat(np.array([[1, 2, 3], [6, 6, 7]]), [5, 22, 5], axis=1).astype(np.int32)
    kw = dict(segment_lengths=(6, 16), dilation_rates=(2, 4), is_causal=True,
              max_documents=3, logit_soft_cap=cap)
    mesh = build_mesh((2,), ("seq",), "auto")
    spec = P(None, "seq")
    dist = jax.shard_map(
        lambda q, k, v, m, s: jd.dilated_attention(q, k, v, kv_mask=m, segment_ids=s,
                                                   seq_axis="seq", return_lse=True, **kw),
        mesh=mesh, in_specs=(spec,) * 5, out_specs=(spec, spec), check_vma=True)

    def with_lse(f):
        def loss(q, k, v):
            out, lse = f(q, k, v)
            return jnp.sum(out * g), (out, lse)

        (dq, dk, dv), (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2),
                                                    has_aux=True))(q, k, v)
        return [np.asarray(x) for x in (out, dq, dk, dv, lse)]

    got = with_lse(lambda q, k, v: dist(q, k, v, mask, ids))
    want = with_lse(lambda q, k, v: jd.dilated_attention(
        q, k, v, kv_mask=mask, segment_ids=ids, return_lse=True, **kw))
    _check(got[:4], want[:4])
    assert_close(got[4], want[4], TOL["float64"], "lse")


def test_auto_serves_packed_rows():
    """'auto' picks only strategies that serve segment ids: a packed dilated call whose
    segments would straddle shards unpacked still runs (every strategy serves it)."""
    fn = functools.partial(jd.dilated_attention, segment_lengths=(6,),
                           dilation_rates=(2,), is_causal=True)
    _, costs, _ = jd.explain_strategy(fn, (B, T, 4, D), num_devices=4, quiet=True)
    assert costs["ring"].reason is not None  # unpacked: 6 straddles shards of 8
    pick, costs, _ = jd.explain_strategy(fn, (B, T, 4, D), num_devices=4, quiet=True,
                                         segment_ids=True)
    assert all(c.reason is None for c in costs.values()), costs
    q, k, v, g, mask = _inputs(4, 2, seed=5)
    ids = _ids()
    attn = jd.sharded(fn, build_mesh((4,), ("seq",), "explicit"), seq_axis="seq",
                      strategy="auto")
    got = jax.jit(attn)(q, k, v, kv_mask=mask, segment_ids=ids)
    want = jax.jit(fn)(q, k, v, kv_mask=mask, segment_ids=ids)
    assert_close(got, want, TOL["float64"], f"auto ({pick})")


def test_bad_segment_ids_and_functions_without_them():
    q, k, v, _, mask = _inputs(4, 2)
    ids = _ids()
    mesh = build_mesh((2,), ("seq",), "auto")
    ring = jd.sharded(functools.partial(jd.ring_attention, is_causal=True), mesh,
                      seq_axis="seq")
    with pytest.raises(ValueError, match=r"segment_ids must have shape \[batch, seq\] = "
                                         r"\(2, 32\).*got \(2, 16\)"):
        ring(q, k, v, segment_ids=ids[:, :16])
    with pytest.raises(TypeError, match="segment_ids must be an integer array"):
        ring(q, k, v, segment_ids=ids.astype(np.float32))

    def plain(q, k, v, *, kv_mask=None, seq_axis=None):
        return q

    for strategy in ("ring", "heads"):
        attn = jd.sharded(plain, mesh, seq_axis="seq", strategy=strategy)
        with pytest.raises(ValueError, match=r"segment_ids needs a function that takes "
                                             r"segment_ids=, and plain does not"):
            attn(q, k, v, segment_ids=ids)
        assert attn(q, k, v).shape == q.shape  # without ids it still runs
    auto = jd.sharded(plain, mesh, seq_axis="seq", strategy="auto")
    with pytest.raises(ValueError, match="no strategy can serve this call"):
        auto(q, k, v, segment_ids=ids)
