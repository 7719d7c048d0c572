"""The ``"hybrid"`` strategy: heads exchanged over one mesh axis and a ring over another
(``jd.sharded(fn, mesh, seq_axis=(a, b), strategy="hybrid")``), equal to one device in
float64 on 8 CPU devices as 2 x 4 and 4 x 2; its compiled program; its errors."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import XLA_CPU_MEMORY, hlo_computations, output_and_grads, replica_groups
from _mesh import build_mesh, make_mesh

import jax_dilated as jd
from jax_dilated import block_patterns as bp

B, T, D = 2, 128, 8


def _inputs(h, hkv, seed=0):
    rng = np.random.default_rng(seed)
    q, g = (rng.standard_normal((B, T, h, D)) for _ in range(2))
    k, v = (rng.standard_normal((B, T, hkv, D)) for _ in range(2))
    mask = rng.random((B, T)) < 0.8
    mask[1, :7] = False
    ids = np.sort(rng.integers(0, 5, (B, T)), axis=1)
    ids[1, 40:70] = 9  # a document that interrupts another (ids reused after it)
    ids[1, 70:90] = ids[1, 39]
    return q, k, v, g, mask, ids


def _dense(q, k, v, mask, causal):
    """softmax(q k^T / sqrt(D) + masks) v in float64, kv heads repeated (GQA)."""
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    allowed = jnp.tril(jnp.ones((T, T), bool)) if causal else jnp.ones((T, T), bool)
    s = jnp.where(allowed[None, None] & mask[:, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", jnp.where(jnp.isnan(p), 0.0, p), v)


def _dilated_references(options, q, k, v, g, mask):
    """What hybrid dilated attention with ``options`` must equal, each ``[out, dq, dk,
    dv]`` of ``sum(g * out)`` in float64: one device (the issue's parity), and where
    PyTorch is installed its reference of the mathematics (dense masks,
    tests/torch_reference/dilated.py), independent of the library."""
    one = functools.partial(jd.dilated_attention, **options)
    refs = [output_and_grads(lambda q, k, v: one(q, k, v, kv_mask=mask), q, k, v, g)]
    try:
        import torch
    except ImportError:  # the Python 3.12 leg of CI: one device only
        return refs
    from _helpers import as_np, to_torch
    from torch_reference.dilated import dilated_attention_full
    causal = options.get("is_causal", False)
    branches = [("window", *w.resolve(causal)) if isinstance(w, jd.SlidingWindow)
                else ("segment", w, r)
                for w, r in zip(options["segment_lengths"], options["dilation_rates"])]
    tq, tk, tv = (to_torch(x, requires_grad=True) for x in (q, k, v))
    out = dilated_attention_full(
        tq, tk, tv, branches=branches, mode=options.get("mode", "longnet"),
        head_offsets=options.get("head_offsets", "modulo"), is_causal=causal,
        kv_mask=torch.as_tensor(mask), logit_soft_cap=options.get("logit_soft_cap"))
    (to_torch(g) * out).sum().backward()
    return refs + [[as_np(out)] + [as_np(x.grad) for x in (tq, tk, tv)]]


def _check(got, want, tol=1e-10):
    for name, a, w in zip(("out", "dq", "dk", "dv"), got, want):
        err = np.max(np.abs(a - w)) / max(np.max(np.abs(w)), 1.0)
        assert err < tol, (name, err)


def _mesh(shape):
    return make_mesh(shape, ("a", "b"))


# each layout once, on each shape of the pair in turn
@pytest.mark.parametrize("shape,causal,layout", [((2, 4), True, "zigzag"),
                                                 ((4, 2), False, "contiguous"),
                                                 ((4, 2), True, "striped")])
def test_hybrid_equals_dense(shape, causal, layout):
    """8 query heads, 2 kv heads (on a = 4, each kv head repeated twice), a padding
    mask: output and gradients equal a dense float64 softmax."""
    q, k, v, g, mask, _ = _inputs(8, 2)
    want = output_and_grads(lambda q, k, v: _dense(q, k, v, mask, causal), q, k, v, g)
    attn = jd.sharded(functools.partial(jd.ring_attention, is_causal=causal), _mesh(shape),
                      seq_axis=("a", "b"), layout=layout, strategy="hybrid")
    got = output_and_grads(lambda q, k, v: attn(q, k, v, kv_mask=mask), q, k, v, g)
    _check(got, want)


OPTIONS = [
    dict(is_causal=True, window=(9, 0)),
    dict(is_causal=True, logit_soft_cap=1.5),
    dict(is_causal=False, window=(5, 3), logit_soft_cap=2.0),
]


@pytest.mark.parametrize("options,shape", list(zip(OPTIONS, [(2, 4), (4, 2), (2, 4)])),
                         ids=["window-2x4", "softcap-4x2", "window-softcap-2x4"])
def test_hybrid_options_equal_one_device(options, shape):
    """Windows, soft-cap, sinks and packed rows (ids reused across documents) give
    what one device gives, forward and gradients."""
    q, k, v, g, mask, ids = _inputs(4, 2, seed=1)
    sinks = np.array([0.3, -1.0, 2.0, 0.1])
    fn = functools.partial(jd.ring_attention, **options)
    one = jd.sharded(fn, make_mesh((1,), ("s",)), seq_axis="s")
    want = output_and_grads(
        lambda q, k, v: one(q, k, v, kv_mask=mask, segment_ids=ids, sinks=sinks), q, k, v, g)
    attn = jd.sharded(fn, _mesh(shape), seq_axis=("a", "b"), strategy="hybrid",
                      layout="zigzag" if options["is_causal"] else "contiguous")
    got = output_and_grads(
        lambda q, k, v: attn(q, k, v, kv_mask=mask, segment_ids=ids, sinks=sinks), q, k, v, g)
    _check(got, want)


DILATED = dict(segment_lengths=(16, 64, 128), dilation_rates=(1, 2, 4))
DILATED_CASES = [
    dict(DILATED, is_causal=True),
    dict(DILATED, is_causal=False),
    dict(segment_lengths=(jd.SlidingWindow(7), 32, 128), dilation_rates=(1, 2, 4),
         is_causal=True, logit_soft_cap=2.0),
]


@pytest.mark.parametrize("options", DILATED_CASES,
                         ids=["causal", "non-causal", "window-softcap"])
def test_hybrid_dilated_equals_one_device(options):
    """Longnet dilated attention, 8 query and 2 kv heads on 2 x 4: each device's 4
    heads keep their global offsets, the spanning segments ring over the devices of b
    they span; with a padding mask and sinks, forward and gradients equal one device."""
    q, k, v, g, mask, _ = _inputs(8, 2, seed=3)
    sinks = np.linspace(-1.0, 1.0, 8)
    fn = functools.partial(jd.dilated_attention, **options)
    want = output_and_grads(lambda q, k, v: fn(q, k, v, kv_mask=mask, sinks=sinks),
                            q, k, v, g)
    attn = jd.sharded(fn, _mesh((2, 4)), seq_axis=("a", "b"), strategy="hybrid")
    got = output_and_grads(lambda q, k, v: attn(q, k, v, kv_mask=mask, sinks=sinks),
                           q, k, v, g)
    _check(got, want)


@pytest.mark.parametrize("kv_heads", [8, 4])
def test_hybrid_dilated_head_groups_reorders_heads(kv_heads):
    """head_groups, 8 heads in 2 groups on 2 x 4: the contiguous slices would hold one
    group each, so the heads are dealt out (half of each group per slice, whole kv
    units) and put back; equal to one device, forward and gradients."""
    q, k, v, g, mask, _ = _inputs(8, kv_heads, seed=7)
    fn = functools.partial(jd.dilated_attention, segment_lengths=(32, 128),
                           dilation_rates=(1, 4), mode="head_groups", is_causal=True)
    want = output_and_grads(lambda q, k, v: fn(q, k, v, kv_mask=mask), q, k, v, g)
    attn = jd.sharded(fn, _mesh((2, 4)), seq_axis=("a", "b"), strategy="hybrid")
    got = output_and_grads(lambda q, k, v: attn(q, k, v, kv_mask=mask), q, k, v, g)
    _check(got, want)


def test_hybrid_dilated_repeats_kv_heads_further_where_slices_need_it():
    """Blocked offsets, 8 query heads and 2 kv heads on 2 x 4: rate 2 gives heads 0-3
    offset 0 and 4-7 offset 1, and each kv head's 4 heads share one offset, so no order
    of the 2 kv units evens the slices; with every kv head repeated per query head (8
    units) each slice gets two of each: equal to one device."""
    q, k, v, g, mask, _ = _inputs(8, 2, seed=8)
    fn = functools.partial(jd.dilated_attention, head_offsets="blocked", is_causal=True,
                           **DILATED)
    want = output_and_grads(lambda q, k, v: fn(q, k, v, kv_mask=mask), q, k, v, g)
    attn = jd.sharded(fn, _mesh((2, 4)), seq_axis=("a", "b"), strategy="hybrid")
    got = output_and_grads(lambda q, k, v: attn(q, k, v, kv_mask=mask), q, k, v, g)
    _check(got, want)


@pytest.mark.parametrize("kv_heads,rule,causal", [
    (2, "modulo", True), (8, "blocked", True), (2, "blocked", False), (8, "modulo", False)])
def test_hybrid_dilated_slices_with_their_own_offsets(kv_heads, rule, causal):
    """Longnet rates 1 / 2 / 4 with 8 heads on 4 x 2: each device of a holds 2 heads,
    and rate 4's offsets differ between the 4 slices under either rule, with no order
    of the heads that evens them out. Each device runs its own offsets (the spanning
    branch gathers at traced offsets around one ring, the local rate-2 branch is a
    switch): equal to one device and to the PyTorch reference, forward and gradients,
    with a padding mask."""
    q, k, v, g, mask, _ = _inputs(8, kv_heads, seed=11)
    options = dict(DILATED, head_offsets=rule, is_causal=causal)
    attn = jd.sharded(functools.partial(jd.dilated_attention, **options), _mesh((4, 2)),
                      seq_axis=("a", "b"), strategy="hybrid")
    got = output_and_grads(lambda q, k, v: attn(q, k, v, kv_mask=mask), q, k, v, g)
    for want in _dilated_references(options, q, k, v, g, mask):
        _check(got, want)


@pytest.mark.parametrize("mode", ["longnet", "head_groups"])
def test_hybrid_dilated_slices_keep_collectives_out_of_switches(mode):
    """On 4 x 2 the local branches differ between the slices of a, so they run in a
    per-device switch: longnet with blocked offsets (the rate-2 branch: heads 0-3
    offset 0, 4-7 offset 1), head_groups with 3 groups of 3, 3, 2 heads. The program
    holds more conditionals than with modulo offsets in longnet mode, where the local
    branches agree; no conditional holds a collective (the ring over b or the
    exchange over a): a collective that some devices never reach would hang them."""
    mesh = _mesh((4, 2))
    x = jax.ShapeDtypeStruct((B, T, 8, D), jnp.float32)

    def computations(**options):
        attn = jd.sharded(functools.partial(jd.dilated_attention, is_causal=True,
                                            **options, **DILATED),
                          mesh, seq_axis=("a", "b"), strategy="hybrid")
        comps, _ = hlo_computations(jax.jit(attn).lower(x, x, x).as_text(dialect="hlo"))
        return {name: "\n".join(lines) for name, lines in comps.items()}

    def switched(bodies):  # every computation a conditional calls, transitively
        todo = [c for body in bodies.values()
                for group in re.findall(r"branch_computations=\{([^}]*)\}", body)
                for c in re.findall(r"[\w.\-]+", group)]
        inside = set()
        while todo:
            c = todo.pop()
            if c not in inside:
                inside.add(c)
                todo.extend(set(re.findall(r"[\w.\-]+", bodies[c])) & bodies.keys())
        return inside

    bodies = (computations(head_offsets="blocked") if mode == "longnet" else
              computations(mode="head_groups"))
    count = lambda b: sum(body.count(" conditional(") for body in b.values())  # noqa: E731
    assert count(bodies) > count(computations(head_offsets="modulo"))
    inside = switched(bodies)
    outside = "".join(body for c, body in bodies.items() if c not in inside)
    assert "collective-permute" in outside and "all-to-all" in outside
    for c in inside:
        assert not re.search(r"collective-permute|all-to-all|all-gather", bodies[c]), c


@pytest.mark.parametrize("options,shape,kv_heads", [
    (dict(DILATED, is_causal=True), (2, 4), 2),     # groups of 3, 3, 2 heads; 4 per slice
    (dict(DILATED, is_causal=False), (4, 2), 8),    # 2 per slice: 1 or 2 groups each
    (dict(segment_lengths=(jd.SlidingWindow(7), 32, 128), dilation_rates=(1, 2, 4),
          is_causal=True), (4, 2), 2),                # the window spans every device
    (dict(segment_lengths=(16, 32, 64, 128, 128), dilation_rates=(1, 2, 2, 4, 8),
          is_causal=True), (2, 4), 4),                # 5 groups: 2, 2, 2, 1, 1 heads
], ids=["3-groups-2x4", "3-groups-4x2", "window-4x2", "5-groups-2x4"])
def test_hybrid_dilated_head_groups_slices_with_different_groups(options, shape, kv_heads):
    """head_groups with groups that no order deals evenly over a: the slices run
    different branches. Each device runs its local branches (a switch) and every
    branch that spans devices on padded head slots of one ring over b: equal to one
    device and to the PyTorch reference, forward and gradients, with a padding mask."""
    q, k, v, g, mask, _ = _inputs(8, kv_heads, seed=12)
    options = dict(options, mode="head_groups")
    attn = jd.sharded(functools.partial(jd.dilated_attention, **options), _mesh(shape),
                      seq_axis=("a", "b"), strategy="hybrid")
    got = output_and_grads(lambda q, k, v: attn(q, k, v, kv_mask=mask), q, k, v, g)
    for want in _dilated_references(options, q, k, v, g, mask):
        _check(got, want)


def test_cost_model_prices_the_padded_head_slots():
    """head_groups 3 / 3 / 2 on 4 x 2, 128 tokens: the branch (128, 4) spans the ring's
    2 devices and only the last slice holds its 2 heads, so every slice computes 2 head
    slots: 8 heads' work for 2. Weighted by the branches' flops (2048, 2048, 1024 per
    head, non-causal) the hybrid's work is (3 * 2048 + 3 * 2048 + 8 * 1024) / (3 * 2048
    + 3 * 2048 + 2 * 1024) of its heads' own; longnet pads nothing."""
    from jax_dilated.ops.dilated_hybrid import slice_order
    from jax_dilated.ops.strategies.hybrid import _padded_work, hybrid_cost
    from jax_dilated.ops.strategies.operation import describe, dilated_call
    shapes = dict(batch=2, seq_len=T, num_heads=8, head_dim=D)

    def padded_work(fn, sizes):
        op = describe(fn)
        slices = slice_order(dilated_call(op), seq_len=T, num_heads=8, num_kv_heads=2,
                             size_a=sizes[0])
        return _padded_work(op, slices, size_b=sizes[1], **shapes)

    groups = functools.partial(jd.dilated_attention, mode="head_groups", **DILATED)
    assert padded_work(groups, (4, 2)) == pytest.approx(20480 / 14336)
    assert padded_work(functools.partial(jd.dilated_attention, **DILATED), (4, 2)) == 1.0
    # 2 x 4: slices of 4 heads; (64, 2) spans 2 devices, 1 and 2 heads; (128, 4) 4, 0 and 2
    assert padded_work(groups, (2, 4)) == pytest.approx(18432 / 14336)
    even = functools.partial(jd.dilated_attention, segment_lengths=(32, 128),
                             dilation_rates=(1, 4), mode="head_groups")
    assert padded_work(even, (2, 4)) == 1.0  # an order deals 2 groups of 4
    padded = hybrid_cost(describe(groups), sizes=(4, 2), num_kv_heads=2, **shapes)
    assert padded.reason is None and padded.work > 0


