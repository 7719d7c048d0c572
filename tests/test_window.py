"""Sliding windows, logit soft-capping and attention sinks (issue 18, phase 1).

``window=(left, right)``: query ``p`` attends key ``t`` only if ``p - left <= t <= p +
right`` (global positions), on top of every other mask; ``logit_soft_cap=c``: logits
``c tanh(s / c)``; ``sinks`` [H]: a per-head logit in every row's denominator
(docs/semantics.md, "Sliding windows, soft-capping and sinks").

Every parity case compares the output and the gradients of q, k, v (and sinks)
through a random cotangent with the float64 PyTorch reference
(``torch_reference.dense_attention``, written from the math) at the tolerances of
``_helpers.TOL``; the window is also checked against
``jax.nn.dot_product_attention(local_window_size=...)``. Shapes are small (T <= 64,
blocks of 8 / 16) so that windows smaller than a block, larger than the sequence and
asymmetric ones all cross block and shard boundaries.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _mesh import build_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_dilated as jd
from jax_dilated import block_patterns as bp
from jax_dilated.backends import KernelArgs, call_specs, cudnn, registry, selection, xla

torch = pytest.importorskip("torch")  # the reference; without it the module skips

import torch_reference as ref  # noqa: E402
from _helpers import (  # noqa: E402
    TOL, XLA_CPU_MEMORY, as_np, assert_close, np_dtype, rounded, to_jax, to_torch)
from torch_reference.block_sparse import expand_block_mask  # noqa: E402

B, H, HKV, D = 2, 4, 2, 8
SCALE = 0.5


def make_inputs(seed: int, tq: int, tk: int | None = None, big: float = 1.0):
    rng = np.random.default_rng(seed)
    tk = tq if tk is None else tk
    q = rng.standard_normal((B, tq, H, D)) * big
    k = rng.standard_normal((B, tk, HKV, D))
    v = rng.standard_normal((B, tk, HKV, D))
    g = rng.standard_normal((B, tq, H, D))
    return q, k, v, g


def reference(q, k, v, g, sinks=None, *, allowed=None, **kw):
    """float64 output and d/d(q, k, v[, sinks]) of sum(g * out), PyTorch."""
    tq, tk, tv = (to_torch(x, requires_grad=True) for x in (q, k, v))
    ts = None if sinks is None else to_torch(sinks, requires_grad=True)
    out = ref.dense_attention(tq, tk, tv, scale=SCALE, sinks=ts, allowed=allowed, **kw)
    (to_torch(g) * out).sum().backward()
    leaves = (tq, tk, tv) if ts is None else (tq, tk, tv, ts)
    return as_np(out), tuple(as_np(x.grad) for x in leaves)


def check(name, dtype, got_out, got_grads, want_out, want_grads):
    tol = TOL[dtype]
    assert_close(got_out, want_out, tol, f"{name} out")
    for n, got, want in zip(("q", "k", "v", "sinks"), got_grads, want_grads):
        assert_close(got, want, tol, f"{name} d{n}")


def grad_step(fn, n_args: int = 3):
    """jit(grad) of sum(g * fn(*args)) in its first ``n_args`` arguments."""
    def loss(g, *args):
        out = fn(*args)
        return jnp.sum(g.astype(out.dtype) * out).astype(jnp.float64), out

    step = jax.jit(jax.grad(loss, argnums=tuple(range(1, n_args + 1)), has_aux=True))

    def run(g, *args):
        grads, out = step(g, *args)
        return out, grads

    return run


# --------------------------------------------------------------------- the kernel

KERNEL_CASES = [
    # (name, tq, tk, block, window, cap, causal, positions given, dtype)
    ("window below a block", 40, 40, 16, (3, 2), None, False, False, "float64"),
    ("causal, cap, run-time skipping", 40, 40, 8, (5, 0), 1.5, True, True, "float64"),
    ("window beyond the sequence", 33, 21, 8, (100, 100), 0.7, False, False, "float64"),
    ("float32 asymmetric", 48, 48, 16, (9, 4), 3.0, False, False, "float32"),
]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
def test_kernel_parity(case):
    name, tq, tk, block, window, cap, causal, given, dtype = case
    q, k, v, g = make_inputs(len(name), tq, tk)
    args = KernelArgs(scale=SCALE, is_causal=causal, block_q=block, block_k=block,
                      window=window, logit_soft_cap=cap)
    where = (dict(q_positions=jnp.arange(tq), k_positions=jnp.arange(tk)) if given
             else {})
    out, grads = grad_step(lambda q, k, v: xla.attention(q, k, v, args, **where)[0])(
        *(to_jax(x, dtype) for x in (g, q, k, v)))
    want = reference(*(rounded(x, dtype) for x in (q, k, v, g)), is_causal=causal,
                     window=window, logit_soft_cap=cap)
    check(name, dtype, out, grads, *want)


def test_window_matches_jax_local_window_size():
    """The second reference: jax.nn.dot_product_attention's local_window_size."""
    q, k, v, _ = make_inputs(3, 40)
    q, k, v = (to_jax(x, "float32") for x in (q, k, v))
    for window, causal in (((0, 9), False), ((6, 0), True)):
        args = KernelArgs(scale=SCALE, is_causal=causal, block_q=8, block_k=8,
                          window=window)
        got = xla.forward(q, k, v, args)[0]
        want = jax.nn.dot_product_attention(q, k, v, scale=SCALE, is_causal=causal,
                                            local_window_size=window, implementation="xla")
        assert_close(got, want, TOL["float32"], f"window {window}")


