"""Distributed dilated attention: ``dilated_attention(seq_axis=...)`` equals one device.

The single-device ``jd.dilated_attention`` is itself checked against the PyTorch
references (test_parity.py); here every sharded configuration, forward and the
gradients of q, k and v, is compared with it on the same global inputs:

* float32 at 1e-5 relative (both sides float32, so this is rounding of two
  different summation orders), and float64 at 1e-10 for a few cases;
* segment layouts: all local, spanning 2 devices, spanning all devices, longer than
  the whole sequence, and the mixed set [n/2, n, 2n, 8n] with rates [1, 2, 4, 8];
* causal and not, both modes and both head-offset rules, GQA, key padding masks
  (with a fully padded batch row), 2, 4 and 8 devices, ``jd.sharded`` on Explicit
  and Auto meshes, a data x seq mesh, and a direct ``jax.shard_map``.

Also: no collective in the compiled program when every segment is local, the
expected ring collectives when one spans devices, dropout, and the input errors.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import XLA_CPU_MEMORY
from _mesh import build_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_dilated as jd
from jax_dilated.ops import distributed

TOL = {"float32": 1e-5, "float64": 1e-10}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    p: int                      # devices on the sequence axis
    n: int                      # tokens per device
    segments: tuple
    rates: tuple
    causal: bool = False
    mode: str = "longnet"
    offsets: str = "modulo"
    heads: int = 4
    kv_heads: int = 4
    mask: bool = False
    dtype: str = "float32"
    mesh: str = "explicit"
    data: int = 1               # devices on a batch axis too

    @property
    def config(self):
        return dict(segment_lengths=self.segments, dilation_rates=self.rates,
                    mode=self.mode, head_offsets=self.offsets, is_causal=self.causal)


CASES = [
    # all segments local (no communication); two branches are enough for that
    Case("local_p4", 4, 16, (4, 16), (1, 4)),
    Case("local_p8_causal_mask", 8, 8, (4, 8), (1, 2), causal=True, mask=True),
    # a segment spanning 2 devices
    Case("span2_p2", 2, 16, (8, 32), (1, 2)),
    Case("span2_p4_causal_gqa", 4, 8, (8, 16), (2, 4), causal=True, kv_heads=2),
    # a segment spanning all devices
    Case("spanall_p8_causal", 8, 8, (8, 64), (1, 4), causal=True),
    Case("spanall_p4_head_groups", 4, 8, (32,), (2,), mode="head_groups", heads=2,
         kv_heads=1),
    # a segment longer than the whole sequence
    Case("longer_p4_causal_mask", 4, 8, (8, 100), (2, 4), causal=True, mask=True),
    Case("longer_p2_float64", 2, 12, (6, 1000), (3, 4), causal=True, dtype="float64"),
    # the mixed set [n/2, n, 2n, 8n] / [1, 2, 4, 8]
    Case("mixed_p8", 8, 16, (8, 16, 32, 128), (1, 2, 4, 8)),
    Case("mixed_p8_causal_gqa_mask", 8, 16, (8, 16, 32, 128), (1, 2, 4, 8), causal=True,
         heads=8, kv_heads=2, mask=True),
    Case("mixed_p8_blocked", 8, 16, (8, 16, 32, 128), (1, 2, 4, 8), causal=True,
         offsets="blocked", heads=6, kv_heads=3, mesh="auto"),
    Case("mixed_p4_head_groups_causal", 4, 16, (8, 16, 32, 128), (1, 2, 4, 8),
         causal=True, mode="head_groups", heads=6, kv_heads=2, mask=True),
    Case("mixed_p4_float64", 4, 16, (8, 16, 32, 64), (1, 2, 4, 8), causal=True,
         kv_heads=2, mask=True, dtype="float64", mesh="auto"),
    # batch sharded too
    Case("data2_seq4_causal", 4, 8, (4, 16, 32), (1, 2, 4), causal=True, mask=True,
         data=2),
]


def _inputs(case: Case, batch=2, head_dim=8):
    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    t = case.p * case.n
    dt = np.dtype(case.dtype)
    q = rng.standard_normal((batch, t, case.heads, head_dim)).astype(dt)
    k, v = (rng.standard_normal((batch, t, case.kv_heads, head_dim)).astype(dt)
            for _ in range(2))
    g = rng.standard_normal(q.shape).astype(dt)
    mask = None
    if case.mask:
        mask = rng.random((batch, t)) > 0.3
        mask[-1] = False  # a fully padded batch row: zeros, finite gradients
    return q, k, v, g, mask


def _value_and_grads(attn, q, k, v, g, mask):
    def loss(q, k, v):
        out = attn(q, k, v, kv_mask=mask)
        return jnp.sum(out.astype(jnp.float64) * g), out

    grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1.0))


# one device's output and gradients, by case: test_ring_steps_by_head_group_with_per_head_masks
# runs a case of CASES again (on other ring steps), against the same reference
_ONE_DEVICE = {}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_sharded_equals_single_device(case: Case):
    q, k, v, g, mask = _inputs(case)
    names = ("data", "seq") if case.data > 1 else ("seq",)
    shape = (case.data, case.p) if case.data > 1 else (case.p,)
    mesh = build_mesh(shape, names, case.mesh)
    fn = functools.partial(jd.dilated_attention, **case.config)
    attn = jd.sharded(fn, mesh, seq_axis="seq",
                      batch_axis="data" if case.data > 1 else None)
    m = None if mask is None else jnp.asarray(mask)
    args = [jnp.asarray(x) for x in (q, k, v, g)]
    out, grads = _value_and_grads(attn, *args, m)
    if case not in _ONE_DEVICE:
        with jax.default_device(jax.devices()[0]):
            _ONE_DEVICE[case] = _value_and_grads(fn, *args, m)
    want, want_grads = _ONE_DEVICE[case]
    assert out.dtype == q.dtype and out.shape == q.shape
    tol = TOL[case.dtype]
    assert _rel(out, want) <= tol, ("out", _rel(out, want))
    for name, got, exp in zip("qkv", grads, want_grads):
        assert _rel(got, exp) <= tol, (f"d{name}", _rel(got, exp))
    if mask is not None:
        assert np.all(np.asarray(out)[-1] == 0.0)
        assert all(np.all(np.isfinite(np.asarray(gr))) for gr in grads)


def test_ring_steps_by_head_group_with_per_head_masks(monkeypatch):
    """Spanning branches through the kernel's ring steps one kv head at a time: the
    dilated rings hand the steps per-kv-head key validity ([N, n, Hkv]), which is cut
    per head group. Equal to single-device dilated attention (CASES' longer_p4_causal_mask:
    4 kv heads, a padding mask, a ring over the 4 devices; its reference is shared)."""
    from jax_dilated.backends import xla

    monkeypatch.setattr(xla.ring, "_ring_block_budget", lambda: 1)
    groups = []
    original = xla.ring.ring_steps

    def recording(*args, **kwargs):
        steps = original(*args, **kwargs)
        groups.append(None if steps is None else steps.num_groups)
        return steps

    monkeypatch.setattr(xla.ring, "ring_steps", recording)
    test_sharded_equals_single_device(next(c for c in CASES
                                           if c.name == "longer_p4_causal_mask"))
    assert groups and max(g or 0 for g in groups) > 1, groups


def _shard_map_fn(mesh, config, axis="seq"):
    spec = P(None, axis)
    local = functools.partial(jd.dilated_attention, seq_axis=axis, **config)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
                         check_vma=True)


def test_direct_shard_map_with_check_vma():
    """Inside the user's own ``jax.shard_map`` (check_vma=True) on local shards."""
    case = Case("direct", 4, 8, (4, 16, 64), (1, 2, 4), causal=True, kv_heads=2)
    q, k, v, g, _ = _inputs(case)
    mesh = build_mesh((4,), ("seq",), "auto")
    qkv, ct = [jnp.asarray(x) for x in (q, k, v)], jnp.asarray(g)

    def fwd_bwd(f):
        def run(q, k, v, ct):
            out, vjp = jax.vjp(f, q, k, v)
            return out, vjp(ct)
        return jax.jit(run)(*qkv, ct)

    out, grads = fwd_bwd(_shard_map_fn(mesh, case.config))
    want, want_grads = fwd_bwd(functools.partial(jd.dilated_attention, **case.config))
    assert _rel(out, want) <= 1e-5
    for got, exp in zip(grads, want_grads):
        assert _rel(got, exp) <= 1e-5


