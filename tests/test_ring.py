"""Ring attention (``jd.ring_attention`` / ``jd.sharded``) on 1, 2, 4 and 8 simulated CPU devices.

Every parity case draws random q, k, v (GQA: 4 query heads, 2 kv heads unless
stated), a random output cotangent ``g`` and optionally a key padding mask, runs
``jax.jit(jax.grad(sum(g * ring(q, k, v)), has_aux=True))`` over a mesh and
compares the output and the gradients of q, k and v with

  (a) the PyTorch exact-attention reference ``torch_reference.dense_attention``
      in float64, fed the inputs rounded to the JAX dtype, and
  (b) (float64 cases) single-device exact attention written in plain ``jnp``,
      differentiated with ``jax.grad`` on one device.

Tolerances are relative to the largest magnitude of the reference (``_helpers``):
float64 1e-10, float32 1e-5, bfloat16 2e-2.

Shapes are tiny (T <= 48, D = 8) and the local shard lengths are deliberately not
powers of two (n = 6, 10, 12, 24; zigzag chunks of 3 and 5). Each case costs one
compilation, so the matrix is chosen rather than a full product: every layout is
run causal and not, on every ring size, with every mask kind, on meshes from
``jax.make_mesh`` (Explicit axes) and on hand-built ``Mesh`` objects (Auto axes).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _mesh import build_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_dilated as jd
from jax_dilated.core import layouts

torch = pytest.importorskip("torch")  # the reference; without it the module skips

import torch_reference as ref  # noqa: E402
from _helpers import (  # noqa: E402
    TOL, XLA_CPU_MEMORY, as_np, assert_close, np_dtype, rounded, to_jax, to_torch)

# --------------------------------------------------------------------------- inputs


def make_mask(kind: str, b: int, t: int, rng) -> np.ndarray | None:
    """Key padding mask [b, t] (True = may be attended to).

    "none": no mask; "random": each key kept with probability 0.7;
    "ragged": right padding, a different valid length per batch row, so that whole
      shards at the end of the sequence are padded in every row (a ring step whose
      visiting block is fully padded is skipped);
    "empty_row": row 0 random, row 1 has no valid key at all (its output must be
      exactly 0 and its gradients finite).
    """
    if kind == "none":
        return None
    if kind == "random":
        return rng.random((b, t)) < 0.7
    if kind == "ragged":
        lengths = [t // 2 + 3, t // 4 + 1] + [t] * (b - 2)
        return np.arange(t)[None, :] < np.asarray(lengths[:b])[:, None]
    if kind == "empty_row":
        mask = rng.random((b, t)) < 0.7
        mask[1] = False
        return mask
    raise AssertionError(kind)


def make_inputs(b, t, h, hkv, d, mask_kind, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, h, d))
    k = rng.standard_normal((b, t, hkv, d))
    v = rng.standard_normal((b, t, hkv, d))
    g = rng.standard_normal((b, t, h, d))
    gl = rng.standard_normal((b, t, h))
    return q, k, v, g, gl, make_mask(mask_kind, b, t, rng)


# ------------------------------------------------------------------------ references


def torch_reference(q, k, v, g, mask, *, causal, scale=None, gl=None):
    """Output, lse and d/d(q, k, v) of ``sum(g * out) [+ sum(gl * lse)]`` in float64."""
    tq, tk, tv = (to_torch(x, requires_grad=True) for x in (q, k, v))
    out, lse = ref.dense_attention(
        tq, tk, tv, scale=scale, is_causal=causal, return_lse=True,
        kv_mask=None if mask is None else torch.as_tensor(mask))
    loss = (to_torch(g) * out).sum()
    if gl is not None:
        finite = torch.isfinite(lse)
        loss = loss + (to_torch(gl) * torch.where(finite, lse, torch.zeros_like(lse))).sum()
    loss.backward()
    return as_np(out), as_np(lse), (as_np(tq.grad), as_np(tk.grad), as_np(tv.grad))


def _jnp_dense(q, k, v, mask, *, causal, scale):
    """Exact attention in plain jnp (zero output for rows without keys)."""
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    t = q.shape[1]
    allowed = jnp.tril(jnp.ones((t, t), bool)) if causal else jnp.ones((t, t), bool)
    allowed = allowed[None, None]
    if mask is not None:
        allowed = allowed & mask[:, None, None, :]
    s = jnp.where(allowed, s, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(s - m)
    den = e.sum(-1, keepdims=True)
    return jnp.einsum("bhqk,bkhd->bqhd", e / jnp.where(den > 0, den, 1.0), v)


@functools.partial(jax.jit, static_argnames=("causal", "scale"))
def jnp_reference(q, k, v, g, mask, *, causal, scale):
    """Single-device exact attention and its gradients (``jax.grad``)."""
    def loss(q, k, v):
        out = _jnp_dense(q, k, v, mask, causal=causal, scale=scale)
        return jnp.sum(g * out), out

    grads, out = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


# ----------------------------------------------------------------------------- meshes


# --------------------------------------------------------------------- parity matrix


@dataclasses.dataclass(frozen=True)
class Case:
    """One ring configuration.

    P: ring size (mesh axis "seq"). extra: None (1-D mesh), "data" (mesh (2, P) with
    batch_axis="data") or "heads" (mesh (2, P) with head_axis="model").
    """

    name: str
    P: int
    layout: str
    causal: bool
    mask: str = "none"
    T: int = 48
    B: int = 2
    H: int = 4
    Hkv: int = 2
    D: int = 8
    dtype: str = "float64"
    mesh: str = "explicit"
    extra: str | None = None
    scale: float | None = None


CASES = [
    # one device: the ring degenerates to one local step
    Case("p1_contig_causal_random", 1, "contiguous", True, "random"),
    # two devices (n = 24)
    Case("p2_contig_full", 2, "contiguous", False),
    Case("p2_zigzag_causal_emptyrow", 2, "zigzag", True, "empty_row"),
    Case("p2_striped_causal_random_auto", 2, "striped", True, "random", mesh="auto"),
    # four devices (n = 10 or 12; zigzag chunks of 5 or 6)
    Case("p4_contig_causal_ragged_T40", 4, "contiguous", True, "ragged", T=40),
    Case("p4_contig_full_emptyrow_auto", 4, "contiguous", False, "empty_row", mesh="auto"),
    Case("p4_zigzag_causal_T40_auto", 4, "zigzag", True, T=40, mesh="auto"),
    Case("p4_zigzag_full_random", 4, "zigzag", False, "random"),
    Case("p4_striped_full_emptyrow", 4, "striped", False, "empty_row"),
    Case("p4_striped_causal_ragged_mqa", 4, "striped", True, "ragged", Hkv=1),
    Case("p4_zigzag_causal_mha_scale", 4, "zigzag", True, "random", Hkv=4, scale=0.3),
    # eight devices (n = 6; zigzag chunks of 3)
    Case("p8_contig_causal_emptyrow", 8, "contiguous", True, "empty_row"),
    Case("p8_contig_full_ragged_auto", 8, "contiguous", False, "ragged", mesh="auto"),
    Case("p8_zigzag_causal_random", 8, "zigzag", True, "random"),
    Case("p8_zigzag_full_emptyrow_auto", 8, "zigzag", False, "empty_row", mesh="auto"),
    Case("p8_striped_causal", 8, "striped", True),
    Case("p8_striped_full_random", 8, "striped", False, "random"),
    # data x sequence and heads x sequence meshes (2, 4)
    Case("data2_seq4_contig_causal_random", 4, "contiguous", True, "random", extra="data"),
    Case("data2_seq4_zigzag_causal_emptyrow_auto", 4, "zigzag", True, "empty_row",
         extra="data", mesh="auto"),
    Case("heads2_seq4_striped_causal_random", 4, "striped", True, "random", extra="heads"),
    Case("heads2_seq4_zigzag_full_ragged_auto", 4, "zigzag", False, "ragged",
         extra="heads", mesh="auto"),
    # lower precision against the float64 reference
    Case("f32_p4_zigzag_causal_random", 4, "zigzag", True, "random", dtype="float32"),
    Case("f32_p8_contig_causal_emptyrow", 8, "contiguous", True, "empty_row",
         dtype="float32"),
    Case("f32_p2_striped_full", 2, "striped", False, dtype="float32", mesh="auto"),
    Case("bf16_p4_zigzag_causal_random", 4, "zigzag", True, "random", dtype="bfloat16"),
    Case("bf16_p8_striped_full_emptyrow", 8, "striped", False, "empty_row",
         dtype="bfloat16"),
    Case("bf16_p2_contig_causal", 2, "contiguous", True, dtype="bfloat16"),
]


def case_mesh_and_axes(case: Case):
    """(mesh, kwargs for jd.sharded)."""
    if case.extra is None:
        return build_mesh((case.P,), ("seq",), case.mesh), {}
    if case.extra == "data":
        return build_mesh((2, case.P), ("data", "seq"), case.mesh), {"batch_axis": "data"}
    assert case.extra == "heads", case.extra
    return build_mesh((2, case.P), ("model", "seq"), case.mesh), {"head_axis": "model"}


def run_ring(case: Case, q, k, v, g, mask):
    """``jax.jit(jax.grad(...))`` of ``sum(g * ring(q, k, v))``: (out, (dq, dk, dv))."""
    mesh, axes = case_mesh_and_axes(case)
    attn = jd.sharded(
        functools.partial(jd.ring_attention, is_causal=case.causal, scale=case.scale),
        mesh, seq_axis="seq", layout=case.layout, **axes)

    def loss(q, k, v, g, mask):
        out = attn(q, k, v, kv_mask=mask)
        assert out.shape == q.shape and out.dtype == q.dtype, (out.shape, out.dtype)
        return jnp.sum(g * out), out

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    grads, out = step(q, k, v, g, None if mask is None else jnp.asarray(mask))
    return out, grads


def check_empty_row(case, out, grads):
    if case.mask != "empty_row":
        return
    out = np.asarray(out).astype(np.float32)  # (in NumPy: no program to compile)
    assert np.all(out[1] == 0.0), "fully padded batch row must output exactly 0"
    for name, gr in zip("qkv", grads):
        gr = np.asarray(gr).astype(np.float32)
        assert np.all(np.isfinite(gr)), f"d{name} has non-finite entries"
        assert np.all(gr[1] == 0.0), f"d{name} of the fully padded row must be 0"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_ring_parity(case: Case):
    q, k, v, g, _, mask = make_inputs(case.B, case.T, case.H, case.Hkv, case.D, case.mask,
                                      seed=zlib.crc32(case.name.encode()))
    dt = case.dtype
    out, grads = run_ring(case, *(to_jax(x, dt) for x in (q, k, v, g)), mask)
    assert out.dtype == jnp.dtype(np_dtype(dt))
    check_empty_row(case, out, grads)

    tol = TOL[dt]
    qr, kr, vr, gr = (rounded(x, dt) for x in (q, k, v, g))
    want_out, _, want_grads = torch_reference(qr, kr, vr, gr, mask, causal=case.causal,
                                              scale=case.scale)
    assert_close(out, want_out, tol, f"{case.name} out vs torch")
    for name, got, want in zip("qkv", grads, want_grads):
        assert_close(got, want, tol, f"{case.name} d{name} vs torch")

    if dt == "float64":
        scale = case.scale if case.scale is not None else 1.0 / math.sqrt(case.D)
        with jax.default_device(jax.devices()[0]):
            one_out, one_grads = jnp_reference(
                *(jnp.asarray(x) for x in (q, k, v, g)),
                None if mask is None else jnp.asarray(mask), causal=case.causal,
                scale=scale)
        assert_close(out, one_out, tol, f"{case.name} out vs single device")
        for name, got, want in zip("qkv", grads, one_grads):
            assert_close(got, want, tol, f"{case.name} d{name} vs single device")


def test_ring_runs_eagerly():
    """``jd.sharded`` also runs eagerly (no jit) and gives the reference numbers."""
    q, k, v, g, _, mask = make_inputs(2, 16, 4, 2, 8, "random", seed=7)
    mesh = build_mesh((2,), ("seq",), "explicit")
    attn = jd.sharded(functools.partial(jd.ring_attention, is_causal=True), mesh,
                      seq_axis="seq", layout="zigzag")
    out = attn(*(jnp.asarray(x) for x in (q, k, v)), kv_mask=jnp.asarray(mask))
    want, _, _ = torch_reference(q, k, v, g, mask, causal=True)
    assert_close(out, want, TOL["float64"], "eager out")


# ------------------------------------------------------- direct shard_map, return_lse


LSE_CASES = [
    # (P, layout, causal, mask, dtype, mesh kind)
    (4, "zigzag", True, "empty_row", "float64", "auto"),
    (8, "striped", True, "ragged", "float32", "auto"),
    (2, "contiguous", False, "random", "float64", "explicit"),
]


@pytest.mark.parametrize("p,layout,causal,mask_kind,dtype,mesh_kind", LSE_CASES,
                         ids=["-".join(map(str, c)) for c in LSE_CASES])
def test_shard_map_return_lse(p, layout, causal, mask_kind, dtype, mesh_kind):
    """``jd.ring_attention`` called directly inside ``jax.shard_map(check_vma=True)``.

    Inputs are permuted with ``jd.to_layout`` by hand; the output and the global
    log-sum-exp come back through ``jd.from_layout``. Gradients flow through both
    (loss = sum(g * out) + sum(gl * lse) over rows that have keys).
    """
    b, t, h, hkv, d = 2, 32, 4, 2, 8
    q, k, v, g, gl, mask = make_inputs(b, t, h, hkv, d, mask_kind, seed=11 + p)
    mesh = build_mesh((p,), ("seq",), mesh_kind)
    spec = P(None, "seq")

    def local(q, k, v, mask):
        return jd.ring_attention(q, k, v, seq_axis="seq", is_causal=causal, layout=layout,
                                 kv_mask=mask, return_lse=True)

    ring = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, spec),
                         check_vma=True)

    def place(x):
        x = jd.to_layout(x, p, layout)
        if mesh_kind == "explicit":  # Explicit meshes want the inputs sharded already
            x = jax.sharding.reshard(x, NamedSharding(mesh, spec))
        return x

    def loss(q, k, v, g, gl, mask):
        if mask is None:
            mask = jnp.ones(q.shape[:2], bool)
        o, lse = ring(place(q), place(k), place(v), place(mask))
        o, lse = jd.from_layout(o, p, layout), jd.from_layout(lse, p, layout)
        assert lse.shape == q.shape[:3], lse.shape
        finite = jnp.isfinite(lse)
        total = jnp.sum(g * o) + jnp.sum(jnp.where(finite, gl * lse, 0.0))
        return total, (o, lse)

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    grads, (out, lse) = step(*(to_jax(x, dtype) for x in (q, k, v, g)),
                             jnp.asarray(gl), None if mask is None else jnp.asarray(mask))

    qr, kr, vr, gr = (rounded(x, dtype) for x in (q, k, v, g))
    want_out, want_lse, want_grads = torch_reference(qr, kr, vr, gr, mask, causal=causal,
                                                     gl=gl)
    tol = TOL[dtype]
    assert_close(out, want_out, tol, "out")
    assert_close(lse, want_lse, tol, "lse")  # also checks -inf rows coincide exactly
    for name, got, want in zip("qkv", grads, want_grads):
        assert_close(got, want, tol, f"d{name}")
    if mask_kind == "empty_row":
        assert np.all(np.asarray(out)[1] == 0.0)
        assert np.all(np.isneginf(np.asarray(lse)[1]))
        assert all(np.all(np.isfinite(np.asarray(x))) for x in grads)


# ------------------------------------------------------------- skipping masked steps


def _has_cond_around_scan(jaxpr) -> bool:
    """Whether some ``cond`` in ``jaxpr`` (at any depth) has a branch containing a ``scan``.

    The kernel's own block-skipping conds sit *inside* its scans; a cond whose
    branch holds a whole kernel call (its scans) is the ring's step-level skip.
    """
    def subjaxprs(eqn):
        for val in eqn.params.values():
            for item in val if isinstance(val, (tuple, list)) else (val,):
                inner = getattr(item, "jaxpr", item)
                if hasattr(inner, "eqns"):
                    yield inner

    def contains(jx, name):
        return any(e.primitive.name == name or any(contains(s, name) for s in subjaxprs(e))
                   for e in jx.eqns)

    def walk(jx):
        for e in jx.eqns:
            if e.primitive.name == "cond" and any(contains(s, "scan") for s in subjaxprs(e)):
                return True
            if any(walk(s) for s in subjaxprs(e)):
                return True
        return False

    return walk(jaxpr.jaxpr)


def _ring_fn(p, causal, layout="contiguous"):
    mesh = build_mesh((p,), ("seq",), "explicit")
    return jd.sharded(functools.partial(jd.ring_attention, is_causal=causal), mesh,
                      seq_axis="seq", layout=layout)


def test_causal_ring_has_step_conditional():
    """A causal contiguous ring wraps each step in a conditional; a full ring does not."""
    x = jnp.zeros((1, 16, 2, 8), jnp.float32)
    causal, full = _ring_fn(4, True), _ring_fn(4, False)

    lowered = jax.jit(causal).lower(x, x, x)
    assert "stablehlo.case" in lowered.as_text()
    assert "conditional" in lowered.compile().as_text()
    assert "stablehlo.case" not in jax.jit(full).lower(x, x, x).as_text()

    assert _has_cond_around_scan(jax.make_jaxpr(causal)(x, x, x))
    assert not _has_cond_around_scan(jax.make_jaxpr(full)(x, x, x))
    # the backward ring skips too
    grad = jax.grad(lambda q, k, v: jnp.sum(causal(q, k, v)), argnums=(0, 1, 2))
    assert _has_cond_around_scan(jax.make_jaxpr(grad)(x, x, x))


@pytest.mark.parametrize("layout,causal,mask_kind,expected", [
    # contiguous causal: device d needs the blocks of devices 0..d -> 1+2+3+4
    ("contiguous", True, "none", 10),
    # zigzag / striped causal: every step has work on every device
    ("zigzag", True, "none", 16),
    ("contiguous", False, "none", 16),
    # right padding: T=16, rows valid up to 11 and 5 -> the last shard is fully padded
    ("contiguous", False, "ragged", 12),
])
def test_ring_kernel_calls_counted(monkeypatch, layout, causal, mask_kind, expected):
    """Count, at run time, how many ring steps actually call the kernel's forward."""
    from jax_dilated.backends import xla

    calls = []
    lock = threading.Lock()

    def counting(original):
        def counted(*args, **kwargs):
            out = original(*args, **kwargs)

            def record():
                with lock:
                    calls.append(1)

            jax.debug.callback(record)
            return out

        return counted

    # the ring uses the kernel's ring steps where it has them, else its forward
    monkeypatch.setattr(xla.XlaKernel, "forward", counting(xla.XlaKernel.forward))
    monkeypatch.setattr(xla.ring._RingSteps, "forward", counting(xla.ring._RingSteps.forward))
    p, t = 4, 16
    q, k, v, _, _, mask = make_inputs(2, t, 2, 2, 8, mask_kind, seed=3)
    attn = _ring_fn(p, causal, layout)
    out = jax.jit(lambda q, k, v, m: attn(q, k, v, kv_mask=m))(
        q, k, v, None if mask is None else jnp.asarray(mask))
    jax.block_until_ready(out)
    jax.effects_barrier()
    assert len(calls) == expected, (len(calls), expected)
    want, _, _ = torch_reference(q, k, v, np.zeros(q.shape), mask, causal=causal)
    assert_close(out, want, TOL["float64"], "out")


