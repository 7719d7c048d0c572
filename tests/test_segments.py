"""Packed sequences (``segment_ids``) in exact (ring) and block-sparse attention.

A query attends only to keys of its own document (equal id), AND causal, AND
``kv_mask``, AND (block-sparse) the active blocks. Every parity case compares the
output and the gradients of q, k, v (through a random cotangent) with the float64
PyTorch references (``torch_reference.dense_attention`` /
``block_sparse_attention``) given the document mask built here from the ids, at the
tolerances of ``_helpers.TOL`` (float64 1e-10, float32 1e-5, bfloat16 2e-2).

The ids (``make_ids``), T = 64, batch 2:
  row 0: sorted documents of lengths 1, 1, 21, 1, 17, 3, 12 (length-1 documents,
    documents longer than a block and across ring shards / zigzag chunks) and a
    padding document (id 99, 8 tokens) whose keys are masked out (kv_mask False):
    its queries have no key and output zeros;
  row 1: ids that are not sorted and reused (ids 3, 7 and 1 each name several
    documents: a document is a maximal run), random kv_mask, and a run of id 5 whose
    keys are all masked (zeros again).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _mesh import build_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_dilated as jd
from jax_dilated import block_patterns as bp
from jax_dilated.backends import KernelArgs, Masks, cudnn, registry, xla
from jax_dilated.backends.base import segments_meet
from jax_dilated.core.documents import document_ids

torch = pytest.importorskip("torch")  # the reference; without it the module skips

import torch_reference as ref  # noqa: E402
from _helpers import TOL, as_np, assert_close, rounded, to_jax, to_torch  # noqa: E402

B, T, H, HKV, D = 2, 64, 4, 2, 8


def make_ids(t: int = T, seed: int = 0):
    """(segment_ids int32 [2, t], kv_mask bool [2, t]); see the module docstring."""
    rng = np.random.default_rng(seed)
    lengths = [1, 1, 21, 1, 17, 3, 12]
    row0 = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)]
                          + [np.full(t - sum(lengths), 99)])
    mask0 = row0 != 99
    runs = [(3, 6), (7, 9), (3, 4), (1, 1), (5, 4), (7, 10), (1, 12), (3, 2), (2, 16)]
    row1 = np.concatenate([np.full(n, i) for i, n in runs])
    assert len(row0) == len(row1) == t
    mask1 = (rng.random(t) < 0.85) & (row1 != 5)
    return (np.stack([row0, row1]).astype(np.int32), np.stack([mask0, mask1]))


def doc_mask(ids):
    """bool [B, 1, T, T]: same document (a maximal run of equal ids: the runs are
    numbered first, so an id reused after another names a new document)."""
    ids = np.asarray(ids)
    runs = np.cumsum(np.concatenate([np.ones_like(ids[:, :1]), ids[:, 1:] != ids[:, :-1]],
                                    axis=1), axis=1)
    return (runs[:, :, None] == runs[:, None, :])[:, None]


def make_inputs(seed: int, t: int = T):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, t, H, D))
    k = rng.standard_normal((B, t, HKV, D))
    v = rng.standard_normal((B, t, HKV, D))
    g = rng.standard_normal((B, t, H, D))
    return q, k, v, g


def reference(q, k, v, g, ids, mask, *, causal, block_mask=None, block_size=None):
    """float64 output and d/d(q, k, v) of sum(g * out), PyTorch."""
    tq, tk, tv = (to_torch(x, requires_grad=True) for x in (q, k, v))
    allowed = torch.as_tensor(doc_mask(ids))
    kv_mask = torch.as_tensor(mask)
    if block_mask is None:
        out = ref.dense_attention(tq, tk, tv, is_causal=causal, kv_mask=kv_mask,
                                  allowed=allowed)
    else:
        out = ref.block_sparse_attention(tq, tk, tv, block_mask, block_size,
                                         is_causal=causal, kv_mask=kv_mask, allowed=allowed)
    (to_torch(g) * out).sum().backward()
    return as_np(out), tuple(as_np(x.grad) for x in (tq, tk, tv))


def check(name, dtype, got_out, got_grads, want_out, want_grads):
    tol = TOL[dtype]
    assert_close(got_out, want_out, tol, f"{name} out")
    for n, got, want in zip("qkv", got_grads, want_grads):
        assert_close(got, want, tol, f"{name} d{n}")


def check_no_key_rows(ids, mask, out, grads):
    """Queries whose document has no unmasked key: exactly 0, gradients finite."""
    ids, mask = np.asarray(ids), np.asarray(mask)
    has_key = (doc_mask(ids)[:, 0] & mask[:, None, :]).any(-1)  # non-causal: [B, T]
    assert (~has_key).sum() >= 8 + 4, "the ids must hold rows without keys"
    out = np.asarray(jnp.asarray(out, jnp.float32))
    assert np.all(out[~has_key] == 0.0)
    for gr in grads:
        assert np.all(np.isfinite(np.asarray(jnp.asarray(gr, jnp.float32))))


def grad_step(fn):
    """jit(grad) of sum(g * fn(q, k, v, mask, ids)): (out, (dq, dk, dv))."""
    def loss(q, k, v, g, mask, ids):
        out = fn(q, k, v, mask, ids)
        return jnp.sum(g * out), out

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))

    def run(q, k, v, g, mask, ids):
        grads, out = step(q, k, v, g, jnp.asarray(mask), jnp.asarray(ids))
        return out, grads

    return run


def ring(p: int, layout: str, causal: bool, *, sparse=None):
    """``jd.ring_attention`` (or ``block_sparse_attention`` with ``sparse=(block_size,
    pattern)``) inside ``shard_map`` on ``p`` devices, on global arrays in token order
    (permuted into ``layout`` and back here, ids and mask like the queries)."""
    mesh = build_mesh((p,), ("seq",), "explicit")
    spec = P(None, "seq")

    def local(q, k, v, mask, ids):
        if sparse is None:
            return jd.ring_attention(q, k, v, seq_axis="seq", is_causal=causal,
                                     layout=layout, kv_mask=mask, segment_ids=ids)
        return jd.block_sparse_attention(q, k, v, block_size=sparse[0], pattern=sparse[1],
                                         is_causal=causal, kv_mask=mask, segment_ids=ids,
                                         seq_axis="seq", layout=layout)

    sm = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec,
                       check_vma=True)

    def place(x):
        return jax.sharding.reshard(jd.to_layout(x, p, layout), NamedSharding(mesh, spec))

    def fn(q, k, v, mask, ids):
        out = sm(*(place(x) for x in (q, k, v, mask, ids)))
        out = jax.sharding.reshard(out, NamedSharding(mesh, P()))  # then permute back
        return jd.from_layout(out, p, layout)

    return fn


# ----------------------------------------------------------------- exact attention

RING_CASES = [
    # (P, layout, causal, dtype)
    (1, "contiguous", True, "float64"),
    (2, "contiguous", False, "float64"),
    (2, "zigzag", True, "float64"),
    (4, "zigzag", True, "float64"),
    (4, "striped", False, "float64"),
    (4, "contiguous", True, "float32"),
    (2, "zigzag", True, "bfloat16"),
]


@pytest.mark.parametrize("p,layout,causal,dtype", RING_CASES,
                         ids=["-".join(map(str, c)) for c in RING_CASES])
def test_ring_parity(p, layout, causal, dtype):
    q, k, v, g = make_inputs(seed=10 * p + len(layout))
    ids, mask = make_ids()
    out, grads = grad_step(ring(p, layout, causal))(
        *(to_jax(x, dtype) for x in (q, k, v, g)), mask, ids)
    if not causal:
        check_no_key_rows(ids, mask, out, grads)
    want_out, want_grads = reference(*(rounded(x, dtype) for x in (q, k, v, g)), ids, mask,
                                     causal=causal)
    check(f"ring P={p} {layout}", dtype, out, grads, want_out, want_grads)


def test_kernel_small_blocks():
    """The XLA kernel itself (``attention``) with blocks of 16: blocks without a
    same-document pair are skipped, the rest masked; float64 parity. A kernel compares
    ids for equality: it gets the document indices the entry points make."""
    q, k, v, g = make_inputs(seed=3)
    ids, mask = make_ids()
    ids = np.asarray(document_ids(ids))
    args = KernelArgs(scale=1.0 / np.sqrt(D), is_causal=True, block_q=16, block_k=16)

    def fn(q, k, v, mask, ids):
        return xla.KERNEL.attention(q, k, v, args,
                                    Masks(kv_valid=mask, q_segment_ids=ids,
                                          k_segment_ids=ids))[0]

    out, grads = grad_step(fn)(*(jnp.asarray(x) for x in (q, k, v, g)), mask, ids)
    check("kernel", "float64", out, grads, *reference(q, k, v, g, ids, mask, causal=True))


def test_packing_invariance():
    """A packed row equals each of its documents run alone (ring on 2 devices against
    the kernel on every document by itself)."""
    q, k, v, _ = make_inputs(seed=4)
    ids = np.repeat(np.arange(4, dtype=np.int32), [5, 27, 1, 31])[None].repeat(B, 0)
    mask = np.ones((B, T), bool)
    out = ring(2, "zigzag", True)(*(jnp.asarray(x) for x in (q, k, v, mask, ids)))
    args = KernelArgs(scale=1.0 / np.sqrt(D), is_causal=True)
    alone_fn = jax.jit(lambda q, k, v: xla.KERNEL.forward(q, k, v, args)[0])
    for doc in range(4):
        sel = np.flatnonzero(ids[0] == doc)
        alone = alone_fn(q[:, sel], k[:, sel], v[:, sel])
        assert_close(np.asarray(out)[:, sel], alone, 1e-12, f"document {doc}")


def test_ring_generic_steps(monkeypatch):
    """The generic ring steps (the kernel's plain forward/backward per step, as for
    cuDNN or lengths that are not whole blocks) with segment ids."""
    monkeypatch.setattr(xla.ring, "ring_steps", lambda q, k, args: None)
    test_ring_parity(2, "zigzag", True, "float64")
    test_ring_skips_steps_without_shared_documents()


def test_ring_skips_steps_without_shared_documents():
    """Device 1's keys and values are NaN and share no document with device 0's
    queries: if any step or block touched them on device 0 (forward) or on device 1
    for device 0's keys (backward), NaN would reach device 0's rows (0 * NaN). They
    stay finite and exact, so that work was skipped at run time."""
    q, k, v, g = make_inputs(seed=5)
    ids = np.repeat(np.arange(4, dtype=np.int32), [10, 22, 20, 12])[None].repeat(B, 0)
    mask = np.ones((B, T), bool)
    kn, vn = k.copy(), v.copy()
    kn[:, 32:], vn[:, 32:] = np.nan, np.nan
    out, (dq, dk, dv) = grad_step(ring(2, "contiguous", False))(
        *(jnp.asarray(x) for x in (q, kn, vn, g)), mask, ids)
    want_out, want_grads = reference(q, k, v, g, ids, mask, causal=False)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv),
                               (want_out, *want_grads)):
        assert_close(np.asarray(got)[:, :32], want[:, :32], TOL["float64"], name)


# ------------------------------------------------------------------- block-sparse

PATTERN = bp.LocalWindow(1) | bp.GlobalBlocks([0])


@pytest.mark.parametrize("p,layout,block", [(None, "contiguous", 16), (2, "zigzag", 8),
                                            (4, "contiguous", 8)])
def test_block_sparse_parity(p, layout, block):
    q, k, v, g = make_inputs(seed=7 + block)
    ids, mask = make_ids()
    causal = p != 4
    if p is None:
        fn = functools.partial(_block_sparse_local, block, causal)
    else:
        fn = ring(p, layout, causal, sparse=(block, PATTERN))
    out, grads = grad_step(fn)(*(jnp.asarray(x) for x in (q, k, v, g)), mask, ids)
    nb = T // block
    want = reference(q, k, v, g, ids, mask, causal=causal, block_mask=PATTERN.to_mask(nb),
                     block_size=block)
    check(f"block-sparse {p} {layout}", "float64", out, grads, *want)


def _block_sparse_local(block, causal, q, k, v, mask, ids):
    return jd.block_sparse_attention(q, k, v, block_size=block, pattern=PATTERN,
                                     is_causal=causal, kv_mask=mask, segment_ids=ids)


# ------------------------------------------------------------------ backends, errors


@pytest.mark.parametrize("length", [16, 300])  # every pair compared / key ids sorted
def test_segments_meet(length):
    """Whether two blocks of (unsorted) ids share one in some batch item: both code
    paths of ``segments_meet``, exact."""
    rng = np.random.default_rng(length)

    def ids(lo):  # [2, length] random, batch item b drawn from [lo + 2000 b, + 1000)
        return (rng.integers(0, 1000, (2, length)) + lo + np.array([[0], [2000]])).astype(
            np.int32)

    def meet(a, b):
        return bool(segments_meet(jnp.asarray(a), jnp.asarray(b)))

    for _ in range(3):
        qs, ks = ids(0), ids(1000)
        assert not meet(qs, ks)
        cross = ks.copy()
        cross[1, rng.integers(length)] = qs[0, rng.integers(length)]
        assert not meet(qs, cross)  # equal ids in different batch items do not meet
        same = ks.copy()
        same[1, rng.integers(length)] = qs[1, rng.integers(length)]
        assert meet(qs, same)


def test_cudnn_refuses_segment_ids_and_auto_picks_xla():
    x = jnp.zeros((1, 16, 2, 64), jnp.bfloat16)
    ids = jnp.zeros((1, 16), jnp.int32)
    args = KernelArgs(scale=0.125)
    kernel = cudnn.CudnnKernel()
    masks = Masks(q_segment_ids=ids, k_segment_ids=ids)
    reason = kernel.call_reason(x, x, args, masks)
    assert reason and "segment ids" in reason
    with pytest.raises(ValueError, match="segment ids"):
        kernel.forward(x, x, x, args, masks)
    auto = registry.AutoKernel(kernel)
    chosen, why = auto.choose(x, x, args, masks)
    assert chosen is xla.KERNEL and "segment ids" in why


def test_bad_segment_ids():
    x = jnp.zeros((2, 16, 2, 8))
    ok = jnp.zeros((2, 16), jnp.int32)
    sparse = functools.partial(jd.block_sparse_attention, block_size=8,
                               pattern=bp.AllBlocks())
    with pytest.raises(TypeError, match=r"segment_ids.*float32"):
        sparse(x, x, x, segment_ids=ok.astype(jnp.float32))
    with pytest.raises(TypeError, match="segment_ids"):
        sparse(x, x, x, segment_ids=ok.astype(bool))
    with pytest.raises(ValueError, match=r"segment_ids.*\(2, 16\).*\(2, 15\)"):
        sparse(x, x, x, segment_ids=ok[:, :15])
    with pytest.raises(ValueError, match=r"segment_ids.*same length.*\(2, 24, 2, 8\)"):
        y = jnp.zeros((2, 24, 2, 8))
        sparse(x, y, y, segment_ids=ok)
    mesh = build_mesh((2,), ("seq",), "explicit")
    spec = P(None, "seq")
    bad = jax.shard_map(
        lambda x, ids: jd.ring_attention(x, x, x, seq_axis="seq", segment_ids=ids[:1]),
        mesh=mesh, in_specs=(spec, spec), out_specs=spec)
    with pytest.raises(ValueError, match=r"segment_ids.*\(2, 8\).*\(1, 8\)"):
        jax.jit(bad)(jax.sharding.reshard(x, NamedSharding(mesh, spec)),
                     jax.sharding.reshard(ok, NamedSharding(mesh, spec)))