def _compiled_hlo(config, p=8, n=16):
    """HLO text of the compiled forward + backward on ``p`` devices, inputs sharded."""
    mesh = build_mesh((p,), ("seq",), "auto")
    f = _shard_map_fn(mesh, config)

    def fwd_bwd(q, k, v, ct):
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(ct)

    x = jax.ShapeDtypeStruct((1, p * n, 4, 8), jnp.float32)
    sharding = NamedSharding(mesh, P(None, "seq"))
    return jax.jit(fwd_bwd, in_shardings=sharding).lower(x, x, x, x).compile().as_text()


COLLECTIVE = re.compile(r"collective-permute|all-gather|all-reduce|all-to-all|"
                        r"reduce-scatter|collective-broadcast")


def test_local_segments_compile_without_collectives():
    """At P = 8 with every segment inside a shard nothing is communicated."""
    hlo = _compiled_hlo(dict(segment_lengths=(4, 8, 16), dilation_rates=(1, 2, 4),
                             is_causal=True))
    assert COLLECTIVE.search(hlo) is None, COLLECTIVE.findall(hlo)[:5]


def test_spanning_segment_compiles_to_ring_permutes():
    """The control: a segment over all 8 devices communicates, by collective-permute only."""
    hlo = _compiled_hlo(dict(segment_lengths=(16, 128), dilation_rates=(1, 4),
                             is_causal=True))
    found = set(COLLECTIVE.findall(hlo))
    assert "collective-permute" in found, found
    assert found <= {"collective-permute"}, found