def test_hybrid_dilated_packed_rows_equal_one_device(shape=(2, 4)):
    """Packed rows (ids reused after another document) under "hybrid": whole sequences
    of some heads over the two axes as one, as under every strategy (so one shape of
    the pair: 4 x 2 runs the same program on the same 8 devices)."""
    q, k, v, g, mask, ids = _inputs(8, 4, seed=4)
    fn = functools.partial(jd.dilated_attention, is_causal=True, **DILATED)
    want = output_and_grads(lambda q, k, v: fn(q, k, v, kv_mask=mask, segment_ids=ids),
                            q, k, v, g)
    attn = jd.sharded(fn, _mesh(shape), seq_axis=("a", "b"), strategy="hybrid")
    got = output_and_grads(lambda q, k, v: attn(q, k, v, kv_mask=mask, segment_ids=ids),
                           q, k, v, g)
    _check(got, want)


def test_hybrid_dilated_inside_shard_map():
    """dilated_attention(seq_axis=(a, b), strategy="hybrid") on the user's own shards
    (b major), equal to one device."""
    from jax.sharding import PartitionSpec as PS
    q, k, v, g, mask, _ = _inputs(8, 2, seed=5)
    fn = functools.partial(jd.dilated_attention, is_causal=True, **DILATED)
    want = output_and_grads(lambda q, k, v: fn(q, k, v), q, k, v, g)
    spec = PS(None, ("b", "a"))
    local = jax.shard_map(lambda q, k, v: fn(q, k, v, seq_axis=("a", "b"), strategy="hybrid"),
                          mesh=build_mesh((2, 4), ("a", "b"), "auto"), in_specs=(spec,) * 3,
                          out_specs=spec)
    got = output_and_grads(local, q, k, v, g)
    _check(got, want)


