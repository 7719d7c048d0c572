"""The native CPU kernel (``jax_dilated/backends/native``): its compiled forward
against a float64 reference, gradients through it (the XLA kernel's backward from its
log-sum-exp), which calls it serves, and that ``implementation=None`` runs it on this
CPU inside the library's operations.

Every build this machine can run is tested (``ISAS``, through ``build.using``): the
AVX2 one on every x86-64 CPU with AVX2, the AVX-512 ones where the CPU has them, NEON on
aarch64 (``JD_TEST_NATIVE_BUILDS=machine``: the machine's own build alone). The
reference is the dense softmax of the mathematics (docs/semantics.md, sections 1 and 2)
in float64, independent of both kernels, on the inputs as the
kernel sees them (rounded to bfloat16 / float16 for those); tolerances relative to
the largest reference magnitude: float32 1e-5, bfloat16 2e-2, float16 1e-3.
"""

from __future__ import annotations

import functools
import os
import pathlib
import platform
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _mesh import devices as mesh_devices

import jax_dilated as jd
from jax_dilated.backends import KernelArgs, Masks, native, registry, selection, xla

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu" or native.unavailable_reason() is not None,
    reason=f"the native CPU kernel cannot run here: {native.unavailable_reason()}")

RTOL = 1e-5
HALF_RTOL = {"bfloat16": 2e-2, "float16": 1e-3}
# the builds this machine runs (the machine's own first)
ISAS = tuple(sorted(native.build.available_isas(), key=lambda i: i != native.build.isa()))
if os.environ.get("JD_TEST_NATIVE_BUILDS") == "machine":
    # the machine's own build alone: CI's Python 3.12 leg, which checks the FFI against
    # a newer jaxlib once (its 3.11 leg tests every build)
    ISAS = ISAS[:1]
# and for half-precision inputs, the bfloat16 pair path and the AMX tile path emulated
# on AVX2 (their layouts tested where the CPU has neither unit)
HALF_ISAS = ISAS + (native.build.TEST_BUILDS if "avx2" in ISAS else ())
BF16_PATHS = ("amx", "avx512_bf16", *native.build.TEST_BUILDS)  # builds that multiply bf16


@pytest.fixture(params=ISAS)
def isa(request):
    """Runs the test on one build of the kernel (its programs traced under it)."""
    with native.build.using(isa=request.param):
        assert native.unavailable_reason() is None, native.unavailable_reason()
        yield request.param


@pytest.fixture(params=HALF_ISAS)
def half_isa(request):
    """As ``isa``, over the builds for half-precision inputs (HALF_ISAS)."""
    with native.build.using(isa=request.param):
        assert native.unavailable_reason() is None, native.unavailable_reason()
        yield request.param


def _dense_reference(q, k, v, scale, causal, valid):
    """float64 o [N, Lq, H, D] and lse [N, Lq, H] of the dense softmax (differentiable;
    rows without keys: o = 0, lse = -inf)."""
    q, k, v = (jnp.asarray(x, jnp.float64) for x in (q, k, v))  # (the suite enables x64)
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("nqhd,nkhd->nhqk", q, k) * scale
    allowed = jnp.ones(s.shape, bool)
    if causal:
        allowed &= jnp.tril(jnp.ones(s.shape[-2:], bool))
    if valid is not None:
        valid = jnp.asarray(valid)
        if valid.ndim == 3:  # [N, Lk, Hkv] -> per query head
            allowed &= jnp.repeat(valid, g, axis=2).transpose(0, 2, 1)[:, :, None, :]
        else:
            allowed &= valid[:, None, None, :]
    s = jnp.where(allowed, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
    return jnp.einsum("nhqk,nkhd->nqhd", p, v), lse.transpose(0, 2, 1)


def _inputs(n, lq, lk, h, hkv, d, seed=0, mask=None):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, lq, h, d)).astype(np.float32)
    k = rng.standard_normal((n, lk, hkv, d)).astype(np.float32)
    v = rng.standard_normal((n, lk, hkv, d)).astype(np.float32)
    valid = None
    if mask == "2d":
        valid = rng.random((n, lk)) < 0.6
    elif mask == "3d":
        valid = rng.random((n, lk, hkv)) < 0.6
    return q, k, v, valid


def _close(got, want, rtol=RTOL, what=""):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(np.max(np.abs(want[np.isfinite(want)]), initial=0.0), 1.0)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want), err_msg=what)
    with np.errstate(invalid="ignore"):  # -inf - -inf where both rows are empty
        diff = np.abs(np.where(np.isfinite(want), got - want, 0.0))
    assert diff.max() <= rtol * scale, (what, diff.max() / scale)


def _rounded(x, dtype):
    """x as the kernel sees it in dtype, and that value in float32 (exact)."""
    x = jnp.asarray(x, dtype)
    return x, np.asarray(x.astype(jnp.float32))


@pytest.mark.parametrize("n, lq, lk, h, hkv, d, causal, mask", [
    (2, 300, 300, 4, 4, 64, False, None),
    (2, 300, 300, 4, 2, 64, True, None),      # GQA, causal
    (1, 517, 300, 6, 3, 32, True, "2d"),     # more queries than keys, a kv mask
    (3, 100, 700, 2, 1, 128, False, "3d"),   # per-kv-head mask, long keys
    (1, 47, 1000, 1, 1, 16, True, None),     # fewer queries than keys, causal
    (2, 64, 64, 8, 8, 80, True, "2d"),       # head_dim not a multiple of 64
    (1, 5, 3, 2, 2, 256, False, "2d"),       # the widest head, tiny
])
def test_forward_matches_float64_reference(isa, n, lq, lk, h, hkv, d, causal, mask):
    q, k, v, valid = _inputs(n, lq, lk, h, hkv, d, seed=lq + lk, mask=mask)
    args = KernelArgs(scale=float(d) ** -0.5, is_causal=causal)
    o, lse, lse_lo = jax.jit(lambda q, k, v, m: native.KERNEL.forward(
        q, k, v, args, Masks(kv_valid=m)))(q, k, v, valid)
    want_o, want_lse = _dense_reference(q, k, v, args.scale, causal, valid)
    _close(o, want_o)
    _close(lse, want_lse)
    assert np.all(np.abs(np.asarray(lse_lo)) <= 1e-6 * np.maximum(np.abs(np.asarray(lse)), 1))
    if mask is not None:  # rows whose keys are all masked: zeros and -inf
        assert np.all(np.asarray(o)[~np.isfinite(want_lse)] == 0.0)


