"""One meaning of ``segment_ids`` everywhere: a document is a maximal run of equal ids.

docs/semantics.md, section 1 ("Packed sequences"). The rows below reuse ids: id 0
names two documents with another between them, so an operation that let equal ids
attend to each other wherever they are (the old rule of exact and block-sparse
attention and of sliding-window branches) fails here. Every path, on one device, over
``jd.sharded`` (each strategy and layout) and inside ``jax.shard_map`` on local shards
(documents crossing shard boundaries), must give what its documents give run alone:
output and the gradients of q, k, v through a random cotangent, float64, at 1e-10.
The documents alone run through the same operation on one device without
``segment_ids``; that call is parity-tested against the PyTorch references elsewhere.
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
from jax_dilated.core import documents, layouts

from _helpers import TOL, assert_close, output_and_grads

B, T, D = 2, 48, 4
# row 0: as in the issue, id 0 reused after id 1; row 1: ids 3 and 5 both reused. The
# second run of id 0 crosses the shard boundaries at 24 (2 and 4 devices) and 36, the
# second of id 3 (2 tokens) the one at 24, those of id 5 the ones at 12 and 36. Each row
# holds five documents of two lengths, so that the documents alone run as two batches,
# one per length (see _alone), not one call per document: 2 (shorter than a block, the
# window of 5 and every segment; in DILATED's rate 4 a head of offset 2 or 3 selects
# nothing) and 21 (longer than the sliding window, last segments of 5 and 9 tokens).
ROWS = ([0] * 21 + [1] * 2 + [0] * 21 + [2] * 2 + [7] * 2,
        [3] * 2 + [5] * 21 + [3] * 2 + [5] * 21 + [4] * 2)
IDS = np.array(ROWS, np.int32)


def _runs(row):
    """[(start, end)] of the maximal runs of equal ids of one row (plain loop)."""
    out, start = [], 0
    for i in range(1, len(row) + 1):
        if i == len(row) or row[i] != row[start]:
            out.append((start, i))
            start = i
    return out


def _inputs(h, hkv, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, h, D))
    k, v = (rng.standard_normal((B, T, hkv, D)) for _ in range(2))
    g = rng.standard_normal((B, T, h, D))
    mask = rng.random((B, T)) < 0.9
    return q, k, v, g, mask


def _alone(fn, *rows):
    """``fn(*documents)`` on every document of every row on its own (``rows``: arrays
    [B, T, ...] cut into documents), put back in place. The documents of one length
    run as one batch (rows of a batch never see each other): ``fn`` is traced once per
    length, not once per document."""
    docs = [(b, s, e) for b, row in enumerate(ROWS) for s, e in _runs(row)]
    done = {}
    for n in sorted({e - s for _, s, e in docs}):
        same = [(b, s, e) for b, s, e in docs if e - s == n]
        out = fn(*(jnp.concatenate([x[b:b + 1, s:e] for b, s, e in same]) for x in rows))
        done.update({doc: out[i:i + 1] for i, doc in enumerate(same)})
    return jnp.concatenate([jnp.concatenate([done[b, s, e] for s, e in _runs(row)], axis=1)
                            for b, row in enumerate(ROWS)])


# The documents alone, by operation and options: cases that share them (every case
# draws the same inputs) compute them once.
_ALONE = {}


def _key(op, kw):
    """What the documents alone depend on: the operation and its options (a bound on
    the documents belongs to the packed call only)."""
    return op.__name__, tuple(sorted((a, repr(b)) for a, b in kw.items()
                                     if a != "max_documents"))


def _check(fn, packed, key):
    """``packed`` (with the ids) against ``fn`` on each document alone, the latter
    computed once per ``key`` (:func:`_key`)."""
    q, k, v, g, mask = _inputs(4, 2, seed=0)
    if key not in _ALONE:
        _ALONE[key] = output_and_grads(
            lambda q, k, v: _alone(lambda q, k, v, m: fn(q, k, v, kv_mask=m), q, k, v, mask),
            q, k, v, g)
    want = _ALONE[key]
    got = output_and_grads(lambda q, k, v: packed(q, k, v, kv_mask=mask, segment_ids=IDS),
                           q, k, v, g)
    for what, a, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(a, w, TOL["float64"], what)


def test_document_ids_count_maximal_runs():
    want = np.array([[i for i, (s, e) in enumerate(_runs(row)) for _ in range(s, e)]
                     for row in ROWS])
    np.testing.assert_array_equal(documents.document_ids(IDS), want)
    starts = np.array([[s for s, e in _runs(row) for _ in range(s, e)] for row in ROWS])
    np.testing.assert_array_equal(documents.document_starts(jnp.asarray(IDS)), starts)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
def test_document_ids_inside_shard_map_see_the_whole_row(layout):
    """Local shards (4 devices, a run of id 0 crossing boundaries, ids equal across a
    boundary in another run) number the runs of the global row."""
    mesh = build_mesh((4,), ("seq",), "auto")
    f = jax.shard_map(functools.partial(documents.document_ids, axis_name="seq",
                                        num_devices=4, layout=layout),
                      mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"))
    got = layouts.from_layout(jax.jit(f)(layouts.to_layout(jnp.asarray(IDS), 4, layout)),
                              4, layout)
    np.testing.assert_array_equal(got, documents.document_ids(IDS))


# Segments of 8 and 12: 8 does not divide 12, so the packed calls take the streams
# (ops/dilated_packed.py) directly. With segments that divide (8 and 16) they also
# traced the padded layout, under a lax.cond on the documents per row that these rows
# (5 documents, more than its 48 / 16 = 3 slots) never take; that doubled the cost of
# every packed program here (a switch over four of them on 4 devices: 8 s).
# test_dilated_packed.py runs the padded layout against the documents alone.
WINDOWED = dict(segment_lengths=(jd.SlidingWindow(16), 8, 12), dilation_rates=(1, 1, 2))
DILATED = dict(segment_lengths=(8, 12), dilation_rates=(2, 4))
DENSE = dict(block_size=4, pattern=jd.block_patterns.AllBlocks())
ONE_DEVICE = [
    ("windowed-longnet", jd.dilated_attention, dict(WINDOWED, is_causal=False)),
    ("windowed-longnet-causal", jd.dilated_attention, dict(WINDOWED, is_causal=True)),
    ("windowed-head_groups", jd.dilated_attention,
     dict(WINDOWED, mode="head_groups", is_causal=True)),
    ("dilated-bounded", jd.dilated_attention, dict(DILATED, is_causal=True, max_documents=5)),
    ("exact", jd.ring_attention, dict(is_causal=False)),
    ("exact-causal-window", jd.ring_attention, dict(is_causal=True, window=(5, 0))),
    ("block_sparse", jd.block_sparse_attention, dict(DENSE, is_causal=True)),
]


@pytest.mark.parametrize("name,op,kw", ONE_DEVICE, ids=[c[0] for c in ONE_DEVICE])
def test_one_device_packed_rows_equal_documents_alone(name, op, kw):
    fn = functools.partial(op, **kw)
    if op is jd.ring_attention:  # one device: the operation's own call, no ring
        fn = functools.partial(jd.sharded(fn, build_mesh((1,), ("seq",), "auto"),
                                          seq_axis="seq"))
    if "max_documents" in kw:  # a bound of the packed call only
        alone = functools.partial(op, **{a: b for a, b in kw.items() if a != "max_documents"})
    else:
        alone = fn
    _check(alone, fn, _key(op, kw))


SHARDED = [
    # (op, options, strategy, P, layout)
    ("exact", dict(is_causal=True), "ring", 4, "zigzag"),
    ("exact", dict(is_causal=False), "ring", 4, "striped"),
    ("exact", dict(is_causal=True), "allgather", 2, "contiguous"),
    ("exact", dict(is_causal=True), "heads", 2, "contiguous"),
    ("block_sparse", dict(DENSE, is_causal=True), "ring", 4, "contiguous"),
    ("block_sparse", dict(DENSE, is_causal=False), "allgather", 2, "zigzag"),
    # Packed dilated attention runs one program under every strategy (the single-device
    # packed call on the whole sequence of some heads): these three and
    # test_sharded_segments' allgather (blocked offsets) and heads (head_groups) cases
    # run it with each option and strategy.
    ("dilated", dict(WINDOWED, is_causal=True), "ring", 2, "contiguous"),
    ("dilated", dict(DILATED, is_causal=True), "auto", 4, "contiguous"),
    ("dilated", dict(DILATED, is_causal=True), ("ring", "heads"), 2, "contiguous"),
]
_FNS = {"exact": jd.ring_attention, "dilated": jd.dilated_attention,
        "block_sparse": jd.block_sparse_attention}


@pytest.mark.parametrize("op,kw,strategy,p,layout", SHARDED,
                         ids=[f"{c[0]}-{'+'.join(np.atleast_1d(c[2]))}-P{c[3]}-{c[4]}"
                              for c in SHARDED])
def test_sharded_packed_rows_equal_documents_alone(op, kw, strategy, p, layout):
    fn = functools.partial(_FNS[op], **kw)
    mesh = build_mesh((p,), ("seq",), "explicit" if p >= 4 else "auto")
    alone = (jd.sharded(fn, build_mesh((1,), ("seq",), "auto"), seq_axis="seq")
             if op == "exact" else fn)  # ring_attention runs inside shard_map only
    _check(alone, jd.sharded(fn, mesh, seq_axis="seq", layout=layout, strategy=strategy),
           _key(_FNS[op], kw))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
def test_ring_on_local_shards_sees_documents_across_boundaries(layout):
    """The user's own ``shard_map``: the local shards' ids in ``layout`` order."""
    mesh = build_mesh((4,), ("seq",), "auto")
    spec = P(None, "seq")
    ring = jax.shard_map(
        lambda q, k, v, m, s: jd.ring_attention(q, k, v, kv_mask=m, segment_ids=s,
                                                seq_axis="seq", layout=layout, is_causal=True),
        mesh=mesh, in_specs=(spec,) * 5, out_specs=spec)
    lay = functools.partial(layouts.to_layout, num_devices=4, layout=layout)

    def packed(q, k, v, kv_mask, segment_ids):
        out = ring(lay(q), lay(k), lay(v), lay(kv_mask), lay(jnp.asarray(segment_ids)))
        return layouts.from_layout(out, 4, layout)

    alone = jd.sharded(functools.partial(jd.ring_attention, is_causal=True),
                       build_mesh((1,), ("seq",), "auto"), seq_axis="seq")
    _check(alone, packed, _key(jd.ring_attention, dict(is_causal=True)))


def test_dilated_on_local_shards_sees_documents_across_boundaries():
    mesh = build_mesh((2,), ("seq",), "auto")
    spec = P(None, "seq")
    kw = dict(WINDOWED, is_causal=True)
    local = jax.shard_map(
        lambda q, k, v, kv_mask, segment_ids: jd.dilated_attention(
            q, k, v, kv_mask=kv_mask, segment_ids=segment_ids, seq_axis="seq", **kw),
        mesh=mesh, in_specs=(spec,) * 5, out_specs=spec)
    _check(functools.partial(jd.dilated_attention, **kw),
           lambda q, k, v, kv_mask, segment_ids: local(q, k, v, kv_mask, segment_ids),
           _key(jd.dilated_attention, kw))


def test_layer_packed_rows_equal_documents_alone():
    """An NNX multi-head layer with rotary positions: positions and attention both
    restart at each run."""
    from flax import nnx

    layer = jd.nnx.MultiheadDilatedAttention(
        8, 4, segment_lengths=(8, 12), dilation_rates=(1, 2), qk_transform=jd.models.Rotary(),
        param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    x = np.random.default_rng(9).standard_normal((B, T, 8))
    # one program for both (jitted: op by op, the documents alone took 30 s)
    got, want = nnx.jit(lambda m, x: (m(x, segment_ids=IDS, is_causal=True),
                                      _alone(lambda x: m(x, is_causal=True), x)))(layer, x)
    assert_close(got, want, TOL["float64"], "layer")