def test_hybrid_block_sparse_equals_one_device(shape=(2, 4)):
    """Block-sparse attention (a pattern shared by the heads; causal, zigzag over b),
    8 query and 2 kv heads, padding mask, packed rows and sinks: equal to one device."""
    q, k, v, g, mask, ids = _inputs(8, 2, seed=6)
    sinks = np.linspace(-0.5, 0.5, 8)
    fn = functools.partial(jd.block_sparse_attention, block_size=8, is_causal=True,
                           pattern=bp.LocalWindow(1) | bp.GlobalBlocks([0]))
    one = jd.sharded(fn, make_mesh((1,), ("s",)), seq_axis="s")
    want = output_and_grads(
        lambda q, k, v: one(q, k, v, kv_mask=mask, segment_ids=ids, sinks=sinks), q, k, v, g)
    attn = jd.sharded(fn, _mesh(shape), seq_axis=("a", "b"), strategy="hybrid",
                      layout="zigzag")
    got = output_and_grads(
        lambda q, k, v: attn(q, k, v, kv_mask=mask, segment_ids=ids, sinks=sinks), q, k, v, g)
    _check(got, want)


def test_hybrid_block_sparse_per_head_patterns_that_differ(shape=(4, 2)):
    """A per-head pattern that differs between the head slices of a: each device's
    slice as a traced mask (every block a lax.cond), equal to one device (4 slices
    of 2 heads; the shared pattern above runs on 2 x 4)."""
    q, k, v, g, mask, _ = _inputs(8, 2, seed=7)
    fn = functools.partial(jd.block_sparse_attention, block_size=8, is_causal=True,
                           pattern=bp.RandomBlocks(density=0.4, seed=1, per_head=True))
    one = jd.sharded(fn, make_mesh((1,), ("s",)), seq_axis="s")
    want = output_and_grads(lambda q, k, v: one(q, k, v, kv_mask=mask), q, k, v, g)
    attn = jd.sharded(fn, _mesh(shape), seq_axis=("a", "b"), strategy="hybrid",
                      layout="zigzag")
    got = output_and_grads(lambda q, k, v: attn(q, k, v, kv_mask=mask), q, k, v, g)
    _check(got, want)