def test_rows_without_keys_give_zeros(isa):
    """A batch item whose keys are all masked: o = 0 and lse = -inf, no NaN."""
    q, k, v, _ = _inputs(2, 40, 40, 2, 1, 64, seed=3)
    valid = np.ones((2, 40), bool)
    valid[1] = False
    o, lse, _ = native.KERNEL.forward(q, k, v, KernelArgs(scale=0.125), Masks(kv_valid=valid))
    assert np.all(np.asarray(o)[1] == 0.0) and np.all(np.isneginf(np.asarray(lse)[1]))
    want_o, _ = _dense_reference(q, k, v, 0.125, False, valid)
    _close(np.asarray(o)[0], want_o[0])


def test_gradients_through_the_native_forward(isa):
    """``attention`` runs the native forward and the XLA kernel's backward from its
    log-sum-exp: gradients of o and lse against the float64 dense formula's."""
    q, k, v, valid = _inputs(2, 200, 200, 4, 2, 64, seed=7, mask="2d")
    args = KernelArgs(scale=0.125, is_causal=True)
    rng = np.random.default_rng(8)
    wo = rng.standard_normal(q.shape)
    wl = rng.standard_normal(q.shape[:-1])

    def loss(kernel, dtype):
        def f(q, k, v):
            o, lse, lse_lo = kernel(q, k, v)
            lse = jnp.where(jnp.isfinite(lse), lse + lse_lo, 0.0)
            return jnp.sum(o * wo.astype(dtype)) + jnp.sum(lse * wl.astype(dtype))
        return f

    got = jax.jit(jax.grad(loss(lambda q, k, v: native.KERNEL.attention(
        q, k, v, args, Masks(kv_valid=valid)), jnp.float32), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(lambda q, k, v: (*_dense_reference(
        q, k, v, args.scale, True, valid), 0.0), jnp.float64), argnums=(0, 1, 2))(
        *(jnp.asarray(x, jnp.float64) for x in (q, k, v)))
    for g, w in zip(got, want):
        _close(g, w, rtol=1e-4)


def test_calls_it_does_not_serve_go_to_the_xla_kernel():
    q, k, _, _ = _inputs(1, 16, 16, 2, 2, 64)
    args = KernelArgs(scale=0.125)
    why = functools.partial(native.KERNEL.call_reason, q, k)
    assert why(args) is None
    assert "float32" in native.KERNEL.call_reason(q.astype(np.float64), k, args)
    assert "head_dim 24" in native.KERNEL.call_reason(q[..., :24], k[..., :24], args)
    assert why(KernelArgs(scale=0.1, dropout_rate=0.1)) == "dropout"
    assert why(KernelArgs(scale=0.1, window=(4, 0))) == "a sliding window"
    assert why(KernelArgs(scale=0.1, logit_soft_cap=5.0)) == "logit soft-capping"
    causal = KernelArgs(scale=0.1, is_causal=True)
    assert why(causal, Masks(q_positions=np.arange(16), k_positions=np.arange(16))) is None
    assert "positions other than" in why(causal, Masks(q_positions=np.arange(16) + 3))
    assert why(args, Masks(q_positions=np.arange(16) + 3)) is None  # no mask follows them
    ids = jnp.zeros((1, 16), jnp.int32)
    assert why(args, Masks(q_segment_ids=ids, k_segment_ids=ids)) == "segment ids"
    # and such a call gives the XLA kernel's result, bit for bit
    q64, k64 = (x.astype(np.float64) for x in (q, k))
    for x, y in zip(native.KERNEL.forward(q64, k64, k64, args),
                    xla.KERNEL.forward(q64, k64, k64, args)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_selected_by_default_on_this_cpu():
    """implementation=None on this CPU is the native kernel; 'native' is refused where it
    cannot run, with the reason."""
    assert registry.select_implementation(None) == "native"
    assert registry.get_kernel(None) is native.KERNEL
    assert registry.get_kernel("native") is native.KERNEL
    assert registry.get_kernel("xla") is xla.KERNEL
    h100 = selection.DeviceInfo("gpu", "NVIDIA H100", (9, 0), "cuda")
    with pytest.raises(ValueError, match=r"implementation='native' cannot run here: "
                                         r"it runs on CPUs only \(this device is gpu\)"):
        registry.select_implementation("native", device=h100, software_reason=None)


@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
def test_dilated_attention_runs_it_and_matches_the_xla_kernel(isa, mode):
    """LongNet's dilated attention in float32, forward and gradients: the default
    (native forward) against implementation='xla', and the FFI call is in the program."""
    rng = np.random.default_rng(11)
    q, k, v, ct = (rng.standard_normal((2, 256, 4, 64)).astype(np.float32) for _ in range(4))
    mask = rng.random((2, 256)) < 0.8
    kw = dict(segment_lengths=(64, 128, 256), dilation_rates=(1, 2, 4), mode=mode,
              is_causal=True, kv_mask=mask)

    def run(implementation):
        f = functools.partial(jd.dilated_attention, implementation=implementation, **kw)
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(ct))

    got, want = jax.jit(lambda: run(None))(), jax.jit(lambda: run("xla"))()
    for g, w in zip(got, want):
        _close(g, w, rtol=2e-5)
    hlo = jax.jit(lambda: run(None)).lower().as_text()
    assert native.build.target(native.build.TARGET_DILATED) in hlo


# (T, H, Hkv, mode, head_offsets, causal, mask, segments, rates, shared): shared, whether
# longnet's branches nest so that each shared pair is computed once (nested_order)
_DILATED_CASES = [
    (512, 4, 4, "longnet", "modulo", False, False, (64, 128, 256), (1, 2, 4), True),
    (512, 6, 2, "longnet", "blocked", True, True, (64, 128, 256), (1, 2, 4), False),
    (500, 6, 3, "longnet", "modulo", True, False, (64, 128, 256), (1, 2, 4), True),  # T % w
    (300, 4, 1, "longnet", "modulo", False, True, (128, 512), (2, 4), True),  # w > T, no rate 1
    # key blocks (512) and query tiles cut by the finer branch's segments mid-way (each
    # branch's dilated segments 600 rows: a block and 88 keys, 12.5 tiles of 48)
    (2400, 4, 2, "longnet", "modulo", False, True, (600, 1200, 2400), (1, 2, 4), True),
    (2400, 8, 2, "longnet", "modulo", True, False, (600, 1200, 2400), (1, 2, 4), True),
    (500, 4, 2, "longnet", "modulo", False, True, (6, 12), (1, 4), True),  # stride 4 across 6s
    (300, 4, 4, "longnet", "modulo", True, False, (512, 1024), (1, 2), True),  # one has all
    (256, 4, 2, "longnet", "modulo", False, False, (128, 128), (2, 1), True),  # same segments
    (512, 4, 4, "longnet", "modulo", False, False, (64, 192), (2, 3), False),  # 2 does not divide 3
    (512, 6, 6, "head_groups", "modulo", False, False, (64, 128, 256), (1, 2, 4), False),
    (500, 8, 2, "head_groups", "modulo", True, True, (64, 128, 256), (1, 2, 4), False),
]


@pytest.mark.parametrize("t, h, hkv, mode, offsets, causal, mask, segments, rates, shared",
                         _DILATED_CASES)
def test_dilated_attention_in_one_call_per_pass_matches_float64(
        t, h, hkv, mode, offsets, causal, mask, segments, rates, shared):
    """The fused dilated forward and backward (every branch in one call per pass,
    segments read where they lie, results written in place; longnet continues each
    row's softmax across the branches, and nested branches compute each shared pair
    once, weighted by its multiplicity m) against the same attention in float64 on
    the XLA kernel (which test_parity checks against the PyTorch reference): outputs,
    log-sum-exp and the gradients of both (random cotangents on each) at 1e-5, rows
    of no key included; every build against one reference."""
    rng = np.random.default_rng(t + h + hkv)
    q = rng.standard_normal((2, t, h, 32)).astype(np.float32)
    k, v = (rng.standard_normal((2, t, hkv, 32)).astype(np.float32) for _ in range(2))
    do = rng.standard_normal(q.shape).astype(np.float32)
    dlse = rng.standard_normal(q.shape[:-1]).astype(np.float32)
    kv_mask = rng.random((2, t)) < 0.7 if mask else None
    kw = dict(segment_lengths=segments, dilation_rates=rates, mode=mode,
              head_offsets=offsets, is_causal=causal, kv_mask=kv_mask, return_lse=True)

    def run(q, k, v, implementation=None):
        f = functools.partial(jd.dilated_attention, implementation=implementation, **kw)
        out, vjp = jax.vjp(f, q, k, v)
        lse = out[1]
        # no cotangent flows into rows without keys (their lse is -inf)
        return (*out, *vjp((do.astype(q.dtype),
                            jnp.where(jnp.isfinite(lse), dlse.astype(q.dtype), 0))))

    # (jitted: run eagerly, op by op, the reference took 5x as long at T = 512)
    want = jax.jit(functools.partial(run, implementation="xla"))(
        *(x.astype(np.float64) for x in (q, k, v)))
    for isa in ISAS:  # (the reference is most of the time: one for every build)
        with native.build.using(isa=isa):
            got = jax.jit(run)(q, k, v)
            for name, g, w in zip(("o", "lse", "dq", "dk", "dv"), got, want):
                _close(g, w, what=f"{isa} {name}")
            hlo = jax.jit(run).lower(q, k, v).as_text()
            target = native.build.target
            assert hlo.count(f"@{target(native.build.TARGET_DILATED)}(") == 1, "one forward call"
            assert hlo.count(f"@{target(native.build.TARGET_DILATED_BACKWARD)}(") == 1, \
                "one backward call"
            assert f"@{target(native.build.TARGET)}(" not in hlo and "gather" not in hlo
            assert hlo.count(f"shared_pairs = {str(shared).lower()}") == 2, "both passes"


def _multiplicity(t, w, r, o):
    """[T, T] int: whether branch (w, r) at offset o lets query p attend to key t
    (segments of w tokens, the last one shorter; docs/semantics.md, section 2)."""
    pos = np.arange(t)
    sel = (pos % w) % r == o
    same = pos[:, None] // w == pos[None, :] // w
    return (sel[:, None] & sel[None, :] & same).astype(int)


def test_nested_order_lets_each_pair_be_computed_once():
    """Where nested_order gives an order, for every head and pair (p, t): exactly the
    finest branch that lets the pair attend computes it (its own keys exclude those in
    the query's segment of the next finer branch), with m(p, t) = 1 + min(depth p,
    depth t), depth the coarser branches selecting a position: the kernel's rule
    (attention_cpu.cc, Nesting) against m counted branch by branch, on random
    configurations; and the ones it refuses."""
    from jax_dilated.core import branch_plans as bp

    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(300):
        t, h, nb = int(rng.integers(8, 70)), int(rng.integers(1, 6)), int(rng.integers(2, 4))
        rates = [int(rng.choice([1, 2, 3, 4, 6, 8])) for _ in range(nb)]
        segs = [r * int(rng.integers(1, 10)) for r in rates]
        rule = str(rng.choice(["modulo", "blocked"]))
        plans = bp.plan_branches(list(zip(segs, rates)), seq_len=t, num_heads=h,
                                 num_kv_heads=1, mode="longnet", offsets_rule=rule)
        order = bp.nested_order(plans, t)
        if order is None:
            continue
        checked += 1
        chain = [plans[i] for i in order]
        for j in range(h):
            per = [(p.branch.effective_length, p.branch.rate, int(p.offsets[j])) for p in chain]
            allowed = [_multiplicity(t, *b) for b in per]
            m = sum(allowed)
            owners = np.zeros((t, t), int)
            for b, (w, r, o) in enumerate(per):
                own = allowed[b].astype(bool)
                if b:  # keys in the query's segment of the finer branch are its
                    fw = per[b - 1][0]
                    own &= np.arange(t)[:, None] // fw != np.arange(t)[None, :] // fw
                depth = np.zeros(t, int)
                for _, rc, oc in per[b + 1:]:
                    depth += np.arange(t) % rc == oc
                rule_m = 1 + np.minimum(depth[:, None], depth[None, :])
                np.testing.assert_array_equal(np.where(own, rule_m, m), m)
                owners += own
            np.testing.assert_array_equal(owners, (m > 0).astype(int))
    assert checked > 50, checked
    # and the configurations that do not nest
    def order(segs, rates, t=512, h=8, rule="modulo", mode="longnet"):
        return bp.nested_order(bp.plan_branches(list(zip(segs, rates)), seq_len=t,
                                                num_heads=h, num_kv_heads=1, mode=mode,
                                                offsets_rule=rule), t)

    assert order((256, 64, 128), (4, 1, 2)) == [1, 2, 0]
    assert order((64, 128, 256), (1, 2, 4), rule="blocked") is None  # o_4(2) = 1, o_2(2) = 0
    assert order((64, 192), (2, 3)) is None          # rates
    assert order((96, 128), (1, 2)) is None          # 96 does not divide 128 ...
    assert order((96, 128), (1, 2), t=90) == [0, 1]  # ... one segment each here
    assert order((64, 128), (1, 2), mode="head_groups") is None  # heads run one branch
    assert order((64,), (1,)) is None


def test_shared_pairs_refused_where_branches_do_not_nest(isa):
    """The kernel checks the chain it is told of: branches that do not nest with
    shared_pairs give an error, not a wrong result."""
    from jax_dilated.core import branch_plans as bp

    q = jnp.asarray(np.random.default_rng(1).standard_normal((1, 256, 4, 32)), jnp.float32)
    plans = bp.plan_branches([(64, 1), (128, 2), (256, 4)], seq_len=256, num_heads=4,
                             num_kv_heads=4, mode="longnet", offsets_rule="blocked")
    with pytest.raises(Exception, match="shared pairs: the branches are not nested"):
        jax.block_until_ready(native.native_dilated_forward(
            q, q, q, KernelArgs(scale=0.1), plans, accumulate=True, shared_pairs=True))


def test_dilated_attention_holds_no_sequence_sized_temporary():
    """Compiled, the fused forward's and forward+backward's temporaries are row
    statistics only: under a quarter of one [B, T, H, D] array (the chunked program
    holds chunks of gathered segments, several arrays' worth with the backward)."""
    q = jax.ShapeDtypeStruct((1, 4096, 8, 64), jnp.float32)
    for mode in ("longnet", "head_groups"):
        f = functools.partial(jd.dilated_attention, segment_lengths=(512, 1024, 2048),
                              dilation_rates=(1, 2, 4), mode=mode)
        def grads(q, k, v, do, f=f):
            return jax.vjp(f, q, k, v)[1](do)

        for fn, args in ((f, (q, q, q)), (grads, (q, q, q, q))):
            temp = jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes
            assert temp < 4096 * 8 * 64 * 4 / 4, (mode, fn, temp)


def test_dilated_forward_under_vmap():
    """vmap over dilated attention (the fused call's batch gets the vmapped axis)."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((3, 1, 256, 4, 32)).astype(np.float32) for _ in range(3))
    mask = rng.random((3, 1, 256)) < 0.8
    f = functools.partial(jd.dilated_attention, segment_lengths=(64, 128), dilation_rates=(1, 2),
                          is_causal=True)
    got = jax.vmap(lambda q, k, v, m: f(q, k, v, kv_mask=m))(q, k, v, mask)
    for i in range(3):
        _close(got[i], f(q[i], k[i], v[i], kv_mask=mask[i], implementation="xla"))


def test_vmap_and_a_ring_over_devices():
    """vmap over the kernel call, and ring attention over 2 devices in float32 (the
    ring's own steps are the XLA kernel's; the one-device reference is native)."""
    q, k, v, _ = _inputs(3, 64, 64, 2, 2, 32, seed=5)
    args = KernelArgs(scale=0.2, is_causal=True)
    batched = jax.vmap(lambda q, k, v: native.KERNEL.forward(q[None], k[None], v[None],
                                                             args)[0][0])(q, k, v)
    _close(batched, native.KERNEL.forward(q, k, v, args)[0])
    mesh = jax.sharding.Mesh(mesh_devices(2), ("seq",))
    x = jnp.asarray(np.random.default_rng(6).standard_normal((1, 128, 2, 32)), jnp.float32)
    ring = jd.sharded(functools.partial(jd.ring_attention, is_causal=True), mesh,
                      seq_axis="seq")
    one = jd.dilated_attention(x, x, x, segment_lengths=(128,), dilation_rates=(1,),
                               is_causal=True)
    _close(jax.jit(ring)(x, x, x), one)


def test_build_uses_the_cache_directory(tmp_path):
    """Fresh processes with JAX_DILATED_CACHE set build the library there once: two
    started together (one compiles while the other waits on its lock), then a third
    loads it. The compiler (``$CXX``) is a stand-in that logs its call, takes two
    seconds, and copies the library this process built with the real one: what is
    tested is where the build goes, that it is compiled once and reused, and that no
    temporary file is left; the real compiler's output is every other test's."""
    built = native.build.library()
    assert built is not None, native.build.load()
    calls = tmp_path / "calls"
    compiler = tmp_path / "c++"
    compiler.write_text(
        "#!/bin/sh\n"
        f"echo \"$*\" >> '{calls}'\n"
        "sleep 2\n"
        'while [ "$#" -gt 1 ] && [ "$1" != -o ]; do shift; done\n'
        f"cp '{built.path}' \"$2\"\n")
    compiler.chmod(0o755)
    cache = tmp_path / "cache"
    code = ("from jax_dilated.backends.native import build; import sys; "
            "r = build.load(); print(r); sys.exit(r is not None)")
    env = dict(os.environ, JAX_DILATED_CACHE=str(cache), CXX=str(compiler),
               JAX_DILATED_NATIVE_ISA=built.isa)

    def start():
        return subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    for group in ([start(), start()], [start()]):
        for proc in group:
            out, _ = proc.communicate(timeout=600)
            assert proc.returncode == 0, out
        libs = list(cache.glob(f"attention_cpu-{built.isa}-*.so"))
        assert len(libs) == 1, libs
        assert len(calls.read_text().splitlines()) == 1, calls.read_text()
    assert str(native.build.SOURCE) in calls.read_text()
    assert not list(cache.glob("tmp*"))


def test_backend_report_names_it(capsys):
    """jd.backend_report says which operations run the native forward, in which
    dtypes, and the build's instruction set."""
    report = jd.backend_report(dtype="float32", head_dim=64)
    rows = {r.operation: r.kernel for r in report}
    out = capsys.readouterr().out
    torchscale = {r.operation: r for r in report}["dilated_attention mode='torchscale'"]
    assert torchscale.kernel == "native" and "every branch in one call" in torchscale.reason
    assert f"native CPU kernel: available ({native.instruction_set()} build; float32, " \
           f"bfloat16 and float16 inputs)" in out
    assert native.instruction_set() == native.build.ISA_NAMES[ISAS[0]]
    assert rows["dilated_attention mode='head_groups'"] == "native"
    assert rows["dilated_attention mode='longnet'"] == "native"
    assert rows["ring_attention is_causal=False"] == "xla"  # the XLA kernel's ring steps
    assert rows["block_sparse_attention"] == "xla"
    assert all(r.kernel == "xla" for r in jd.backend_report(dtype="float64", quiet=True))
    half = jd.backend_report(dtype="float16", head_dim=64, quiet=True)
    assert half[0].operation == "dilated_attention mode='longnet'" and half[0].kernel == "native"


# ------------------------------------------------------------ half precision


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_forward(half_isa, dtype):
    """bfloat16 / float16 inputs to the plain call: converted where the kernel packs
    them, float32 arithmetic, the output in the input dtype and the log-sum-exp in
    float32, against the float64 reference on the rounded inputs; and such calls are
    the native kernel's."""
    q, k, v, valid = _inputs(2, 150, 200, 4, 2, 64, seed=21, mask="2d")
    (q, q32), (k, k32), (v, v32) = (_rounded(x, dtype) for x in (q, k, v))
    args = KernelArgs(scale=0.125, is_causal=True)
    assert native.KERNEL.call_reason(q, k, args) is None
    o, lse, _ = jax.jit(lambda q, k, v: native.KERNEL.forward(q, k, v, args,
                                                                   Masks(kv_valid=valid)))(
        q, k, v)
    assert o.dtype == jnp.dtype(dtype) and lse.dtype == jnp.float32
    want_o, want_lse = _dense_reference(q32, k32, v32, args.scale, True, valid)
    _close(o, want_o, HALF_RTOL[dtype])
    _close(lse, want_lse, RTOL)  # nothing of lse is rounded to the input dtype


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("mode", ["longnet", "head_groups"])
def test_half_precision_dilated_attention(dtype, mode):
    """Dilated attention on bfloat16 / float16 inputs runs the fused native passes
    (forward and backward) on every build: output and gradients in the input dtype,
    against the dense float64 form (_dilated_reference) on the rounded inputs and
    cotangent."""
    rng = np.random.default_rng(5)
    t, h, hkv = 200, 4, 2
    (q, q32), (k, k32), (v, v32), (do, do32) = (
        _rounded(rng.standard_normal(shape), dtype)
        for shape in ((2, t, h, 32), (2, t, hkv, 32), (2, t, hkv, 32), (2, t, h, 32)))
    branches, mask = ((32, 1), (64, 2), (128, 4)), rng.random((2, t)) < 0.8
    kw = dict(segment_lengths=[w for w, _ in branches], dilation_rates=[r for _, r in branches],
              mode=mode, is_causal=True, kv_mask=mask)

    def run(q, k, v, do):
        out, vjp = jax.vjp(functools.partial(jd.dilated_attention, **kw), q, k, v)
        return (out, *vjp(do))

    o, _, *grads = _dilated_reference(q32, k32, v32, do32, np.zeros(q.shape[:-1]), branches,
                                      mode, True, 32 ** -0.5, kv_mask=mask)
    for isa in HALF_ISAS:
        with native.build.using(isa=isa):
            got = jax.jit(run)(q, k, v, do)
            for name, g, w in zip(("o", "dq", "dk", "dv"), got, (o, *grads)):
                assert g.dtype == jnp.dtype(dtype), (isa, name, g.dtype)
                _close(g, w, HALF_RTOL[dtype], what=f"{isa} {name}")
            hlo = jax.jit(run).lower(q, k, v, do).as_text()
            for call in (native.build.TARGET_DILATED, native.build.TARGET_DILATED_BACKWARD):
                assert f"@{native.build.target(call)}(" in hlo, call


@pytest.mark.skipif("avx2" not in ISAS, reason="the emulated bfloat16 build needs AVX2")
def test_a_build_that_fails_its_self_test_is_refused_or_passed_over(monkeypatch):
    """A build that multiplies bfloat16 itself runs its self-test (a child process)
    once; its verdict is cached beside the library. Asked for by name, a failing build
    is refused with the reason; as the machine's choice, the next build down is used
    (as for a build that does not compile)."""
    build = native.build
    with build.using(isa=build.EMULATED):
        assert build.load() is None
        path = build.library().path
    assert build._self_test(path) is None
    assert path.with_suffix(".selftest").read_text() == "ok"
    monkeypatch.setattr(build, "_self_test", lambda path: "its self-test computed a wrong result")
    reason, lib = build._load_once.__wrapped__(build.EMULATED, None)
    assert lib is None and "its self-test computed a wrong result" in reason
    choose = build._choose_isa
    monkeypatch.setattr(build, "_choose_isa",
                        lambda r: build.EMULATED if r is None else choose(r))
    monkeypatch.setattr(build, "FALLBACK", {build.EMULATED: "avx2"})
    reason, lib = build._load_once.__wrapped__(None, None)
    assert reason is None and lib.isa == "avx2"


@pytest.mark.skipif(not any(i in HALF_ISAS for i in BF16_PATHS),
                    reason="no build with the bfloat16 pair path runs on this CPU")
@pytest.mark.parametrize("lq,lk,d,causal", [(150, 201, 64, True), (77, 77, 48, False),
                                            (33, 513, 80, False), (600, 601, 32, True)])
def test_bfloat16_pairs_multiply_the_inputs_as_stored(lq, lk, d, causal):
    """The bfloat16 pair path (avx512_bf16's vdpbf16ps, amx's tiles, or their
    emulations on AVX2): S = q k^T from the bfloat16 inputs with float32 sums, so the
    log-sum-exp is float32-exact against the float64 reference on the rounded inputs;
    P rounded to bfloat16 for P v, so the output is within bfloat16's tolerance and not
    the float32-P build's. Odd key counts (a value row without its pair partner), head
    dims that the tiles pad (48, 80), two key blocks, several query tiles, masks,
    causal; float32 inputs unchanged."""
    q, k, v, valid = _inputs(2, lq, lk, 4, 2, d, seed=lk, mask="2d")
    (qb, q32), (kb, k32), (vb, v32) = (_rounded(x, "bfloat16") for x in (q, k, v))
    args = KernelArgs(scale=d ** -0.5, is_causal=causal)
    want_o, want_lse = _dense_reference(q32, k32, v32, args.scale, causal, valid)

    def forward(*qkv):
        return jax.jit(lambda q, k, v: native.KERNEL.forward(q, k, v, args, Masks(kv_valid=valid)))(
            *qkv)[:2]

    got = {}
    for isa in [i for i in HALF_ISAS if i in (*BF16_PATHS, "avx2")]:
        with native.build.using(isa=isa):
            o, lse = forward(qb, kb, vb)
            _close(lse, want_lse, RTOL, what=isa)
            _close(o, want_o, HALF_RTOL["bfloat16"], what=isa)
            got[isa] = (np.asarray(o.astype(jnp.float32)), forward(q32, k32, v32)[0])
    for emulated in set(native.build.TEST_BUILDS) & set(got):  # paths for bfloat16 alone
        assert not np.array_equal(got[emulated][0], got["avx2"][0]), emulated
        np.testing.assert_array_equal(got[emulated][1], got["avx2"][1])


@pytest.mark.skipif(not any(i in HALF_ISAS for i in BF16_PATHS),
                    reason="no build with the bfloat16 pair path runs on this CPU")
@pytest.mark.parametrize("d,mode,causal", [(48, "longnet", True), (80, "head_groups", False)])
def test_bfloat16_backward_multiplies_the_inputs_as_stored(d, mode, causal):
    """The fused dilated backward on the bfloat16 builds (avx512_bf16's pairs, amx's
    tiles, or their emulations): s and dp from q, k, v and do as stored, p c and
    scale ds rounded to bfloat16 for dv, dk and dq; the gradients within bfloat16's
    tolerance of the float64 reference on the rounded inputs, and not the converting
    build's. Head dims the tiles pad (48 to 64, 80 to 96), 203 rows (several query
    tiles of the backward, a last segment short of its length, odd key counts), a
    padding mask."""
    rng = np.random.default_rng(d)
    t, h, hkv = 203, 4, 2
    (q, q32), (k, k32), (v, v32), (do, do32) = (
        _rounded(rng.standard_normal(shape), "bfloat16")
        for shape in ((1, t, h, d), (1, t, hkv, d), (1, t, hkv, d), (1, t, h, d)))
    branches, mask = ((64, 1), (128, 2)), rng.random((1, t)) < 0.85
    kw = dict(segment_lengths=[w for w, _ in branches], dilation_rates=[r for _, r in branches],
              mode=mode, is_causal=causal, kv_mask=mask)
    _, _, *want = _dilated_reference(q32, k32, v32, do32, np.zeros(q.shape[:-1]), branches,
                                     mode, causal, d ** -0.5, kv_mask=mask)

    def grads(q, k, v, do):
        return jax.vjp(functools.partial(jd.dilated_attention, **kw), q, k, v)[1](do)

    got = {}
    for isa in [i for i in HALF_ISAS if i in (*BF16_PATHS, "avx2")]:
        with native.build.using(isa=isa):
            got[isa] = jax.jit(grads)(q, k, v, do)
            for name, g, w in zip(("dq", "dk", "dv"), got[isa], want):
                _close(g, w, HALF_RTOL["bfloat16"], what=f"{isa} {name}")
    for emulated in set(native.build.TEST_BUILDS) & set(got):  # the bfloat16 path ran
        assert not np.array_equal(np.asarray(got[emulated][0], np.float32),
                                  np.asarray(got["avx2"][0], np.float32)), emulated


# ------------------------------------------- rates that do not divide the segment


def _dilated_reference(q, k, v, do, dlse, branches, mode, causal, scale, kv_mask=None):
    """float64 (o, lse, dq, dk, dv) of dilated attention by its dense form
    (docs/semantics.md, section 2) with ``do`` and ``dlse`` the cotangents: longnet's
    logits are ``scale q.k + log m(p, t)``, m the branches that let p attend to t;
    head_groups' head j of group i runs branch i alone at offset i mod r_i, the
    output divided by the number of groups. ``kv_mask`` None or [B, T] bool."""
    b, t, h, _ = q.shape
    g = h // k.shape[2]
    nb = len(branches)
    sizes = [h // nb + (i < h % nb) for i in range(nb)]
    group = np.repeat(np.arange(nb), sizes)
    m = np.zeros((h, t, t))
    for j in range(h):
        for i, (w, r) in enumerate(branches):
            if mode == "longnet":
                m[j] += _multiplicity(t, w, r, j % r)
            elif group[j] == i:
                m[j] += _multiplicity(t, w, r, i % r)
    if causal:
        m *= np.tril(np.ones((t, t)))
    m = m[None] * (1 if kv_mask is None else np.asarray(kv_mask)[:, None, None, :])
    allowed, has = m > 0, (m > 0).any(-1)
    log_m = np.log(np.maximum(m, 1))
    out_scale = 1.0 if mode == "longnet" else 1.0 / nb

    def f(q, k, v):
        kr, vr = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, kr) * scale + log_m
        # (rows without keys take the log-sum-exp of zeros: no NaN in the gradient)
        lse = jax.nn.logsumexp(jnp.where(has[..., None], jnp.where(allowed, s, -jnp.inf), 0.0),
                               axis=-1)
        p = jnp.where(allowed, jnp.exp(s - lse[..., None]), 0.0)
        return (jnp.einsum("bhqk,bkhd->bqhd", p, vr) * out_scale,
                jnp.where(has, lse, -jnp.inf).transpose(0, 2, 1))

    (o, lse), vjp = jax.vjp(f, *(jnp.asarray(x, jnp.float64) for x in (q, k, v)))
    return (o, lse, *vjp((jnp.asarray(do, jnp.float64),
                          jnp.where(jnp.isfinite(lse), jnp.asarray(dlse, jnp.float64), 0.0))))


@pytest.mark.parametrize("mode", ["longnet", "head_groups"])
@pytest.mark.parametrize("causal", [False, True])
def test_rates_that_do_not_divide_the_segment(mode, causal):
    """A segment's dilated rows at offset o are ceil((w - o) / r) (docs/semantics.md,
    section 2: r need not divide w; the last segment shorter): segments of 12 at
    rate 5 and of 20 at rate 3 over T = 40, grouped-query heads, run by the fused
    native passes; output, log-sum-exp and gradients against float64 on every build."""
    branches, t, h, hkv, d = [(12, 5), (20, 3)], 40, 4, 2, 16
    rng = np.random.default_rng(12)
    q = rng.standard_normal((2, t, h, d)).astype(np.float32)
    k, v = (rng.standard_normal((2, t, hkv, d)).astype(np.float32) for _ in range(2))
    do = rng.standard_normal(q.shape).astype(np.float32)
    dlse = rng.standard_normal(q.shape[:-1]).astype(np.float32)
    scale = 0.3
    want = _dilated_reference(q, k, v, do, dlse, branches, mode, causal, scale)
    kw = dict(segment_lengths=[w for w, _ in branches], dilation_rates=[r for _, r in branches],
              mode=mode, is_causal=causal, scale=scale, return_lse=True)

    def run(q, k, v):
        (o, lse), vjp = jax.vjp(functools.partial(jd.dilated_attention, **kw), q, k, v)
        return (o, lse, *vjp((do, jnp.where(jnp.isfinite(lse), dlse, 0.0))))

    for isa in ISAS:
        with native.build.using(isa=isa):
            got = jax.jit(run)(q, k, v)
            for name, g, w in zip(("o", "lse", "dq", "dk", "dv"), got, want):
                _close(g, w, what=f"{isa} {name}")
            hlo = jax.jit(run).lower(q, k, v).as_text()
            for call in (native.build.TARGET_DILATED, native.build.TARGET_DILATED_BACKWARD):
                assert hlo.count(f"@{native.build.target(call)}(") == 1, call


# ------------------------------------------------------------ the builds


def test_each_build_is_chosen_forced_or_refused(monkeypatch, tmp_path):
    """The machine's build by default (AVX-512 where the CPU has it), every build
    this machine can run under ``build.using`` or ``JAX_DILATED_NATIVE_ISA``, each
    registering calls of its own; what the CPU lacks, an unknown name and a source
    that does not compile are refused with the reason."""
    build = native.build
    flags = build.cpu_flags()
    monkeypatch.delenv(build.ISA_ENV, raising=False)
    if build.isa() in ("amx", "avx512_bf16", "avx512", "avx2"):
        assert build.isa() == ("avx2" if "avx512f" not in flags else
                               "amx" if {"avx512_bf16", "amx_bf16", "amx_tile"} <= flags else
                               "avx512_bf16" if "avx512_bf16" in flags else "avx512")
        assert "avx2" in ISAS  # the AVX2 build is tested on every x86-64 CPU with AVX2
    targets = set()
    for isa in ISAS:
        with build.using(isa=isa):
            assert build.load() is None and build.isa() == isa
            assert native.instruction_set() == build.ISA_NAMES[isa]
            targets.add(build.target(build.TARGET_DILATED))
        monkeypatch.setenv(build.ISA_ENV, isa)
        assert build.isa() == isa
    assert len(targets) == len(ISAS)
    for isa in set(build.ISAS) - set(ISAS):
        with build.using(isa=isa):
            assert build.isa() is None and "needs" in build.load(), build.load()
            assert registry.native_reason(selection.DeviceInfo("cpu", "cpu")) == build.load()
    for test_build in build.TEST_BUILDS if "avx2" in ISAS else ():  # asked for by name
        with build.using(isa=test_build):
            assert build.load() is None and build.isa() == test_build
            assert native.instruction_set() == build.ISA_NAMES[test_build]
    monkeypatch.setenv(build.ISA_ENV, "sse2")
    assert ("JAX_DILATED_NATIVE_ISA='sse2' is not one of amx, avx512_bf16, avx512, avx2, "
            "neon, avx2_bf16emu, avx2_amxemu") in build.load()
    monkeypatch.delenv(build.ISA_ENV)
    broken = tmp_path / "attention_cpu.cc"
    broken.write_text("#error this source does not compile\n")
    monkeypatch.setenv("JAX_DILATED_CACHE", str(tmp_path))
    with build.using(source=broken):
        assert build.load().startswith("it did not build or load (RuntimeError")
    assert build.load() is None


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not shutil.which("objdump")
                    or not shutil.which(os.environ.get("CXX", "c++")),
                    reason="needs an x86-64 machine, a C++ compiler and objdump (binutils)")