def test_soft_cap_far_beyond_the_cap():
    """Logits of order 100 capped at 2: tanh saturates; forward and gradients exact."""
    q, k, v, g = make_inputs(4, 32, big=60.0)
    args = KernelArgs(scale=SCALE, block_q=8, block_k=8, logit_soft_cap=2.0)
    out, grads = grad_step(lambda q, k, v: xla.attention(q, k, v, args)[0])(
        *(jnp.asarray(x) for x in (g, q, k, v)))
    want = reference(q, k, v, g, logit_soft_cap=2.0)
    check("soft cap, |logits| >> c", "float64", out, grads, *want)


@pytest.mark.parametrize("cap,dtype", [(50.0, "float32"), (400.0, "float64")])
def test_soft_cap_row_at_minus_the_cap(cap, dtype):
    """Logits far beyond the cap both ways, and a row whose every logit sits at ``-c``
    (so its probabilities are ``exp(-2c)`` against any fixed shift of ``c``: the
    running maximum keeps them exact)."""
    q, k, v, g = make_inputs(9, 32)
    direction = np.random.default_rng(2).standard_normal(D)
    k = k + 4.0 * direction  # every key leans one way ...
    q = q * 3.0 * cap ** 0.5
    q[:, 0] = -30.0 * cap ** 0.5 * direction / np.linalg.norm(direction)  # ... row 0 against
    args = KernelArgs(scale=SCALE, block_q=8, block_k=8, logit_soft_cap=cap)
    out, grads = grad_step(lambda q, k, v: xla.attention(q, k, v, args)[0])(
        *(to_jax(x, dtype) for x in (g, q, k, v)))
    q, k, v, g = (rounded(x, dtype) for x in (q, k, v, g))
    logits = SCALE * np.einsum("bqhd,bkhd->bqhk", q[:, :1, :HKV], k)
    assert np.all(logits < -4 * cap)  # row 0: every capped logit is -c (to rounding)
    want = reference(q, k, v, g, logit_soft_cap=cap)
    check(f"cap {cap}", dtype, out, grads, *want)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_soft_cap_slope_where_tanh_saturates(dtype):
    """The backward's ``d tanh(x)/dx`` at saturated ``|x|`` (5..20, both signs) and
    below, elementwise against float64 ``sech^2`` at the dtype's tolerance:
    ``1 - tanh^2`` is 0 or wrong in the leading digits there on any CPU (in float32
    tanh(5) is 1 - 9e-5 to within 6e-8, so 1 - tanh^2 is off by ~1e-3 relative)."""
    x = np.concatenate([np.linspace(5.0, 20.0, 61), np.linspace(0.0, 5.0, 41)])
    x = rounded(np.concatenate([x, -x]), dtype)
    got = jax.jit(xla.block_math.soft_cap_slope)(to_jax(x, dtype))
    assert got.dtype == np_dtype(dtype)
    want = 1.0 / np.cosh(x) ** 2
    err = np.max(np.abs(as_np(got) - want) / want)
    assert err <= TOL[dtype], f"sech^2: relative error {err:.3e} > {TOL[dtype]:.1e}"