def test_hybrid_layers_equal_one_device():
    """The NNX layers built with a two-axis mesh and strategy="hybrid" (dilated and
    ring attention, float32) give what the single-device layer gives."""
    from flax import nnx
    kw = dict(segment_lengths=(16, 64, 128), dilation_rates=(1, 2, 4))
    x = jax.random.normal(jax.random.key(1), (2, T, 64))
    mesh = build_mesh((2, 4), ("a", "b"), "auto")
    one = jd.nnx.MultiheadDilatedAttention(64, 8, num_kv_heads=2, rngs=nnx.Rngs(0), **kw)
    hybrid = jd.nnx.MultiheadDilatedAttention(64, 8, num_kv_heads=2, rngs=nnx.Rngs(0),
                                              mesh=mesh, seq_axis=("a", "b"),
                                              strategy="hybrid", **kw)
    run = nnx.jit(lambda m, x: m(x, is_causal=True, deterministic=True))
    want, got = (np.asarray(run(m, x)) for m in (one, hybrid))
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))
    ring = jd.nnx.MultiheadRingAttention(64, 8, num_kv_heads=2, mesh=mesh,
                                         seq_axis=("a", "b"), strategy="hybrid",
                                         layout="zigzag", rngs=nnx.Rngs(0))
    ring_one = jd.nnx.MultiheadRingAttention(64, 8, num_kv_heads=2,
                                             mesh=build_mesh((1,), ("s",), "auto"),
                                             seq_axis="s", rngs=nnx.Rngs(0))
    want, got = (np.asarray(run(m, x)) for m in (ring_one, ring))
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))