def test_spanning_ring_sends_only_dilated_blocks():
    """Every permute of a rate-r branch spanning devices moves n/r tokens, not n."""
    n, r = 16, 4
    hlo = _compiled_hlo(dict(segment_lengths=(128,), dilation_rates=(r,)), n=n)
    shapes = re.findall(r"= \(?f32\[([\d,]+)\][^\n]*collective-permute", hlo)
    assert shapes, "no collective-permute found"
    for dims in shapes:
        # n/r tokens of the 4 kv heads of head_dim 8 (B = 1), in whatever layout the
        # kernel's ring steps keep key/value blocks in
        assert np.prod([int(x) for x in dims.split(",")]) == (n // r) * 4 * 8, dims


@XLA_CPU_MEMORY
@pytest.mark.parametrize("devices, bound", [(2, 5), (8, 12)])
def test_memory_per_device_streams_local_branches(devices, bound):
    """Compiled forward+backward temp per device (memory_analysis is deterministic) of
    longnet over 2 and 8 devices, n=16384, 8 heads x 64, float32, causal, segments
    512/1024/4096/16384 at rates 1/2/8/16: at most ``bound`` shard-sized arrays
    ([1, n / P, 8, 64]).

    Measured: 3.3 arrays at P=2 (53.6 MiB), 8.5 at P=8 (34.0 MiB); the one-device
    program on the whole sequence holds 27.9 MiB. Before the spanning branches'
    dilated gathers had a gather for their gradient (``core.arrays.take_static``;
    ``jnp.take``'s is a scatter into a zeroed shard-sized array), 7.4 and 15.4; before
    the local branches ran as the streamed program and the spanning ones merged at
    their selected rows, 32.8 at P=8.
    """
    from benchmarks.harness import temp_bytes

    config = dict(segment_lengths=(512, 1024, 4096, 16384), dilation_rates=(1, 2, 8, 16),
                  mode="longnet", is_causal=True)

    def grad(f):
        return jax.grad(lambda q, k, v, c: jnp.sum(f(q, k, v) * c), argnums=(0, 1, 2))

    x = jax.ShapeDtypeStruct((1, 16384, 8, 64), jnp.float32)
    mesh = build_mesh((devices,), ("seq",), "auto")
    sharded = temp_bytes(grad(_shard_map_fn(mesh, config)), x, x, x, x)
    shard_array = 16384 // devices * 8 * 64 * 4
    assert sharded <= bound * shard_array, sharded / shard_array


def test_shard_branches_plan():
    plan = distributed.shard_branches(((8, 1), (16, 2), (32, 4), (128, 8), (1000, 8)),
                                      local_len=16, num_devices=8)
    assert [b.ring_size for b in plan] == [1, 1, 2, 8, 8]
    assert [b.tokens_sent_per_step() for b in plan] == [0, 0, 4, 2, 2]


# ---------------------------------------------------------------------------- dropout


DROPOUT_CASE = Case("dropout", 4, 8, (8, 32), (1, 2), causal=True)


@functools.lru_cache(maxsize=None)
def _dropout_fn(rate):
    """Jitted sharded attention with the dropout key as an argument (one compile)."""
    mesh = build_mesh((DROPOUT_CASE.p,), ("seq",), "explicit")

    def run(key, q, k, v):
        fn = functools.partial(jd.dilated_attention, **DROPOUT_CASE.config,
                               dropout_rate=rate, dropout_rng=key)
        return jd.sharded(fn, mesh, seq_axis="seq")(q, k, v)

    return jax.jit(run)


def _dropout_run(key, rate=0.3):
    qkv = [jnp.asarray(x) for x in _inputs(DROPOUT_CASE)[:3]]
    return _dropout_fn(rate)(key, *qkv), qkv


@functools.lru_cache(maxsize=None)
def _undropped():
    """The one-device output without dropout on the dropout tests' inputs (jitted, once:
    both tests compare with it)."""
    qkv = [jnp.asarray(x) for x in _inputs(DROPOUT_CASE)[:3]]
    return np.asarray(jax.jit(functools.partial(jd.dilated_attention,
                                                **DROPOUT_CASE.config))(*qkv))


def test_dropout_deterministic_per_key_and_unbiased():
    a, qkv = _dropout_run(jax.random.key(1))
    b, _ = _dropout_run(jax.random.key(1))
    c, _ = _dropout_run(jax.random.key(2))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.allclose(np.asarray(a), np.asarray(c))
    plain = _undropped()
    # mean over keys is the undropped output (z-scores in units of the standard error)
    keys = jax.random.split(jax.random.key(3), 200)
    samples = np.stack([np.asarray(_dropout_run(key)[0]) for key in keys])
    mean, std = samples.mean(0), samples.std(0, ddof=1)
    rand = std > 0
    assert rand.mean() > 0.5
    z = (mean - plain)[rand] / (std[rand] / np.sqrt(len(samples)))
    assert np.max(np.abs(z)) < 6.0 and 0.3 < np.mean(z ** 2) < 3.0, (np.max(np.abs(z)),
                                                                      np.mean(z ** 2))


def test_dropout_rate_zero_is_exact():
    a, _ = _dropout_run(jax.random.key(1), rate=0.0)
    assert _rel(a, _undropped()) <= 1e-5


# ----------------------------------------------------------------------------- errors


def _run_sharded(p, t, segments, rates, **kw):
    mesh = build_mesh((p,), ("seq",), "explicit")
    attn = jd.sharded(functools.partial(jd.dilated_attention, segment_lengths=segments,
                                        dilation_rates=rates, **kw), mesh, seq_axis="seq")
    x = jnp.zeros((1, t, 2, 4), jnp.float32)
    return attn(x, x, x)


def test_error_sequence_not_divisible_by_devices():
    with pytest.raises(ValueError, match=r"divisible"):
        _run_sharded(4, 30, (8,), (1,))


@pytest.mark.parametrize("segments, rates, match", [
    ((12,), (1,), r"straddle device boundaries.*divisor of 16"),      # 12 does not divide 16
    ((24,), (1,), r"cover whole shards.*\[32, 64, 128\]"),             # not a multiple of 16
    ((48,), (1,), r"cover whole shards"),                              # 3 shards: 3 does not divide 8
    ((64,), (32,), r"multiple of the dilation rate 32"),               # spans, 16 % 32 != 0
])
def test_error_unshardable_segments(segments, rates, match):
    with pytest.raises(ValueError, match=match):
        _run_sharded(8, 128, segments, rates)


def test_error_axis_not_bound():
    x = jnp.zeros((1, 8, 2, 4))
    with pytest.raises(ValueError, match=r"seq_axis='seq' is not bound"):
        jd.dilated_attention(x, x, x, segment_lengths=(4,), dilation_rates=(1,),
                             seq_axis="seq")


def test_error_layout_for_dilated():
    mesh = build_mesh((2,), ("seq",), "explicit")
    with pytest.raises(ValueError, match=r"layout='zigzag'.*contiguous"):
        jd.sharded(functools.partial(jd.dilated_attention, segment_lengths=(4,),
                                     dilation_rates=(1,)), mesh, seq_axis="seq",
                   layout="zigzag")