def test_soft_cap_tanh_to_about_an_ulp():
    """The capped logit ``c tanh(x)`` carries ``c`` times tanh's error: XLA:CPU's float32
    tanh is up to 5 ulps off (1.2e-5 in a logit capped at 50, several times the
    logit's own rounding), the kernel's 1.2 (both sides of the switch from the
    polynomial to the exponential, small and saturated arguments, signs)."""
    x = np.concatenate([np.linspace(0.0, 1.2, 24001), np.linspace(1.2, 12.0, 20001),
                        xla.block_math._TANH_POLY_BELOW + np.arange(-64, 64) * 6e-8,
                        [1e-30, 1e-8, 30.0, 100.0, np.inf]])
    x = rounded(np.concatenate([x, -x]), "float32")
    got = as_np(jax.jit(xla.block_math.soft_cap_tanh)(to_jax(x, "float32")))
    want = np.tanh(x)
    ulp = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    err = np.max(np.abs(got - want) / ulp)
    assert err <= 1.5, f"tanh: {err:.2f} ulps"
    assert np.array_equal(np.signbit(got), np.signbit(x))


def test_soft_cap_gradients_where_every_logit_saturates():
    """Every logit of every row at ``5 <= |s / c| <= 8``: every gradient of q and k
    goes through ``sech^2(s / c)`` (1e-4 .. 1e-7), which must keep float32's
    tolerance (``1 - tanh^2`` gives 1e-3 relative errors here on any CPU)."""
    cap = 3.0
    rng = np.random.default_rng(12)
    u = rng.standard_normal(D)
    u /= np.linalg.norm(u)
    # q = a u, k = b u (+ a little noise): s = SCALE a b, |a b| in [2.5, 4] / SCALE ...
    a = rng.choice([-1.0, 1.0], (B, 32, H)) * rng.uniform(5.0, 6.4, (B, 32, H))
    b = rng.uniform(1.0, 1.25, (B, 32, HKV))
    q = a[..., None] * u * cap ** 0.5 * 2.0
    k = b[..., None] * u * cap ** 0.5 + 1e-3 * rng.standard_normal((B, 32, HKV, D))
    v = rng.standard_normal((B, 32, HKV, D))
    g = rng.standard_normal((B, 32, H, D))
    q, k, v, g = (rounded(x, "float32") for x in (q, k, v, g))
    x = SCALE * np.einsum("bqgjd,bkgd->bqgjk", q.reshape(B, 32, HKV, H // HKV, D), k)
    x /= cap  # ... so |s / c| in [5, 8] for every (query, key) pair
    assert 5.0 <= np.abs(x).min() and np.abs(x).max() <= 8.0, np.abs(x).min()
    args = KernelArgs(scale=SCALE, block_q=8, block_k=8, logit_soft_cap=cap)
    out, grads = grad_step(lambda q, k, v: xla.attention(q, k, v, args)[0])(
        *(to_jax(x, "float32") for x in (g, q, k, v)))
    want_out, want_grads = reference(q, k, v, g, logit_soft_cap=cap)
    check(f"cap {cap}, saturated", "float32", out, grads, want_out, want_grads)
    # dq and dk are of order sech^2 (below the floor of 1 that ``check`` measures
    # against): held to float32's tolerance relative to their own size.
    for name, got, want in zip("qk", grads, want_grads):
        size = np.max(np.abs(want))
        assert 1e-6 < size < 1e-2, (name, size)
        err = np.max(np.abs(as_np(got) - want)) / size
        assert err <= TOL["float32"], f"d{name}: relative error {err:.3e} > 1.0e-05"


def test_banded_kernel_visits_only_the_band():
    """Static positions: the band lists hold O(window) key blocks per query block."""
    geo = xla.layout._Blocking(1024, 1024, 64, 64)
    lists = xla.block_sparse.window_blocks(geo, (100, 0), True)
    assert lists.rows.shape == (16, 3)   # ceil(100 / 64) + 1 blocks at most
    assert lists.cols.shape == (16, 3)
    lists = xla.block_sparse.window_blocks(geo, (0, 0), False)
    assert lists.rows.shape == (16, 1) and lists.rows_ok is None


# ---------------------------------------------------------------- sinks, one device

def _block_sparse(pattern, block, **kw):
    def fn(q, k, v, sinks):
        return jd.block_sparse_attention(q, k, v, block_size=block, pattern=pattern,
                                         scale=SCALE, sinks=sinks, **kw)
    return fn


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_sinks_with_fully_masked_rows(dtype):
    """Row 1 of the batch has every key masked: output 0, finite gradients, and
    d sinks exact (row 0 has a window, a cap and a sink)."""
    t = 32
    q, k, v, g = make_inputs(5, t)
    sinks = np.array([0.5, -1.0, 2.0, 0.0])
    mask = np.ones((B, t), bool)
    mask[1] = False
    pattern = np.ones((2, 2), bool)
    fn = _block_sparse(pattern, 16, window=(4, 3), logit_soft_cap=2.5,
                       kv_mask=jnp.asarray(mask))
    out, grads = grad_step(fn, 4)(*(to_jax(x, dtype) for x in (g, q, k, v, sinks)))
    assert np.all(np.asarray(jnp.asarray(out[1], jnp.float32)) == 0.0)
    for gr in grads:
        assert np.all(np.isfinite(np.asarray(jnp.asarray(gr, jnp.float32))))
    want = reference(*(rounded(x, dtype) for x in (q, k, v, g, sinks)),
                     kv_mask=torch.as_tensor(mask), window=(4, 3), logit_soft_cap=2.5)
    check(f"sinks {dtype}", dtype, out, grads, *want)


def test_block_sparse_window_and_lse():
    """A pattern AND a window AND causal, with the sink-inclusive log-sum-exp."""
    t, block = 48, 8
    q, k, v, g = make_inputs(6, t)
    sinks = np.array([1.0, 0.0, -0.5, 3.0])
    pattern = bp.LocalWindow(1) | bp.GlobalBlocks([0])
    mask = pattern.to_mask(t // block, t // block, None)
    fn = _block_sparse(pattern, block, window=(11, 0), is_causal=True)
    out, grads = grad_step(fn, 4)(*(jnp.asarray(x) for x in (g, q, k, v, sinks)))
    allowed = expand_block_mask(mask, block, t, t)[None]
    want = reference(q, k, v, g, sinks=sinks, allowed=allowed, is_causal=True,
                     window=(11, 0))
    check("block-sparse window", "float64", out, grads, *want)
    _, lse = jd.block_sparse_attention(*(jnp.asarray(x) for x in (q, k, v)),
                                       block_size=block, pattern=pattern, scale=SCALE,
                                       is_causal=True, window=(11, 0),
                                       sinks=jnp.asarray(sinks), return_lse=True)
    _, want_lse = ref.dense_attention(*(to_torch(x) for x in (q, k, v)), scale=SCALE,
                                      allowed=allowed, is_causal=True, window=(11, 0),
                                      sinks=to_torch(sinks), return_lse=True)
    assert_close(lse, as_np(want_lse), TOL["float64"], "lse with sinks")


# ---------------------------------------------------------------------- the ring

def ring(p: int, layout: str, *, sparse=None, **kw):
    """``jd.ring_attention`` (or block-sparse, ``sparse=(block, pattern)``) inside
    ``shard_map`` on ``p`` devices, global arrays in token order; sinks replicated."""
    mesh = build_mesh((p,), ("seq",), "explicit")
    spec = P(None, "seq")

    def local(q, k, v, sinks):
        if sparse is None:
            return jd.ring_attention(q, k, v, seq_axis="seq", layout=layout, scale=SCALE,
                                     sinks=sinks, **kw)
        return jd.block_sparse_attention(q, k, v, block_size=sparse[0], pattern=sparse[1],
                                         seq_axis="seq", layout=layout, scale=SCALE,
                                         sinks=sinks, **kw)

    sm = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3 + (P(),), out_specs=spec,
                       check_vma=True)

    def place(x):
        return jax.sharding.reshard(jd.to_layout(x, p, layout), NamedSharding(mesh, spec))

    def fn(q, k, v, sinks):
        out = sm(*(place(x) for x in (q, k, v)),
                 jax.sharding.reshard(sinks, NamedSharding(mesh, P())))
        out = jax.sharding.reshard(out, NamedSharding(mesh, P()))
        return jd.from_layout(out, p, layout)

    return fn


RING_CASES = [
    # (P, layout, causal, window, cap, dtype); P = 1 is the kernel's own call
    (1, "contiguous", True, (9, 0), 2.0, "float64"),
    (1, "contiguous", False, (3, 6), None, "bfloat16"),
    (2, "contiguous", False, (10, 3), 2.0, "float64"),
    (4, "zigzag", True, (9, 0), None, "float64"),
    (4, "striped", False, (2, 5), 1.0, "float32"),
]


@pytest.mark.parametrize("p,layout,causal,window,cap,dtype", RING_CASES,
                         ids=["-".join(map(str, c[:3])) for c in RING_CASES])
def test_ring_parity(p, layout, causal, window, cap, dtype):
    t = 64
    q, k, v, g = make_inputs(7 + p, t)
    sinks = np.array([0.3, -2.0, 1.0, 0.0])
    fn = ring(p, layout, is_causal=causal, window=window, logit_soft_cap=cap)
    out, grads = grad_step(fn, 4)(*(to_jax(x, dtype) for x in (g, q, k, v, sinks)))
    want = reference(*(rounded(x, dtype) for x in (q, k, v, g, sinks)), is_causal=causal,
                     window=window, logit_soft_cap=cap)
    check(f"ring P={p} {layout}", dtype, out, grads, *want)


@XLA_CPU_MEMORY
@pytest.mark.parametrize("op", ["ring_one_device", "block_sparse"])
def test_sinks_hold_no_output_sized_copy(op):
    """Compiled temp of ``jax.vjp`` returning the output and the q, k, v gradients,
    sinks held constant (as in a training step that differentiates them elsewhere),
    n=16384, 8 heads x 64, float32, causal: with sinks at most a quarter of one
    output-sized array above plain attention. Measured: 187.1 (ring's kernel call)
    and 180.1 MiB (block-sparse) against 193.1 plain; with the sinks merged after
    the kernel's custom_vjp, 226.1 for both (its own output kept for its backward
    beside the merged one)."""
    from benchmarks.harness import temp_bytes

    x = jax.ShapeDtypeStruct((1, 16384, 8, 64), jnp.float32)
    s = jax.ShapeDtypeStruct((8,), jnp.float32)
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("seq",))

    def attend(q, k, v, sinks):
        if op == "block_sparse":
            return jd.block_sparse_attention(q, k, v, block_size=512, is_causal=True,
                                             pattern=bp.LocalWindow(2), sinks=sinks)
        return jax.shard_map(
            lambda q, k, v, s: jd.ring_attention(q, k, v, seq_axis="seq", is_causal=True,
                                                 sinks=s),
            mesh=mesh, in_specs=(P(None, "seq"),) * 3 + (P(),),
            out_specs=P(None, "seq"))(q, k, v, sinks)

    def program(with_sinks):
        def run(q, k, v, ct, sinks):
            out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, sinks if with_sinks else None),
                               q, k, v)
            return out, vjp(ct)
        return run

    plain, sunk = (temp_bytes(program(w), x, x, x, x, s) for w in (False, True))
    assert sunk - plain <= 16384 * 8 * 64 * 4 / 4, (plain / 2**20, sunk / 2**20)