def test_hybrid_returns_the_lse_and_auto_picks_it():
    q, k, v, _, mask, _ = _inputs(4, 4, seed=2)
    fn = functools.partial(jd.ring_attention, is_causal=True, return_lse=True)
    one = jd.sharded(fn, make_mesh((1,), ("s",)), seq_axis="s")
    want = one(q, k, v, kv_mask=mask)
    for strategy in ("hybrid", "auto"):
        got = jd.sharded(fn, _mesh((2, 4)), seq_axis=("a", "b"), strategy=strategy,
                         layout="zigzag")(q, k, v, kv_mask=mask)
        for a, w in zip(got, want):
            a, w = np.asarray(a), np.asarray(w)
            fin = np.isfinite(w)
            assert np.array_equal(fin, np.isfinite(a))
            assert np.max(np.abs(a[fin] - w[fin])) < 1e-10


def _collectives(hlo: str, mesh):
    """``[(op, [{(i_a, i_b) of each device of a group}])]`` of the program's all-to-alls,
    collective permutes (their source-target pairs) and all-gathers."""
    position = {d.id: (i, j) for i, row in enumerate(mesh.devices) for j, d in enumerate(row)}
    out = []
    for line in hlo.splitlines():
        m = re.search(r"[\s)](all-to-all|collective-permute|all-gather)(?:-start)?\(", line)
        if m:
            pairs = re.search(r"source_target_pairs=(\{[^=]*\}\})", line)
            groups = ([[int(n) for n in re.findall(r"\d+", g)]
                       for g in re.findall(r"\{([\d,]+)\}", pairs.group(1))] if pairs
                      else replica_groups(line, mesh.devices.size))
            out.append((m.group(1), [{position[n] for n in g} for g in groups]))
    return out