# -------------------------------------------------------------------------- layouts


@functools.partial(jax.jit, static_argnums=(1, 2))
def _layout_round_trips(x, p, layout):
    """``to_layout`` of ``x``, ``from_layout`` of that, and the round trip of ``x.T`` along
    axis 1: one program (op by op, each of their operations would compile alone)."""
    laid = jd.to_layout(x, p, layout)
    return laid, jd.from_layout(laid, p, layout), jd.from_layout(
        jd.to_layout(x.T, p, layout, axis=1), p, layout, axis=1)


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_layout_round_trip_and_positions(layout, p):
    t = 48
    order = layouts.global_order(t, p, layout)
    assert sorted(order.tolist()) == list(range(t))
    x = np.arange(2 * t * 3).reshape(2, t, 3)
    laid, back, back_t = map(np.asarray, _layout_round_trips(jnp.asarray(x), p, layout))
    np.testing.assert_array_equal(laid, x[:, order])
    np.testing.assert_array_equal(back, x)
    np.testing.assert_array_equal(back_t, x.T)  # other axis
    n = t // p
    for dev in range(p):
        pos = np.asarray(layouts.local_positions(layout, dev, p, n))
        np.testing.assert_array_equal(pos, order[dev * n:(dev + 1) * n])
    # what each layout promises (docs/semantics.md, section 3)
    shards = order.reshape(p, n)
    if layout == "contiguous":
        np.testing.assert_array_equal(shards, np.arange(t).reshape(p, n))
    elif layout == "striped":
        assert all(np.all(shards[d] % p == d) for d in range(p))
    else:
        chunks = np.arange(t).reshape(2 * p, n // 2)
        for dev in range(p):
            np.testing.assert_array_equal(
                shards[dev], np.concatenate([chunks[dev], chunks[2 * p - 1 - dev]]))


def test_local_positions_traced():
    """``local_positions`` accepts the traced ``axis_index`` inside shard_map."""
    p, n, layout = 4, 6, "zigzag"
    mesh = build_mesh((p,), ("seq",), "auto")
    f = jax.shard_map(
        lambda: layouts.local_positions(layout, jax.lax.axis_index("seq"), p, n),
        mesh=mesh, in_specs=(), out_specs=P("seq"), check_vma=True)
    np.testing.assert_array_equal(np.asarray(f()), layouts.global_order(p * n, p, layout))


# --------------------------------------------------------------------------- errors


def _qkv(t=16, b=1, h=2, d=8, tk=None):
    q = jnp.zeros((b, t, h, d), jnp.float32)
    kv = jnp.zeros((b, t if tk is None else tk, h, d), jnp.float32)
    return q, kv, kv


def test_error_axis_not_bound():
    with pytest.raises(ValueError, match="seq_axis"):
        jd.ring_attention(*_qkv(), seq_axis="seq")
    with pytest.raises(ValueError, match="seq_axis"):
        jax.jit(lambda q, k, v: jd.ring_attention(q, k, v, seq_axis="seq"))(*_qkv())


def test_error_axis_not_bound_inside_other_shard_map():
    mesh = build_mesh((2,), ("data",), "auto")
    f = jax.shard_map(lambda q, k, v: jd.ring_attention(q, k, v, seq_axis="seq"),
                      mesh=mesh, in_specs=(P(None, "data"),) * 3, out_specs=P(None, "data"))
    with pytest.raises(ValueError, match="seq_axis='seq'"):
        f(*_qkv())


@pytest.mark.parametrize("layout,t,p,parts", [
    ("contiguous", 18, 4, 4),
    ("striped", 10, 8, 8),
    ("zigzag", 12, 4, 8),   # divisible by P = 4 but not by 2P = 8
    ("zigzag", 6, 2, 4),
])
def test_error_not_divisible(layout, t, p, parts):
    attn = _ring_fn(p, False, layout)
    with pytest.raises(ValueError, match=rf"{t} must be divisible by {parts}"):
        attn(*_qkv(t))
    with pytest.raises(ValueError, match=rf"{t} must be divisible by {parts}"):
        jax.jit(attn)(*_qkv(t))


def test_error_zigzag_odd_shard_direct():
    mesh = build_mesh((2,), ("seq",), "auto")
    f = jax.shard_map(
        lambda q, k, v: jd.ring_attention(q, k, v, seq_axis="seq", layout="zigzag"),
        mesh=mesh, in_specs=(P(None, "seq"),) * 3, out_specs=P(None, "seq"))
    with pytest.raises(ValueError, match="zigzag"):
        f(*_qkv(10))  # shards of 5


def test_error_unknown_layout():
    mesh = build_mesh((2,), ("seq",), "explicit")
    with pytest.raises(ValueError, match="layout must be one of"):
        jd.sharded(jd.ring_attention, mesh, seq_axis="seq", layout="spiral")
    auto = build_mesh((2,), ("seq",), "auto")
    f = jax.shard_map(
        lambda q, k, v: jd.ring_attention(q, k, v, seq_axis="seq", layout="spiral"),
        mesh=auto, in_specs=(P(None, "seq"),) * 3, out_specs=P(None, "seq"))
    with pytest.raises(ValueError, match="spiral"):
        f(*_qkv())
    with pytest.raises(ValueError, match="layout"):
        jd.to_layout(jnp.zeros((1, 8)), 2, "spiral")


def test_error_mismatched_shard_lengths():
    with pytest.raises(ValueError, match="same length"):
        _ring_fn(4, False)(*_qkv(16, tk=24))
    auto = build_mesh((2,), ("seq",), "auto")
    f = jax.shard_map(lambda q, k, v: jd.ring_attention(q, k, v, seq_axis="seq"),
                      mesh=auto, in_specs=(P(None, "seq"),) * 3, out_specs=P(None, "seq"))
    with pytest.raises(ValueError, match="same length"):
        f(*_qkv(8, tk=12))


def test_error_mesh_without_axis():
    mesh = build_mesh((2, 4), ("data", "seq"), "explicit")
    with pytest.raises(ValueError, match="seq_axis='sp'.*not an axis"):
        jd.sharded(jd.ring_attention, mesh, seq_axis="sp")
    with pytest.raises(ValueError, match="batch_axis='batch'"):
        jd.sharded(jd.ring_attention, mesh, seq_axis="seq", batch_axis="batch")
    with pytest.raises(ValueError, match="head_axis='model'"):
        jd.sharded(jd.ring_attention, mesh, seq_axis="seq", head_axis="model")


def test_error_head_axis_not_dividing():
    mesh = build_mesh((2, 4), ("model", "seq"), "explicit")
    attn = jd.sharded(jd.ring_attention, mesh, seq_axis="seq", head_axis="model")
    q = jnp.zeros((1, 16, 4, 8), jnp.float32)
    kv = jnp.zeros((1, 16, 1, 8), jnp.float32)  # one kv head cannot split over 2
    with pytest.raises(ValueError, match="num_kv_heads"):
        attn(q, kv, kv)


def test_error_bad_kv_mask():
    attn = _ring_fn(2, False)
    q, k, v = _qkv(8)
    with pytest.raises(TypeError, match="kv_mask"):
        attn(q, k, v, kv_mask=jnp.ones((1, 8), jnp.float32))
    with pytest.raises(ValueError, match=r"kv_mask must have shape \[batch, seq\] = \(1, 8\), got \(1, 6\)"):
        attn(q, k, v, kv_mask=jnp.ones((1, 6), bool))  # global shapes in the message


def test_error_same_axis_twice():
    mesh = build_mesh((2, 4), ("data", "seq"), "explicit")
    with pytest.raises(ValueError, match="must be different mesh axes"):
        jd.sharded(jd.ring_attention, mesh, seq_axis="seq", batch_axis="seq")


_CONTIGUOUS_OUT = {}  # the contiguous ring's output: the same for both layouts, run once


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_permuted_layout_output_is_sequence_sharded(layout):
    """Outputs come back in token order and sharded like the contiguous ones."""
    mesh = build_mesh((4,), ("seq",), "explicit")
    attn = jd.sharded(functools.partial(jd.ring_attention, is_causal=True), mesh,
                      seq_axis="seq", layout=layout)
    q, k, v = (jnp.asarray(x) for x in make_inputs(1, 16, 2, 2, 8, "none", seed=3)[:3])
    out = jax.jit(attn)(q, k, v)
    assert out.sharding.spec[1] == "seq", out.sharding
    if not _CONTIGUOUS_OUT:
        _CONTIGUOUS_OUT["out"] = np.asarray(jax.jit(jd.sharded(
            functools.partial(jd.ring_attention, is_causal=True), mesh, seq_axis="seq"))(
                q, k, v))
    np.testing.assert_allclose(np.asarray(out), _CONTIGUOUS_OUT["out"], rtol=1e-12,
                               atol=1e-12)


# ------------------------------------------------------------- kernel ring steps


def _ring_loss_grads(mesh, layout, causal, q, k, v, g, mask):
    attn = jd.sharded(functools.partial(jd.ring_attention, is_causal=causal), mesh,
                      seq_axis="seq", layout=layout)

    def loss(q, k, v):
        out = attn(q, k, v, kv_mask=mask)
        return jnp.sum(g * out), out

    grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


@pytest.mark.parametrize("p,layout,causal,mask_kind,split", [
    (4, "contiguous", True, "ragged", True),
    (2, "zigzag", True, "random", False),
    (4, "striped", False, "empty_row", True),
])
def test_ring_steps_several_blocks_match_fallback(monkeypatch, p, layout, causal, mask_kind,
                                                  split):
    """The XLA kernel's ring steps (k/v packed once, accumulators updated in place),
    with several blocks per shard, give the reference numbers and those of the plain
    forward/backward path (the fallback for backends without ring steps). With
    ``split`` the steps visit the heads one kv head (two query heads) at a time, as
    they do at real sizes; without, all heads at once, as at the tiny sizes of the
    other tests."""
    from jax_dilated.backends import xla

    monkeypatch.setattr(xla.layout, "DEFAULT_BLOCK_Q", 4)  # 3 blocks of 4 per shard of 12
    monkeypatch.setattr(xla.layout, "DEFAULT_BLOCK_K", 4)
    if split:
        monkeypatch.setattr(xla.ring, "_ring_block_budget", lambda: 1)
    used = []
    original = xla.ring.ring_steps

    def recording(*args, **kwargs):
        steps = original(*args, **kwargs)
        used.append(steps is not None and steps.num_groups == (2 if split else 1))
        return steps

    monkeypatch.setattr(xla.ring, "ring_steps", recording)
    q, k, v, g, _, mask = make_inputs(2, 48, 4, 2, 8, mask_kind, seed=11)
    mesh = build_mesh((p,), ("seq",), "explicit")
    xs = [jnp.asarray(x) for x in (q, k, v, g)]
    m = None if mask is None else jnp.asarray(mask)
    out, grads = _ring_loss_grads(mesh, layout, causal, *xs, m)
    assert used and all(used), used  # forward and backward took the ring steps

    monkeypatch.setattr(xla.ring, "ring_steps", lambda *a, **kw: None)  # the fallback
    out_fb, grads_fb = _ring_loss_grads(mesh, layout, causal, *xs, m)

    want_out, _, want_grads = torch_reference(q, k, v, g, mask, causal=causal)
    assert_close(out, want_out, TOL["float64"], "out vs torch")
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_fb), rtol=0, atol=1e-12)
    for name, got, fb, want in zip("qkv", grads, grads_fb, want_grads):
        assert_close(got, want, TOL["float64"], f"d{name} vs torch")
        np.testing.assert_allclose(np.asarray(got), np.asarray(fb), rtol=0, atol=1e-12,
                                   err_msg=f"d{name} ring steps vs fallback")


