"""Dilated attention over packed rows: ``jd.dilated_attention(..., segment_ids=)``.

The semantics (docs/semantics.md, section 2, "Packed sequences"): the segment grid and
the offsets restart at each document, so a packed row gives exactly what running every
document alone gives. The reference states that directly: the PyTorch reference of
``tests/torch_reference/dilated.py`` (float64, written from the selection rule) runs on
each document by itself, and the outputs are concatenated; the gradients are those of
``sum(g * out)`` for a random cotangent ``g``. Tolerances as in test_parity.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dilated as jd

torch = pytest.importorskip("torch")  # the reference; without it the module skips

import torch_reference as ref  # noqa: E402
from _helpers import (TOL, assert_close, output_and_grads, rounded, to_jax,  # noqa: E402
                      to_torch)

SEGS, RATES = (8, 16, 32), (1, 2, 4)


def _rows(lengths_per_row, seed, h=4, hkv=2, d=8):
    """Random q, k, v, cotangent and ids of rows packed from documents of the given
    lengths (ids drawn at random, so not sorted; two neighbours never share one)."""
    rng = np.random.default_rng(seed)
    t = sum(lengths_per_row[0])
    ids = []
    for lengths in lengths_per_row:
        assert sum(lengths) == t
        labels = rng.permutation(50)[:len(lengths)] + 3
        ids.append(np.concatenate([np.full(n, lab) for n, lab in zip(lengths, labels)]))
    b = len(lengths_per_row)
    q = rng.standard_normal((b, t, h, d))
    k, v = (rng.standard_normal((b, t, hkv, d)) for _ in range(2))
    g = rng.standard_normal((b, t, h, d))
    return q, k, v, g, np.stack(ids).astype(np.int32)


def _reference(q, k, v, g, lengths_per_row, kv_mask, segs=SEGS, **kw):
    """Output and q/k/v gradients from the PyTorch reference run on every document
    alone."""
    mode = kw.pop("mode")
    fn = (ref.longnet_dilated_attention if mode == "longnet"
          else ref.head_groups_dilated_attention)
    qt, kt, vt = (to_torch(x, requires_grad=True) for x in (q, k, v))
    rows = []
    for i, lengths in enumerate(lengths_per_row):
        parts, s = [], 0
        for n in lengths:
            sl = slice(s, s + n)
            mask = None if kv_mask is None else torch.tensor(kv_mask[i:i + 1, sl])
            parts.append(fn(qt[i:i + 1, sl], kt[i:i + 1, sl], vt[i:i + 1, sl],
                            segment_lengths=segs, dilation_rates=RATES, kv_mask=mask, **kw))
            s += n
        rows.append(torch.cat(parts, dim=1))
    out = torch.cat(rows, dim=0)
    grads = torch.autograd.grad(out, (qt, kt, vt), grad_outputs=to_torch(g))
    return (out, *grads)


def _jax(q, k, v, g, ids, kv_mask, dtype, segs=SEGS, **kw):
    """Output and q/k/v gradients of the packed call, one program (``g`` is already
    rounded to ``dtype``: the cotangent the call sees is ``g`` itself)."""
    def f(q, k, v):
        return jd.dilated_attention(q, k, v, segment_lengths=segs, dilation_rates=RATES,
                                    segment_ids=jnp.asarray(ids),
                                    kv_mask=None if kv_mask is None else jnp.asarray(kv_mask),
                                    **kw)

    return output_and_grads(f, *(to_jax(x, dtype) for x in (q, k, v)), g)


CASES = {
    # one row: a 1-token document, documents shorter than a block, one longer than the
    # largest segment (70 > 32), with ids in no order
    "longnet": (dict(mode="longnet"), [[5, 40, 1, 70, 12]], False),
    # the padded layout (4 * 32 <= 128: documents moved to multiples of 32), taken by
    # the lax.cond on the count (no bound): the program max_documents=4 gives statically
    # (padded_layout(ids, 32, 4); the low-precision slots cases and head_groups below)
    "longnet_causal_mask": (dict(mode="longnet", is_causal=True), [[33, 1, 60, 34]], True),
    "head_groups_causal": (dict(mode="head_groups", is_causal=True),
                           [[5, 40, 1, 70, 12], [128]], False),
    "longnet_bounded": (dict(mode="longnet", max_documents=5),
                        [[5, 40, 1, 70, 12], [64, 64]], False),
    # max_documents=4: the padded layout, taken statically, with causality, GQA's head
    # groups and padding
    "head_groups_bounded_causal_mask": (
        dict(mode="head_groups", is_causal=True, max_documents=4), [[33, 1, 60, 34]], True),
    "head_groups_padded_two_rows": (
        dict(mode="head_groups", max_documents=4), [[33, 1, 60, 34], [64, 64]], False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_packed_rows_equal_documents_alone(name):
    kw, lengths, with_mask = CASES[name]
    q, k, v, g, ids = _rows(lengths, seed=len(name))
    kv_mask = None
    if with_mask:  # random padding, and a document whose keys are all masked
        kv_mask = np.random.default_rng(1).random(ids.shape) < 0.8
        kv_mask[:, 33] = False  # the 1-token document: its query sees nothing -> zeros
    ref_kw = {k_: v_ for k_, v_ in kw.items() if k_ != "max_documents"}
    want = _reference(q, k, v, g, lengths, kv_mask, **ref_kw)
    got = _jax(q, k, v, g, ids, kv_mask, "float64", **kw)
    for a, b_, what in zip(got, want, ("out", "dq", "dk", "dv")):
        assert_close(a, b_, TOL["float64"], what)
    if with_mask:
        assert np.all(np.asarray(got[0])[:, 33] == 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lengths,bound", [([[5, 40, 1, 70, 12]], None),  # streams
                                           ([[33, 1, 60, 34]], 4)])       # slots
def test_packed_rows_low_precision(dtype, lengths, bound):
    # The streams with segments of 8, 24 and 32 (24 does not divide 32: no slots), so
    # that the call takes them directly; with SEGS it traced both layouts under the
    # lax.cond on the count (CASES test that choice) and ran the streams.
    segs = SEGS if bound else (8, 24, 32)
    q, k, v, g, ids = _rows(lengths, seed=7)
    q, k, v, g = (rounded(x, dtype) for x in (q, k, v, g))
    want = _reference(q, k, v, g, lengths, None, segs, mode="longnet", is_causal=True)
    got = _jax(q, k, v, g, ids, None, dtype, segs, mode="longnet", is_causal=True,
               max_documents=bound)
    for a, b_, what in zip(got, want, ("out", "dq", "dk", "dv")):
        assert_close(a, b_, TOL[dtype], what)


def test_padded_layout_moves_documents_to_multiples_of_the_unit():
    """When the slots serve, and the padded layout itself: every token in one slot, in
    order, every document starting at a multiple of the unit."""
    from jax_dilated.core import branch_plans
    from jax_dilated.ops import dilated_packed as dp

    def plans(segs, t):
        return branch_plans.plan_branches(tuple(zip(segs, RATES)), seq_len=t, num_heads=4,
                                          num_kv_heads=2, mode="longnet",
                                          offsets_rule="modulo")

    # the slots serve rows of up to 128 / 32 = 4 documents: CASES take them statically
    # (max_documents <= 4), by a lax.cond on the count (no bound, or a bound of 5),
    # and fall back to the streams for rows of 5 documents
    assert dp.slots_capacity(plans(SEGS, 128), 128) == (32, 4)
    assert dp.slots_capacity(plans((8, 24, 32), 128), 128) is None  # 24 does not divide 32
    assert dp.slots_capacity(plans((8, 16, 128), 128), 128) is None  # room for one document
    lengths = [[5, 40, 1, 70, 12], [128]]
    _, _, _, _, ids = _rows(lengths, seed=5)
    source = np.asarray(dp.padded_layout(jnp.asarray(ids), 32, 5))
    assert source.shape == (2, dp.group_count(128, 32, 5) * 32)
    for row, doc_lengths in enumerate(lengths):
        filled = np.flatnonzero(source[row] < 128)
        np.testing.assert_array_equal(source[row][filled], np.arange(128))  # all, in order
        firsts = np.cumsum([0] + doc_lengths[:-1])
        assert np.all(filled[firsts] % 32 == 0)  # each document starts on the unit
        assert np.all(np.diff(filled)[np.setdiff1d(np.arange(127), firsts - 1)] == 1)


def test_one_document_is_the_unpacked_call():
    q, k, v, g, ids = _rows([[128]], seed=3)
    kw = dict(segment_lengths=SEGS, dilation_rates=RATES, is_causal=True)
    attn = jax.jit(lambda q, k, v, ids=None: jd.dilated_attention(q, k, v, segment_ids=ids,
                                                                  **kw))
    np.testing.assert_allclose(attn(q, k, v, jnp.asarray(ids)), attn(q, k, v), atol=1e-12)


def test_packed_bad_input():
    q, k, v, _, ids = _rows([[64, 64]], seed=4)
    kw = dict(segment_lengths=SEGS, dilation_rates=RATES)
    with pytest.raises(TypeError, match="segment_ids must be an integer array"):
        jd.dilated_attention(q, k, v, segment_ids=ids.astype(np.float32), **kw)
    with pytest.raises(ValueError, match=r"segment_ids must have shape \[batch, seq\]"):
        jd.dilated_attention(q, k, v, segment_ids=ids[:, :100], **kw)
    with pytest.raises(ValueError, match="max_documents must be None or a positive int"):
        jd.dilated_attention(q, k, v, segment_ids=ids, max_documents=0, **kw)
    with pytest.raises(ValueError, match=r"a row of 2 documents .* max_documents=1"):
        jd.dilated_attention(q, k, v, segment_ids=ids, max_documents=1, **kw)
    # traced ids with more documents than the bound: NaN, never a wrong number
    out = jax.jit(lambda i: jd.dilated_attention(q, k, v, segment_ids=i, max_documents=1,
                                                 **kw))(jnp.asarray(ids))
    assert bool(jnp.isnan(out).all())
    # seq_axis with segment_ids runs (tests/test_sharded_segments.py checks it on 2-8
    # devices); a bad bound is still refused there
    with pytest.raises(ValueError, match="max_documents must be None or a positive int"):
        jax.shard_map(lambda q, k, v, i: jd.dilated_attention(q, k, v, segment_ids=i,
                                                              seq_axis="s", max_documents=0,
                                                              **kw),
                      mesh=jax.make_mesh((1,), ("s",)), in_specs=jax.sharding.PartitionSpec(),
                      out_specs=jax.sharding.PartitionSpec(),
                      check_vma=False)(q, k, v, jnp.asarray(ids))


@pytest.mark.parametrize("bound", [None, 4], ids=["compact", "aligned"])
def test_streams_gather_rows_without_batching_dimensions(bound):
    """The streams of packed rows gather per row through flat indices
    (``core.arrays.take_rows``): the program of two rows, forward and backward, has no
    gather or scatter with batching dimensions, which ``jnp.take_along_axis`` lowers
    to. On an H200 (JAX 0.11.2) every packed-rows test whose streams held two rows was
    wrong while those of one row were right, and those dimensions over the rows were
    the difference between their programs; ``take_rows`` equals ``take_along_axis``."""
    import re

    from jax_dilated.core.arrays import take_rows

    q, k, v, g, ids = _rows([[5, 10, 1, 16], [32]], seed=2)
    kw = dict(segment_lengths=(jd.SlidingWindow(4), 8, 16), dilation_rates=(1, 1, 2),
              is_causal=True, max_documents=bound)

    def loss(q, k, v):
        return jnp.sum(jd.dilated_attention(q, k, v, segment_ids=jnp.asarray(ids), **kw) * g)

    text = jax.jit(jax.value_and_grad(loss, (0, 1, 2))).lower(q, k, v).as_text()
    assert "stablehlo.gather" in text
    batched = re.findall(r"(?:operand|input|start_indices|scatter_indices)_batching_dims"
                         r" = \[\d", text)
    assert not batched, batched
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 9, 3, 2))
    for idx in (rng.integers(0, 9, (2, 5, 3)), rng.integers(0, 9, (2, 5, 1)),
                rng.integers(0, 9, (2, 4))):
        full = idx.reshape(*idx.shape, *(1,) * (x.ndim - idx.ndim))
        np.testing.assert_array_equal(take_rows(jnp.asarray(x), jnp.asarray(idx)),
                                      np.take_along_axis(x, full, axis=1))