@pytest.mark.parametrize("op", ["exact", "dilated"])
def test_hybrid_program_exchanges_over_a_and_rings_over_b(op):
    """The compiled forward holds all-to-alls among the devices of one b index (axis
    a), collective permutes among those of one a index (axis b), no all-gather of q,
    k or v, and no array of the global sequence length."""
    mesh = _mesh((2, 4))
    x = jax.ShapeDtypeStruct((B, T, 8, D), jnp.float32)
    fn = (functools.partial(jd.ring_attention, is_causal=True) if op == "exact" else
          functools.partial(jd.dilated_attention, is_causal=True, **DILATED))
    attn = jd.sharded(fn, mesh, seq_axis=("a", "b"), strategy="hybrid",
                      layout="zigzag" if op == "exact" else "contiguous")
    hlo = jax.jit(attn).lower(x, x, x).compile().as_text()
    found = _collectives(hlo, mesh)
    ops = {op for op, _ in found}
    assert {"all-to-all", "collective-permute"} <= ops and "all-gather" not in ops, ops
    for op, groups in found:
        for where in groups:
            if op == "all-to-all":  # one b index: the devices differ in a only
                assert len({j for _, j in where}) == 1, (op, where)
            else:  # a ring step: one a index
                assert len({i for i, _ in where}) == 1, (op, where)
    shapes = re.findall(r"[fsu]\d+\[([\d,]+)\]", hlo)
    assert all(T not in [int(n) for n in s.split(",") if n] for s in shapes), "global length"


@XLA_CPU_MEMORY
def test_hybrid_holds_about_what_the_ring_holds():
    """8 query heads and 2 kv heads on 8 devices, n=16384: hybrid 2 x 4 holds within 1%
    of the compiled memory per device of the ring over all 8, forward and backward
    (38.1 against 38.0 MiB; at 4096 tokens the exchanged copies make it 2x, 19.9
    against 10.0 MiB)."""
    t = 16384
    x = jax.ShapeDtypeStruct((1, t, 8, 64), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, t, 2, 64), jnp.float32)
    fn = functools.partial(jd.ring_attention, is_causal=True)

    def total(attn):
        loss = lambda q, k, v: jnp.sum(attn(q, k, v))  # noqa: E731
        m = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, kv, kv).compile()
        m = m.memory_analysis()
        return m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes

    ring = total(jd.sharded(fn, make_mesh((8,), ("s",)), seq_axis="s", layout="zigzag"))
    hybrid = total(jd.sharded(fn, _mesh((2, 4)), seq_axis=("a", "b"), strategy="hybrid",
                              layout="zigzag"))
    assert hybrid <= 1.01 * ring, (hybrid / 2**20, ring / 2**20)