def test_generic_adapter_matches_reference(monkeypatch):
    """The generic ring steps over a kernel's plain forward/backward (what a backend
    without fused ring steps, or with shapes they decline, runs): causal, padded keys,
    P = 4, forward and gradients against the float64 reference."""
    from jax_dilated.ops import ring, ring_steps

    used = []

    def adapter_only(kernel, q, k, args):
        steps = ring_steps.KernelSteps(kernel, args)
        used.append(type(steps))
        return steps

    monkeypatch.setattr(ring, "kernel_steps", adapter_only)
    q, k, v, g, _, mask = make_inputs(2, 48, 4, 2, 8, "ragged", seed=7)
    mesh = build_mesh((4,), ("seq",), "explicit")
    out, grads = _ring_loss_grads(mesh, "contiguous", True,
                                  *(jnp.asarray(x) for x in (q, k, v, g)), jnp.asarray(mask))
    assert used and set(used) == {ring_steps.KernelSteps}, used  # forward and backward
    want_out, _, want_grads = torch_reference(q, k, v, g, mask, causal=True)
    assert_close(out, want_out, TOL["float64"], "out vs torch")
    for name, got, want in zip("qkv", grads, want_grads):
        assert_close(got, want, TOL["float64"], f"d{name} vs torch")


def test_ring_steps_dropout_match_fallback(monkeypatch):
    """Dropout through the ring steps draws the masks of the plain path (same keys per
    step and block), forward and gradients, and differs from no dropout."""
    from jax.sharding import PartitionSpec as PS

    from jax_dilated.backends import KernelArgs, xla
    from jax_dilated.ops.ring import RingConfig, ring_partials

    monkeypatch.setattr(xla.layout, "DEFAULT_BLOCK_Q", 4)
    monkeypatch.setattr(xla.layout, "DEFAULT_BLOCK_K", 4)
    p = 4
    mesh = build_mesh((p,), ("seq",), "auto")
    q, k, v, g, _, _ = (jnp.asarray(x) if x is not None else None
                        for x in make_inputs(2, 48, 4, 2, 8, "none", seed=5))
    rng = jax.random.key(3)

    def grads(rate):
        cfg = RingConfig("seq", p, p, "contiguous",
                         KernelArgs(scale=8 ** -0.5, is_causal=True, dropout_rate=rate),
                         jd.backends.get_kernel(None))
        f = jax.shard_map(lambda q, k, v, r: ring_partials(q, k, v, None, r, cfg)[0],
                          mesh=mesh, in_specs=(PS(None, "seq"),) * 3 + (PS(),),
                          out_specs=PS(None, "seq"))

        def loss(q, k, v):
            out = f(q, k, v, rng)
            return jnp.sum(g * out), out

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    dropped = grads(0.3)
    clean = grads(0.0)
    monkeypatch.setattr(xla.ring, "ring_steps", lambda *a, **kw: None)  # the fallback
    dropped_fb = grads(0.3)
    for got, fb in zip(jax.tree.leaves(dropped), jax.tree.leaves(dropped_fb)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(fb), rtol=0, atol=1e-12)
    assert not np.allclose(np.asarray(dropped[1]), np.asarray(clean[1]))