def test_ring_skips_steps_outside_the_window():
    """Keys of devices 2 and 3 are NaN; device 0's queries (window (4, 0)) need only
    their own shard. If any step touched the NaN shards for device 0's rows (forward)
    or the backward of device 2/3's rows touched device 0's keys, NaN would reach
    rows 0..15 of out, dq, dk, dv. They stay finite and exact: those steps were
    skipped at run time."""
    t, n = 64, 16
    q, k, v, g = make_inputs(8, t)
    kn, vn = k.copy(), v.copy()
    kn[:, 2 * n:], vn[:, 2 * n:] = np.nan, np.nan
    sinks = np.zeros(H)
    fn = ring(4, "contiguous", is_causal=True, window=(4, 0))
    out, grads = grad_step(fn, 3)(*(jnp.asarray(x) for x in (g, q, kn, vn)),
                                  jnp.asarray(sinks))
    want_out, want_grads = reference(q, k, v, g, sinks=sinks, is_causal=True, window=(4, 0))
    out, grads = np.asarray(out), [np.asarray(x) for x in grads]
    assert_close(out[:, :n], want_out[:, :n], TOL["float64"], "skipped ring out")
    for name, got, want in zip("qkv", grads, want_grads):
        assert_close(got[:, :n], want[:, :n], TOL["float64"], f"skipped ring d{name}")