@pytest.mark.parametrize("sizes", [(2, 4), (4, 2)])
def test_cost_model_hybrid_sends_less_than_the_ring(sizes, capsys):
    """8 query heads, 2 kv heads, 8 devices: the cost model's bytes per device of the
    hybrid split are fewer than the ring's over all 8 (32 and 38 kv shards against 46),
    and explain_strategy lists it beside the one-axis strategies.

    In kv shards ``K`` (one device's ``T / 8`` tokens of the 2 kv heads, float32; a
    query shard is ``4 K``), with the ring over ``P`` devices sending ``(6 P - 2)`` of
    its blocks (the XLA kernel's forward sends the block ``P`` times, bringing it home
    for the backward; the backward sends k, v ``P - 1`` times and dk, dv ``P`` times):
    ring over 8, ``46 K``; hybrid 2 x 4, the head exchange over 2 ``2 (1 / 2) (2 * 4 K +
    2 K) = 10 K`` plus a ring over 4 of ``T / 4`` tokens of one kv head (blocks of
    ``K``), ``22 K``: ``32 K``; hybrid 4 x 2, the exchange over 4 with the 2 kv heads
    repeated twice ``2 (3 / 4) (2 * 4 K + 2 * 2 K) = 18 K`` plus a ring over 2 of ``T /
    2`` tokens of one repeated kv head (blocks of ``2 K``), ``10 * 2 K``: ``38 K``."""
    fn = functools.partial(jd.ring_attention, is_causal=True)
    pick, costs, _ = jd.explain_strategy(fn, (1, 32768, 8, 64), (1, 32768, 2, 64),
                                         num_devices=8, layout="zigzag", axis_sizes=sizes)
    kshard = 32768 // 8 * 2 * 64 * 4
    assert costs["ring"].sent_bytes == (6 * 8 - 2) * kshard == 46 * kshard
    exchange = {(2, 4): 2 * (1 / 2) * (2 * 4 + 2 * 1), (4, 2): 2 * (3 / 4) * (2 * 4 + 2 * 2)}
    ring_b = {(2, 4): (6 * 4 - 2) * 1, (4, 2): (6 * 2 - 2) * 2}
    assert exchange[sizes] + ring_b[sizes] == (32 if sizes == (2, 4) else 38)
    assert costs["hybrid"].sent_bytes == (32 if sizes == (2, 4) else 38) * kshard
    assert costs["hybrid"].sent_bytes < costs["ring"].sent_bytes
    assert costs["hybrid"].reason is None
    assert f"hybrid {sizes[0]} x {sizes[1]}" in capsys.readouterr().out


def test_hybrid_errors_name_the_argument():
    mesh = _mesh((4, 2))
    fn = jd.ring_attention
    x = jnp.zeros((1, 16, 6, 8))
    with pytest.raises(ValueError, match=r"num_heads \(6\) divisible by the 4 devices"):
        jd.sharded(fn, mesh, seq_axis=("a", "b"), strategy="hybrid")(x, x, x)
    with pytest.raises(ValueError, match="same mesh axis twice"):
        jd.sharded(fn, mesh, seq_axis=("a", "a"), strategy="hybrid")
    with pytest.raises(ValueError, match="seq_axis"):
        jd.sharded(fn, mesh, seq_axis=("a", "c"), strategy="hybrid")
    with pytest.raises(ValueError, match=r"needs two mesh axes, seq_axis=\(a, b\)"):
        jd.sharded(fn, mesh, seq_axis="a", strategy="hybrid")
    with pytest.raises(ValueError, match="the library's operations"):
        jd.sharded(lambda q, k, v, **kw: q, mesh, seq_axis=("a", "b"),
                   strategy="hybrid")(x[:, :, :4], x[:, :, :4], x[:, :, :4])
    with pytest.raises(ValueError, match=r"seq_axis must name .* two as \(a, b\)"):
        jd.dilated_attention(x, x, x, segment_lengths=(8,), dilation_rates=(1,),
                             strategy="hybrid")