def test_the_amx_build_compiles_on_any_x86_64_cpu(tmp_path):
    """The ``amx`` build, whose code holds the ``avx512_bf16`` build's bfloat16 pair
    path besides the tile path, compiles for a Sapphire Rapids on any x86-64 machine
    (``-march=native`` replaced), with both bfloat16 instructions in its code: a change
    that breaks the builds only CPUs with bfloat16 units run fails on every machine
    that runs the tests. (Without optimisations, -O0: a third of the time, and the
    question is whether it compiles, not how fast its code runs.)"""
    build = native.build
    replace = {"-march=native": "-march=sapphirerapids", "-O3": "-O0"}
    flags = tuple(replace.get(f, f) for f in (*build._FLAGS, *build._ISA_FLAGS["amx"]))
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    library = tmp_path / "amx.so"
    try:
        build._compile(compiler, flags, (build.SOURCE, build.GEMM_SOURCE),
                       jax.ffi.include_dir(), tmp_path, library)
    except RuntimeError as err:
        # A compiler older than Sapphire Rapids (GCC < 11) cannot build the amx build
        # at all: the machine's choice then falls back to the next build down
        # (build.FALLBACK), so there is nothing of ours to check.
        if "sapphirerapids" in str(err):
            pytest.skip(f"this compiler does not know Sapphire Rapids ({err})")
        raise
    code = subprocess.run(["objdump", "-d", str(library)], capture_output=True, text=True,
                          check=True).stdout
    assert "tdpbf16ps" in code and "vdpbf16ps" in code  # AMX tiles; AVX512-BF16 pairs


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64")
                    or not {"avx2", "fma"} <= native.build.cpu_flags()
                    or not shutil.which(os.environ.get("CXX", "c++")),
                    reason="needs an x86-64 CPU with AVX2 and FMA and a C++ compiler")