@XLA_CPU_MEMORY
def test_ring_compiled_memory_per_device():
    """Compiled temp memory of forward+backward per device (memory_analysis is
    deterministic) at the size of the ring's memory target: global n = 32768, 8 heads,
    head_dim 64, float32, causal. At P = 8 no more than 0.2x its value at P = 1 (the
    same ring on one device) and than the single-device kernel.

    Measured: kernel 385 MiB, ring P=1 196 MiB, P=2 133 MiB, P=8 36 MiB (0.18x).
    Before the ring steps visited heads in groups: P=8 56 MiB (0.27x, the per-step
    logits of all 8 heads); before the ring steps: 130 MiB. P=2 also stays below P=1:
    with the first and last ring step outside the forward's loop it took 259 MiB.
    """
    from jax.sharding import PartitionSpec as PS

    from benchmarks.harness import temp_bytes
    from jax_dilated.backends import KernelArgs, xla

    shape, dtype = (1, 32768, 8, 64), jnp.float32

    def temp(f, specs):
        grad = jax.grad(lambda q, k, v, c: jnp.sum(f(q, k, v) * c), argnums=(0, 1, 2))
        return temp_bytes(grad, *specs)

    args = KernelArgs(scale=64 ** -0.5, is_causal=True)
    single = temp(lambda q, k, v: xla.attention(q, k, v, args)[0],
                  [jax.ShapeDtypeStruct(shape, dtype)] * 4)
    ring = {}
    for p in (1, 2, 8):
        mesh = build_mesh((p,), ("seq",), "explicit")
        spec = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PS(None, "seq")))
        ring[p] = temp(_ring_fn(p, True), [spec] * 4)
    assert ring[8] <= 0.2 * ring[1], (ring, ring[8] / ring[1])
    assert ring[2] <= 0.75 * ring[1], (ring, ring[2] / ring[1])
    assert ring[8] <= 0.2 * single, (ring, single, ring[8] / single)
