"""The blockwise XLA kernel (``jax_dilated.backends.xla``) against dense PyTorch attention.

Checked: forward output and log-sum-exp, gradients through both outputs (random
cotangents on ``o`` *and* ``lse``), grouped-query heads, causality by arbitrary
position arrays (as a ring shard would pass), ``kv_valid`` of shape [N, Lk] and
[N, Lk, Hkv], ``Lq != Lk``, lengths that are not multiples of the block,
rows without any allowed key (``o = 0``, ``lse = -inf``, finite gradients), and
``backward`` driven by externally given (global) ``lse`` / ``delta``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch_reference as ref
from _helpers import (
    TOL, XLA_CPU_MEMORY, as_np, assert_close, np_dtype, rounded, to_jax, to_torch)

from jax_dilated.backends import KernelArgs, xla


@dataclasses.dataclass(frozen=True)
class KCase:
    """positions: "default" (arange, passed as None), "permuted" (shuffled and
    offset, so some queries precede every key), "striped" (token ``t`` of a
    4-way striped ring: this shard holds ``4 i + 1`` for queries and ``4 i + 2``
    for keys), "shifted" (keys start 5 after queries: the first rows are empty).
    valid: None, "2d" ([N, Lk], batch row 1 fully invalid) or "3d" ([N, Lk, Hkv],
    one kv head of batch row 0 fully invalid).
    """

    name: str
    N: int
    Lq: int
    Lk: int
    H: int
    Hkv: int
    D: int = 8
    causal: bool = False
    positions: str = "default"
    valid: str | None = None
    block: int | None = None
    scale: float = 0.35
    seed: int = 0

    @property
    def expect_empty_rows(self) -> bool:
        """Whether the inputs are built to contain query rows without any key."""
        return self.valid is not None or (self.causal and self.positions in
                                          ("permuted", "shifted"))

    def __str__(self):
        return self.name


KCASES = [
    KCase("full_single_block", 2, 20, 20, 4, 4),
    KCase("gqa_causal_blocks8", 2, 20, 20, 4, 2, causal=True, block=8),
    KCase("lq13_lk29_valid2d_blocks8", 2, 13, 29, 6, 3, D=16, valid="2d", block=8),
    KCase("permuted_causal_valid3d_blocks8", 2, 19, 27, 4, 2, causal=True,
          positions="permuted", valid="3d", block=8),
    KCase("striped_causal_mqa_blocks8", 1, 24, 24, 3, 1, causal=True, positions="striped",
          block=8),
    KCase("shifted_causal_valid2d", 2, 17, 17, 2, 2, causal=True, positions="shifted",
          valid="2d"),
    KCase("shifted_causal_valid3d_blocks8", 2, 33, 30, 4, 2, causal=True,
          positions="shifted", valid="3d", block=8),
]
BY_NAME = {c.name: c for c in KCASES}


def make_inputs(c: KCase):
    """float64 numpy q, k, v, cotangents (do, dlse), positions and validity."""
    rng = np.random.default_rng(c.seed)
    q = rng.standard_normal((c.N, c.Lq, c.H, c.D))
    k = rng.standard_normal((c.N, c.Lk, c.Hkv, c.D))
    v = rng.standard_normal((c.N, c.Lk, c.Hkv, c.D))
    do = rng.standard_normal((c.N, c.Lq, c.H, c.D))
    dlse = rng.standard_normal((c.N, c.Lq, c.H))
    if c.positions == "default":
        qp = kp = None
    elif c.positions == "permuted":
        qp = rng.permutation(c.Lq) + 6
        kp = rng.permutation(c.Lk)
    elif c.positions == "striped":
        qp = 4 * np.arange(c.Lq) + 1
        kp = 4 * np.arange(c.Lk) + 2
    elif c.positions == "shifted":
        qp = np.arange(c.Lq)
        kp = np.arange(c.Lk) + 5
    else:
        raise ValueError(c.positions)
    if c.valid is None:
        valid = None
    elif c.valid == "2d":
        valid = rng.random((c.N, c.Lk)) < 0.6
        valid[1] = False
    else:
        valid = rng.random((c.N, c.Lk, c.Hkv)) < 0.6
        valid[0, :, 1] = False
    return q, k, v, do, dlse, qp, kp, valid


def torch_reference(c: KCase, q, k, v, do, dlse, qp, kp, valid):
    """Reference (o, lse, dq, dk, dv) with cotangents ``do`` on o and ``dlse`` on lse."""
    qt, kt, vt = (to_torch(x, requires_grad=True) for x in (q, k, v))
    o, lse = ref.dense_attention(
        qt, kt, vt, scale=c.scale, is_causal=c.causal,
        kv_mask=None if valid is None else torch.tensor(valid),
        q_positions=qp, k_positions=kp, return_lse=True)
    grads = torch.autograd.grad((o, lse), (qt, kt, vt),
                                grad_outputs=(to_torch(do), to_torch(dlse)))
    return tuple(as_np(x) for x in (o, lse, *grads))


def args_of(c: KCase):
    return KernelArgs(scale=c.scale, is_causal=c.causal, block_q=c.block, block_k=c.block)


def jax_kernel(c: KCase, dtype, q, k, v, do, dlse, qp, kp, valid):
    """(o, lse, dq, dk, dv) from ``xla.attention`` under jit, VJP of (do, dlse)."""
    args = args_of(c)

    @jax.jit
    def f(q, k, v, do, dlse, qp, kp, valid):
        (o, lse, lse_lo), vjp = jax.vjp(
            lambda q, k, v: xla.attention(q, k, v, args, q_positions=qp, k_positions=kp,
                                          kv_valid=valid), q, k, v)
        # the log-sum-exp is lse + lse_lo: each part's cotangent is dlse's
        return (o, lse + lse_lo, *vjp((do, dlse, jnp.zeros_like(dlse))))

    cast = lambda x: to_jax(x, dtype)  # noqa: E731
    lse_dtype = jnp.promote_types(np.dtype(np.float32) if dtype == "bfloat16" else dtype,
                                  jnp.float32)
    return f(cast(q), cast(k), cast(v), cast(do), jnp.asarray(dlse, lse_dtype),
             None if qp is None else jnp.asarray(qp, jnp.int32),
             None if kp is None else jnp.asarray(kp, jnp.int32),
             None if valid is None else jnp.asarray(valid))


def check_case(c: KCase, dtype: str):
    q, k, v, do, dlse, qp, kp, valid = make_inputs(c)
    q, k, v, do = (rounded(x, dtype) for x in (q, k, v, do))
    expected = torch_reference(c, q, k, v, do, dlse, qp, kp, valid)
    got = jax_kernel(c, dtype, q, k, v, do, dlse, qp, kp, valid)
    o, lse = got[:2]
    assert o.dtype == jnp.dtype(np_dtype(dtype))
    assert lse.dtype == (jnp.float64 if dtype == "float64" else jnp.float32)
    for x, name in zip((o, *got[2:]), ("o", "dq", "dk", "dv")):
        assert np.all(np.isfinite(as_np(x))), f"{name} has non-finite entries"
    tol = TOL[dtype]
    for x, e, name in zip(got, expected, ("o", "lse", "dq", "dk", "dv")):
        assert_close(x, e, tol, name)
    # rows without an allowed key: exactly o = 0 and lse = -inf (checked by assert_close
    # for lse); make sure the case really has some where we planned them.
    empty = np.isneginf(expected[1])
    if c.expect_empty_rows:
        assert empty.any(), "the case was meant to contain rows without keys"
    assert np.all(as_np(o)[empty] == 0)
    assert np.all(as_np(got[2])[empty] == 0)  # dq of an empty row


@pytest.mark.parametrize("case", KCASES, ids=str)
def test_kernel_float64(case):
    """o, lse and the gradients of (o, lse) match dense attention to ~1e-10."""
    check_case(case, "float64")


@pytest.mark.parametrize("name", ["permuted_causal_valid3d_blocks8",
                                  "lq13_lk29_valid2d_blocks8"])
def test_kernel_float32(name):
    check_case(BY_NAME[name], "float32")


def test_kernel_bfloat16_forward():
    """bfloat16 o (and float32 lse) alone, no backward pass compiled."""
    c = BY_NAME["permuted_causal_valid3d_blocks8"]
    q, k, v, do, dlse, qp, kp, valid = make_inputs(c)
    q, k, v = (rounded(x, "bfloat16") for x in (q, k, v))
    o_t, lse_t = torch_reference(c, q, k, v, do, dlse, qp, kp, valid)[:2]
    o, lse, _ = jax.jit(lambda q, k, v: xla.forward(
        q, k, v, args_of(c), q_positions=jnp.asarray(qp), k_positions=jnp.asarray(kp),
        kv_valid=jnp.asarray(valid)))(*(to_jax(x, "bfloat16") for x in (q, k, v)))
    assert o.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    assert_close(o, o_t, TOL["bfloat16"], "o")
    assert_close(lse, lse_t, TOL["bfloat16"], "lse")


@pytest.mark.parametrize("name", ["gqa_causal_blocks8", "permuted_causal_valid3d_blocks8"])
def test_kernel_bfloat16(name):
    check_case(BY_NAME[name], "bfloat16")


def test_forward_equals_attention():
    """``forward`` is the primal of ``attention`` (same numbers, no jit)."""
    c = BY_NAME["permuted_causal_valid3d_blocks8"]
    q, k, v, _, _, qp, kp, valid = make_inputs(c)
    kw = dict(q_positions=jnp.asarray(qp), k_positions=jnp.asarray(kp),
              kv_valid=jnp.asarray(valid))
    first = xla.forward(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), args_of(c), **kw)
    second = xla.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), args_of(c), **kw)
    for x, y in zip(first, second, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("with_dlse", [False, True])
def test_backward_with_global_statistics(with_dlse):
    """Ring-style backward: keys in two shards, each shard's ``backward`` gets the
    *global* lse and ``delta = rowsum(do * o) - dlse``; summing dq over shards and
    concatenating dk/dv gives the gradients of attention over all keys."""
    rng = np.random.default_rng(7)
    n, lq, lk, h, hkv, d = 2, 21, 26, 4, 2, 8
    q = rng.standard_normal((n, lq, h, d))
    k = rng.standard_normal((n, lk, hkv, d))
    v = rng.standard_normal((n, lk, hkv, d))
    do = rng.standard_normal((n, lq, h, d))
    dlse = rng.standard_normal((n, lq, h)) if with_dlse else np.zeros((n, lq, h))
    valid = rng.random((n, lk)) < 0.8
    qpos = np.arange(lq) + 3
    kpos = rng.permutation(lk)  # keys in arbitrary order, as on a ring
    args = KernelArgs(scale=0.3, is_causal=True, block_q=8, block_k=8)

    qt, kt, vt = (to_torch(x, requires_grad=True) for x in (q, k, v))
    o_t, lse_t = ref.dense_attention(qt, kt, vt, scale=0.3, is_causal=True,
                                     kv_mask=torch.tensor(valid), q_positions=qpos,
                                     k_positions=kpos, return_lse=True)
    dq_t, dk_t, dv_t = torch.autograd.grad((o_t, lse_t), (qt, kt, vt),
                                           grad_outputs=(to_torch(do), to_torch(dlse)))
    o, lse = as_np(o_t), as_np(lse_t)
    delta = np.sum(do * o, axis=-1) - dlse
    split = [np.sort(idx) for idx in np.array_split(rng.permutation(lk), 2)]
    dq = np.zeros_like(q)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    backward = jax.jit(xla.backward, static_argnums=(6,))
    for idx in split:
        dq_s, dk_s, dv_s = backward(
            jnp.asarray(q), jnp.asarray(k[:, idx]), jnp.asarray(v[:, idx]), jnp.asarray(do),
            jnp.asarray(lse), jnp.asarray(delta), args, q_positions=jnp.asarray(qpos),
            k_positions=jnp.asarray(kpos[idx]), kv_valid=jnp.asarray(valid[:, idx]))
        dq += np.asarray(dq_s)
        dk[:, idx] = np.asarray(dk_s)
        dv[:, idx] = np.asarray(dv_s)
    assert_close(dq, dq_t, 1e-10, "dq")
    assert_close(dk, dk_t, 1e-10, "dk")
    assert_close(dv, dv_t, 1e-10, "dv")


@XLA_CPU_MEMORY
def test_one_item_chunks_hold_no_copy_of_the_inputs():
    """A call whose batch is cut into chunks of one item (8 segments of 2048 tokens x 8
    heads: one item's logits block fills the chunk budget) holds about what a call on
    one item holds (memory_analysis is deterministic), not whole copies of q, k and v.

    Measured (float32, causal): one item 32.1 / 46.2 MiB of temporaries (forward /
    forward+backward), eight items 36.1 / 91.2 MiB; before the chunk loop ran over the
    batch axis itself, 132.1 / 187.2 MiB (XLA:CPU copied each 32 MiB input whole).
    """
    from benchmarks.harness import temp_bytes

    args = KernelArgs(scale=0.125, is_causal=True)

    def temps(items):
        spec = jax.ShapeDtypeStruct((items, 2048, 8, 64), jnp.float32)
        assert xla.dense.batch_chunk(items, spec, spec, args) == 1
        f = lambda q, k, v: xla.attention(q, k, v, args)[0]  # noqa: E731
        grad = jax.grad(lambda q, k, v, c: jnp.sum(f(q, k, v) * c), argnums=(0, 1, 2))
        return temp_bytes(f, spec, spec, spec), temp_bytes(grad, spec, spec, spec, spec)

    (fwd_1, both_1), (fwd_8, both_8) = temps(1), temps(8)
    mib = 2 ** 20
    assert fwd_8 <= fwd_1 + 16 * mib, (fwd_1 / mib, fwd_8 / mib)
    assert both_8 <= both_1 + 80 * mib, (both_1 / mib, both_8 / mib)


@XLA_CPU_MEMORY
def test_one_item_blocks_are_not_laid_out_again():
    """The forward of one-item chunks (8 segments of 2048 tokens x 8 heads: the
    kernel's block operands have size-1 axes, one item and no GQA) holds one item's
    blocked q, k and v (4 MiB each) and two logits blocks (8 MiB each), not a third
    logits block: XLA:CPU once copied every step's logits into a layout differing
    only in where the size-1 axes sit (and transposed k), which made longnet's
    dilated forward take 1.17x the time (docs/benchmarks.md).

    Measured (float32, non-causal, jax 0.10 and 0.12): 28.0 MiB of temporaries;
    35.0 MiB with the five-axis block layout.
    """
    from benchmarks.harness import temp_bytes

    args = KernelArgs(scale=0.125)
    spec = jax.ShapeDtypeStruct((8, 2048, 8, 64), jnp.float32)
    assert xla.dense.batch_chunk(8, spec, spec, args) == 1
    temp = temp_bytes(lambda q, k, v: xla.attention(q, k, v, args)[0], spec, spec, spec)
    mib = 2 ** 20
    assert temp <= (3 * 4 + 2 * 8 + 4) * mib, temp / mib