def test_kernel_arithmetic_on_this_cpu(tmp_path):
    """The AVX2 build's arithmetic in isolation (tests/native_kernel_check.cc, as the
    NEON build's under qemu below): exp's error against what a softmax needs, the
    half-precision conversions, a forward and a backward item against double precision.
    (-O1: the kernel's vector code is its intrinsics, so the level changes the time to
    compile, not the arithmetic.)"""
    build = native.build
    flags = tuple("-O1" if f == "-O3" else f for f in build._FLAGS if f not in ("-shared", "-fPIC"))
    binary = tmp_path / "check"
    compiled = subprocess.run(
        [shutil.which(os.environ.get("CXX", "c++")), *flags, *build._ISA_FLAGS["avx2"],
         "-isystem", jax.ffi.include_dir(), "-I", str(build.SOURCE.parent),
         str(pathlib.Path(__file__).with_name("native_kernel_check.cc")), "-o", str(binary)],
        capture_output=True, text=True, timeout=600)
    assert compiled.returncode == 0, compiled.stderr[-2000:]
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.startswith("build: avx2"), run.stdout + run.stderr
    assert run.stdout.rstrip().endswith("all passed"), run.stdout


@pytest.mark.skipif(not (shutil.which("aarch64-linux-gnu-g++") and shutil.which("qemu-aarch64")),
                    reason="needs an aarch64 cross compiler and qemu-aarch64 (Debian: "
                           "g++-aarch64-linux-gnu, qemu-user)")
def test_aarch64_build_under_qemu(tmp_path):
    """The NEON build, where this machine cannot run it: the kernel's source compiles
    for aarch64, and its arithmetic (exp, conversions, a forward and a backward item,
    float32 and half precision; tests/native_kernel_check.cc) passes under qemu."""
    check = pathlib.Path(__file__).with_name("native_kernel_check.cc")
    binary = tmp_path / "check"
    build = subprocess.run(
        ["aarch64-linux-gnu-g++", "-O2", "-march=armv8-a", "-std=c++17", "-static", "-pthread",
         "-Wall", "-Wextra", "-isystem", jax.ffi.include_dir(),
         "-I", str(native.build.SOURCE.parent), str(check), "-o", str(binary)],
        capture_output=True, text=True, timeout=600)
    assert build.returncode == 0 and "warning" not in build.stderr, build.stderr[-2000:]
    run = subprocess.run(["qemu-aarch64", str(binary)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0 and run.stdout.startswith("build: neon"), run.stdout + run.stderr
    assert run.stdout.rstrip().endswith("all passed"), run.stdout