# ---------------------------------------------- one-axis strategies and "auto" on a pair

PAIR_OPS = {
    "exact": (functools.partial(jd.ring_attention, is_causal=True), "zigzag"),
    "dilated": (functools.partial(jd.dilated_attention, segment_lengths=(16, 64, 128),
                                  dilation_rates=(1, 2, 4), is_causal=True), "contiguous"),
}


_PAIR_REFERENCES = {}


def _reference(op, mask):
    """Exact: the dense float64 softmax; dilated: the one-device call (itself checked
    against the PyTorch reference, tests/test_parity.py)."""
    if op == "exact":
        return lambda q, k, v: _dense(q, k, v, mask, True)
    return lambda q, k, v: PAIR_OPS[op][0](q, k, v, kv_mask=mask)


@pytest.mark.parametrize("strategy", ["ring", "allgather", "heads", "auto"])
@pytest.mark.parametrize("op", ["exact", "dilated"])
def test_one_axis_strategies_over_a_pair_equal_one_device(op, strategy):
    """A pair with a one-axis strategy runs it over the two axes as one (in the mesh's
    order), and "auto" picks among those and both hybrid splits: forward and gradients
    equal a dense float64 softmax (exact) or one device (dilated), 8 query heads, 2 kv
    heads, a padding mask."""
    fn, layout = PAIR_OPS[op]
    q, k, v, g, mask, _ = _inputs(8, 2, seed=3)
    if op not in _PAIR_REFERENCES:  # the same for every strategy: computed once
        _PAIR_REFERENCES[op] = output_and_grads(_reference(op, mask), q, k, v, g)
    want = _PAIR_REFERENCES[op]
    attn = jd.sharded(fn, _mesh((2, 4)), seq_axis=("a", "b"), layout=layout,
                      strategy=strategy)
    got = output_and_grads(lambda q, k, v: attn(q, k, v, kv_mask=mask), q, k, v, g)
    _check(got, want)


def test_auto_prices_both_hybrid_splits_and_runs_the_one_it_picks(monkeypatch, capsys):
    """On a 2 x 4 pair "auto" prices heads over a with the ring over b ((2, 4)) and the
    other way round ((4, 2)) beside the one-axis strategies, explain_strategy shows both,
    and the split it picks runs with its axes' roles (here the swapped one, forced),
    equal to one device."""
    fn, layout = PAIR_OPS["exact"]
    _, costs, _ = jd.explain_strategy(fn, (B, T, 8, D), (B, T, 2, D), num_devices=8,
                                      layout=layout, axis_sizes=(2, 4))
    assert costs["hybrid"].strategy == ("hybrid", 2, 4)
    assert costs["hybrid_swapped"].strategy == ("hybrid", 4, 2)
    assert costs["hybrid"].sent_bytes != costs["hybrid_swapped"].sent_bytes
    out = capsys.readouterr().out
    assert "hybrid 2 x 4" in out and "hybrid 4 x 2" in out
    from jax_dilated.ops import strategies
    real = strategies.choose
    picked = []

    def swapped(*args, **kw):
        picked.append(kw["axis_sizes"])
        return ("hybrid", 4, 2), *real(*args, **kw)[1:]

    monkeypatch.setattr(strategies, "choose", swapped)
    q, k, v, g, mask, _ = _inputs(8, 2, seed=4)
    want = output_and_grads(_reference("exact", mask), q, k, v, g)
    mesh = _mesh((2, 4))
    attn = jd.sharded(fn, mesh, seq_axis=("a", "b"), layout=layout, strategy="auto")
    got = output_and_grads(lambda q, k, v: attn(q, k, v, kv_mask=mask), q, k, v, g)
    assert picked and picked[0] == (2, 4)
    _check(got, want)
    # the swapped split exchanges heads over b: its all-to-alls among one a index's 4
    hlo = jax.jit(attn).lower(*(jnp.asarray(x) for x in (q, k, v))).compile().as_text()
    exchanges = [w for op, groups in _collectives(hlo, mesh) if op == "all-to-all"
                 for w in groups]
    assert exchanges and all(len(w) == 4 and len({i for i, _ in w}) == 1
                             for w in exchanges), exchanges