def test_block_sparse_ring():
    t, block = 64, 8
    q, k, v, g = make_inputs(9, t)
    sinks = np.array([0.0, 1.0, -1.0, 0.5])
    pattern = bp.LocalWindow(2)
    mask = pattern.to_mask(t // block, t // block, None)
    fn = ring(2, "zigzag", sparse=(block, pattern), is_causal=True, window=(13, 0),
              logit_soft_cap=1.5)
    out, grads = grad_step(fn, 4)(*(jnp.asarray(x) for x in (g, q, k, v, sinks)))
    want = reference(q, k, v, g, sinks=sinks, allowed=expand_block_mask(mask, block, t, t)[None],
                     is_causal=True, window=(13, 0), logit_soft_cap=1.5)
    check("block-sparse ring", "float64", out, grads, *want)


# ------------------------------------------------------------ backends, bad input

def test_cudnn_serves_left_windows_and_refuses_the_rest():
    """cuDNN serves a window ending at its query (its causal mask with a left bound) on
    square blocks with positions arange; it refuses windows reaching right, windows by
    position arrays (rings) and soft-caps, and the automatic kernel says why."""
    info = selection.DeviceInfo("gpu", "NVIDIA H100", (9, 0), "cuda")
    q = jax.ShapeDtypeStruct((1, 64, 4, 64), jnp.bfloat16)
    for args, word in ((KernelArgs(scale=1.0, window=(8, 2)), "right of the query"),
                       (KernelArgs(scale=1.0, logit_soft_cap=30.0), "soft-cap")):
        reason = selection.cudnn_call_reason(info, call_specs.call_spec(q, q, args))
        assert reason is not None and word in reason, reason
    for args in (KernelArgs(scale=1.0), KernelArgs(scale=1.0, window=(8, 0)),
                 KernelArgs(scale=1.0, window=(8, 0), is_causal=True)):
        assert selection.cudnn_call_reason(info, call_specs.call_spec(q, q, args)) is None
    # positions that are not arange (a ring step) keep a window off cuDNN
    shifted = np.arange(64) + 64
    reason = selection.cudnn_call_reason(info, call_specs.call_spec(
        q, q, KernelArgs(scale=1.0, window=(8, 0)), shifted, np.arange(64)))
    assert reason is not None and "sliding window by position arrays" in reason
    strict = cudnn.CudnnKernel(ops=cudnn.ReferenceOps(), device=info)
    auto = registry.AutoKernel(strict)
    x = jnp.zeros((1, 16, 4, 64), jnp.bfloat16)
    kern, why = auto.choose(x, x, KernelArgs(scale=1.0, window=(3, 0), is_causal=True))
    assert kern is auto.cudnn and why is None
    for args in (KernelArgs(scale=1.0, window=(3, 0), is_causal=True),
                 KernelArgs(scale=1.0, window=(3, 0))):
        # a windowed ring's steps carry traced positions: the XLA kernel's fused steps
        assert auto.ring_steps(x, x, args) is not None
    right = KernelArgs(scale=1.0, window=(3, 2))
    kern, why = auto.choose(x, x, right)
    assert kern is auto.xla and "right of the query" in why
    with pytest.raises(ValueError, match="right of the query"):
        strict.forward(x, x, x, right)


BAD = [
    (dict(window=(-1, 0)), ValueError, r"window\[0\].*-1"),
    (dict(window=(3, 2), is_causal=True), ValueError, r"window.*right=2.*is_causal"),
    (dict(window=4), TypeError, r"window must be None or a pair"),
    (dict(window=(2.5, 0)), TypeError, r"window\[0\]"),
    (dict(logit_soft_cap=0.0), ValueError, r"logit_soft_cap.*> 0"),
    (dict(logit_soft_cap=float("inf")), ValueError, r"logit_soft_cap.*finite"),
    (dict(logit_soft_cap="30"), TypeError, r"logit_soft_cap"),
    (dict(sinks=np.zeros(3)), ValueError, r"sinks.*\(4,\).*\(3,\)"),
    (dict(sinks=np.zeros(4, np.int32)), TypeError, r"sinks must be a floating array"),
]


@pytest.mark.parametrize("kw,err,match", BAD, ids=[str(b[0]) for b in BAD])
def test_bad_input(kw, err, match):
    x = jnp.zeros((1, 16, H, D))
    with pytest.raises(err, match=match):
        jd.block_sparse_attention(x, x, x, block_size=8, pattern=np.ones((2, 2), bool),
                                  **kw)
