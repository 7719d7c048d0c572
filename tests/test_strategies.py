"""Context-parallel strategies of ``jd.sharded`` (``strategy=``): ring, allgather, heads, auto.

Every strategy must equal the single-device result (float64, forward and the
gradients of query, key and value through a random cotangent), for exact, dilated
and block-sparse attention, causal or not, with GQA and a key padding mask. Exact
attention is checked against a plain dense float64 formula; dilated and block-sparse
attention against the library's single-device call (checked elsewhere against the
PyTorch references). Shapes are small: the module runs in seconds.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import XLA_CPU_MEMORY
from _mesh import build_mesh, devices as mesh_devices, make_mesh

import jax_dilated as jd
from jax_dilated import block_patterns as bp
from jax_dilated.ops.strategies import cost
from jax_dilated.ops.strategies.operation import describe

B, T, D = 2, 64, 8


def _inputs(h, hkv, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, h, D))
    k = rng.standard_normal((B, T, hkv, D))
    v = rng.standard_normal((B, T, hkv, D))
    g = rng.standard_normal((B, T, h, D))
    mask = rng.random((B, T)) < 0.75
    mask[1, :5] = False
    return q, k, v, g, mask


def _dense(q, k, v, mask, causal, return_lse=False):
    """softmax(q k^T / sqrt(D) + masks) v in float64, kv heads repeated (GQA); with
    ``return_lse`` also the log-sum-exp [B, T, H] of the masked logits (-inf where a
    row has nothing to attend to)."""
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    allowed = jnp.tril(jnp.ones((T, T), bool)) if causal else jnp.ones((T, T), bool)
    allowed = allowed[None, None] & mask[:, None, None, :]
    s = jnp.where(allowed, s, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(s - m)
    den = e.sum(-1, keepdims=True)
    out = jnp.einsum("bhqk,bkhd->bqhd", e / jnp.where(den > 0, den, 1.0), v)
    if not return_lse:
        return out
    lse = jnp.where(den > 0, jnp.log(jnp.where(den > 0, den, 1.0)) + m, -jnp.inf)
    return out, jnp.moveaxis(lse[..., 0], 1, 2)


def _value_and_grads(f, q, k, v, g):
    def loss(q, k, v):
        out = f(q, k, v)
        return jnp.sum(out * g), out

    (dq, dk, dv), out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return [np.asarray(x) for x in (out, dq, dk, dv)]


def _check(got, want, tol=1e-10):
    for name, a, w in zip(("out", "dq", "dk", "dv"), got, want):
        err = np.max(np.abs(a - w)) / max(np.max(np.abs(w)), 1.0)
        assert err < tol, (name, err)


def _mesh(p):
    return make_mesh((p,), ("seq",))


DILATED = dict(segment_lengths=(16, 32, 64), dilation_rates=(1, 2, 4))
WINDOW_OPTIONS = dict(segment_lengths=(jd.SlidingWindow(5), 64), dilation_rates=(1, 4),
                      is_causal=True, logit_soft_cap=1.5,
                      sinks=np.array([0.3, -1.0, 2.0, 0.0]))

CASES = [
    # (op, options, strategy, P, layout, heads, kv heads)
    ("exact", dict(is_causal=True), "heads", 8, "contiguous", 8, 2),
    # 3 kv heads on 2 devices: each kv head is repeated twice before the all-to-all
    ("exact", dict(is_causal=False), "heads", 2, "contiguous", 6, 3),
    ("exact", dict(is_causal=True), "allgather", 4, "zigzag", 4, 2),
    ("exact", dict(is_causal=False), "allgather", 2, "striped", 4, 4),
    ("dilated", dict(DILATED, is_causal=True), "heads", 8, "contiguous", 8, 2),
    ("dilated", dict(DILATED, mode="head_groups", is_causal=False), "heads", 4,
     "contiguous", 4, 4),
    ("dilated", dict(DILATED, head_offsets="blocked", is_causal=True), "allgather", 4,
     "contiguous", 4, 2),
    ("dilated", dict(segment_lengths=(8, 64), dilation_rates=(2, 8), is_causal=False),
     "allgather", 8, "contiguous", 8, 4),
    # per-branch strategies (T=64 on P=4: 16 local, 32 spans 2 devices, 64 spans 4); 8
    # heads, as the "heads" P=8 case above, whose one-device reference it shares
    ("dilated", dict(DILATED, is_causal=True), ("ring", "allgather", "heads"), 4,
     "contiguous", 8, 2),
    # head_groups: 2 heads per branch; the branch of 64 spans both devices
    ("dilated", dict(DILATED, mode="head_groups", is_causal=False),
     ("heads", "heads", "heads"), 2, "contiguous", 6, 3),
    # 8 devices, 4 kv heads: each dilated kv head repeated before the group all-to-all
    ("dilated", dict(segment_lengths=(8, 32, 64), dilation_rates=(2, 4, 8), is_causal=True),
     ("ring", "heads", "heads"), 8, "contiguous", 8, 4),
    # soft-cap, sinks and a sliding-window branch go through every strategy of dilated
    # attention (it runs them itself); beside the window one branch that spans both
    # devices is enough (each branch is another loop to trace and compile)
    ("dilated", dict(WINDOW_OPTIONS), "allgather", 2, "contiguous", 4, 2),
    ("dilated", dict(WINDOW_OPTIONS), "heads", 2, "contiguous", 4, 2),
    ("dilated", dict(segment_lengths=(jd.SlidingWindow(5), 32, 64), dilation_rates=(1, 2, 4),
                     mode="head_groups", logit_soft_cap=1.5), ("ring", "heads", "allgather"),
     2, "contiguous", 6, 2),
    # per-head patterns: one device traces each head's own blocks, so 4 heads (one per
    # device, each with its own pattern) rather than 8
    ("block_sparse", dict(block_size=8, pattern=bp.RandomBlocks(density=0.4, seed=1,
                                                                per_head=True)),
     "heads", 4, "contiguous", 4, 2),
    ("block_sparse", dict(block_size=8, pattern=bp.LocalWindow(1) | bp.GlobalBlocks([0]),
                          is_causal=True), "allgather", 2, "zigzag", 4, 2),
    # (2 heads and 1 kv head: each head's own pattern is traced, and the gather needs
    # no particular number of heads)
    ("block_sparse", dict(block_size=8, pattern=bp.RandomBlocks(density=0.5, seed=2,
                                                                per_head=True),
                          is_causal=True), "allgather", 4, "contiguous", 2, 1),
]

_FNS = {"exact": jd.ring_attention, "dilated": jd.dilated_attention,
        "block_sparse": jd.block_sparse_attention}


def _case_id(c):
    strategy = c[2] if isinstance(c[2], str) else "+".join(c[2])
    extra = "-options" if "sinks" in c[1] or "logit_soft_cap" in c[1] else ""
    return f"{c[0]}-{strategy}-P{c[3]}-{c[4]}{extra}"


# one device's output and gradients, by test, operation, options and heads (the inputs
# are drawn the same way): cases that differ only by strategy or mesh compute them once
_ONE_DEVICE = {}


@pytest.mark.parametrize("op,options,strategy,p,layout,h,hkv", CASES,
                         ids=[_case_id(c) for c in CASES])
def test_strategy_equals_single_device(op, options, strategy, p, layout, h, hkv):
    q, k, v, g, mask = _inputs(h, hkv)
    key = ("strategy", op, repr(options), h, hkv)  # cases that differ by strategy only
    if key not in _ONE_DEVICE:
        if op == "exact":
            _ONE_DEVICE[key] = _value_and_grads(
                lambda q, k, v: _dense(q, k, v, mask, options["is_causal"]), q, k, v, g)
        else:
            single = functools.partial(_FNS[op], **options)
            _ONE_DEVICE[key] = _value_and_grads(
                lambda q, k, v: single(q, k, v, kv_mask=mask), q, k, v, g)
    want = _ONE_DEVICE[key]
    attn = jd.sharded(functools.partial(_FNS[op], **options), _mesh(p), seq_axis="seq",
                      layout=layout, strategy=strategy)
    got = _value_and_grads(lambda q, k, v: attn(q, k, v, kv_mask=mask), q, k, v, g)
    _check(got, want)


def test_heads_runs_a_custom_function_unchanged():
    """strategy='heads' calls any single-device function without seq_axis, on the whole
    sequence of H / P heads."""
    seen = []

    def plain(q, k, v, *, kv_mask=None):
        seen.append((q.shape, k.shape, None if kv_mask is None else kv_mask.shape))
        return _dense(q, k, v, kv_mask, causal=True)

    q, k, v, g, mask = _inputs(4, 2)
    attn = jd.sharded(plain, _mesh(2), seq_axis="seq", strategy="heads")
    got = _value_and_grads(lambda q, k, v: attn(q, k, v, kv_mask=mask), q, k, v, g)
    want = _value_and_grads(lambda q, k, v: _dense(q, k, v, mask, True), q, k, v, g)
    _check(got, want)
    assert seen[0] == ((B, T, 2, D), (B, T, 1, D), (B, T)), seen


def test_allgather_backward_is_a_reduce_scatter():
    """The gradient of the gathered keys/values goes back as one reduce-scatter."""
    q, k, v, g, mask = _inputs(4, 2)
    attn = jd.sharded(functools.partial(jd.ring_attention, is_causal=True), _mesh(4),
                      seq_axis="seq", strategy="allgather")
    text = str(jax.make_jaxpr(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v) * g),
                                       argnums=(1, 2)))(q, k, v))
    assert "all_gather" in text and "reduce_scatter" in text, text[-2000:]
    assert "ppermute" not in text


def test_per_branch_heads_is_an_all_to_all_among_the_segment_devices():
    """A branch given "heads" exchanges heads with the devices of its segment only (an
    all-to-all in groups of 2 for the branch of 32 on 4 devices, of all 4 for the
    branch of 64); "ring" for every branch sends with ppermute and no all-to-all."""
    q, k, v, g, _ = _inputs(4, 2)
    dil = functools.partial(jd.dilated_attention, **DILATED)

    def program(strategy):
        attn = jd.sharded(dil, _mesh(4), seq_axis="seq", strategy=strategy)
        return str(jax.make_jaxpr(lambda q, k, v: attn(q, k, v))(q, k, v))

    mixed = program(("ring", "heads", "heads"))
    assert "axis_index_groups=((0, 1), (2, 3))" in mixed and "ppermute" not in mixed
    # per branch: q, k, v to heads, o back, and the two parts of the lse stacked in one
    assert mixed.count("all_to_all") == 2 * 5, mixed.count("all_to_all")
    ring = program("ring")
    assert "all_to_all" not in ring and "ppermute" in ring


def test_heads_runs_dilated_attention_branch_by_branch():
    """strategy="heads" on dilated attention exchanges heads only for the branches that
    span devices, among each segment's devices (segments 16, 32, 64 on 4 devices of
    16 tokens: groups of 2 for the branch of 32, all 4 for 64); with every segment
    local nothing moves; where a spanning branch's heads do not divide by its devices
    (head_groups: one head for the branch of 2 devices) it is the all-to-all of the
    whole call. (Parity: the "heads" cases of test_strategy_equals_single_device.)"""
    q, k, v, _, _ = _inputs(4, 2)

    def program(**options):
        attn = jd.sharded(functools.partial(jd.dilated_attention, **options), _mesh(4),
                          seq_axis="seq", strategy="heads")
        return str(jax.make_jaxpr(lambda q, k, v: attn(q, k, v))(q, k, v))

    by_branch = program(**DILATED)
    assert "axis_index_groups=((0, 1), (2, 3))" in by_branch
    assert by_branch.count("all_to_all") == 2 * 5, by_branch.count("all_to_all")
    assert "all_to_all" not in program(segment_lengths=(8, 16), dilation_rates=(1, 2))
    whole = program(**DILATED, mode="head_groups")  # heads 0-1, 2, 3 for 16, 32, 64
    assert "all_to_all" in whole and "axis_index_groups=((" not in whole
    # explain_strategy says which way "heads" runs
    for options, by_branch in ((DILATED, True), (dict(DILATED, mode="head_groups"), False)):
        costs = jd.explain_strategy(functools.partial(jd.dilated_attention, **options),
                                    q.shape, k.shape, num_devices=4, quiet=True)[1]
        assert (costs["heads"].note is not None) == by_branch, options


def test_heads_by_branch_dropout_gradient_matches_finite_differences():
    """With dropout, an exchanged branch draws the same masks in its backward (which
    exchanges q, k, v again) as in its forward: for a fixed key the gradient of the
    sharded call is the derivative of its forward (central differences, float64)."""
    q, k, v, g, _ = _inputs(4, 2)
    dil = functools.partial(jd.dilated_attention, **DILATED, is_causal=True,
                            dropout_rate=0.3, dropout_rng=jax.random.key(3))
    attn = jd.sharded(dil, _mesh(4), seq_axis="seq", strategy="heads")
    text = str(jax.make_jaxpr(lambda q, k, v: attn(q, k, v))(q, k, v))
    assert "axis_index_groups=((0, 1), (2, 3))" in text  # it runs branch by branch

    def loss(q, k, v):
        return jnp.sum(g * attn(q, k, v))

    # one program for the gradient and the differences' losses (a loss-only program
    # would be a second compilation of the same forward); the rest in NumPy
    loss_and_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    value = lambda *args: float(loss_and_grads(*args)[0])  # noqa: E731
    grads = [np.asarray(x) for x in loss_and_grads(q, k, v)[1]]
    rng = np.random.default_rng(8)
    eps = 1e-6
    for i, x in enumerate((q, k, v)):
        direction = rng.standard_normal(x.shape)
        args_p, args_m = [q, k, v], [q, k, v]
        args_p[i], args_m[i] = x + eps * direction, x - eps * direction
        fd = (value(*args_p) - value(*args_m)) / (2 * eps)
        an = float(np.sum(grads[i] * direction))
        assert abs(fd - an) < 1e-6 * max(1.0, abs(an)), (i, fd, an)


@XLA_CPU_MEMORY
def test_heads_dilated_memory_per_device():
    """Head-parallel dilated attention at P=8 with 8 heads holds at most 0.2x of one
    device per device: compiled forward+backward memory (temporaries, arguments and
    outputs; memory_analysis is deterministic), T=32768, 8 heads x 64, float32,
    causal, segments T/16, T/4, T at rates 1, 2, 4 (the strategies benchmark's row).

    Measured on the XLA kernel: 122.5 MiB against 639.0 MiB on one device (0.192x).
    The all-to-all of the whole call holds 194.8 MiB (0.305x; its head-sharded copies
    of q, k, v, the output, its cotangent and the three gradients alone are 0.2x), and
    branch by branch before the exchanged branches ran inside the streamed program
    176.8 MiB.
    """
    t = 32768
    # on the XLA kernel: the chunked program on both sides (on one device the native
    # CPU kernel's fused program holds 515 MiB, and heads then 0.23x of it)
    dil = functools.partial(_benchmark_dilated(t), implementation="xla")
    x = jax.ShapeDtypeStruct((1, t, 8, 64), jnp.float32)
    one = _compiled_total(dil, x)
    per_device = _compiled_total(jd.sharded(dil, _mesh(8), seq_axis="seq",
                                            strategy="heads"), x, sharded=True)
    assert per_device <= 0.2 * one, per_device / one


def _benchmark_dilated(t: int):
    """The strategies benchmark's dilated row: segments T/16, T/4, T at rates 1, 2, 4."""
    return functools.partial(jd.dilated_attention, segment_lengths=(t // 16, t // 4, t),
                             dilation_rates=(1, 2, 4), is_causal=True)


def _compiled_total(f, x, sharded: bool = False) -> int:
    """Compiled forward+backward memory of ``f(x, x, x)`` (temporaries, arguments and
    outputs; memory_analysis is deterministic), per device when ``sharded`` over the
    8 devices of ``_mesh(8)``."""
    from benchmarks.harness import compiled_memory

    def run(q, k, v, ct):
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(ct)

    kw = {}
    if sharded:
        kw["in_shardings"] = jax.sharding.NamedSharding(
            _mesh(8), jax.sharding.PartitionSpec(None, "seq"))
        x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=kw["in_shardings"])
    stats = compiled_memory(run, x, x, x, x, **kw)
    return stats.temp + stats.argument + stats.output - stats.alias


@XLA_CPU_MEMORY
def test_auto_orders_dilated_memory_as_compiled():
    """On CPU the ring and head-parallel dilated attention are priced within 10% of
    each other in time (their times measured level at 4096 tokens), so "auto" takes
    the one the cost model says holds less: it must order them as the compiled
    programs do. The ring holds less at 4096 tokens over 8 devices (22.8 against 25.3
    MiB with the native CPU forward, 24.3 against 33.1 with the XLA kernel's), heads
    from 8192 (37.9 against 48.9; 42.1 against 49.9): the XLA kernel's logits blocks
    of a spanning branch are as small as a shard's dilated tokens on the ring and full
    under the head exchange (cost._logits_blocks_held)."""
    for t, want in ((4096, "ring"), (8192, "heads")):
        dil = _benchmark_dilated(t)
        pick, costs, _ = jd.explain_strategy(dil, (1, t, 8, 64), num_devices=8,
                                             platform="cpu", quiet=True)
        x = jax.ShapeDtypeStruct((1, t, 8, 64), jnp.float32)
        held = {s: _compiled_total(jd.sharded(dil, _mesh(8), seq_axis="seq",
                                              strategy=s), x, sharded=True)
                for s in ("ring", "heads")}
        assert min(held, key=held.get) == want == pick, (t, held, pick)
        assert min(("ring", "heads"), key=lambda s: costs[s].held_bytes) == want


def test_strategy_errors_name_what_can_serve():
    q, k, v, _, _ = _inputs(6, 2)
    ring = functools.partial(jd.ring_attention, is_causal=True)
    with pytest.raises(ValueError, match=r"strategy must be one of \('ring', 'allgather', "
                                         r"'heads', 'hybrid', 'auto'\), or for dilated "
                                         r"attention a "
                                         r"tuple .* got 'ulysses'"):
        jd.sharded(ring, _mesh(4), seq_axis="seq", strategy="ulysses")
    attn = jd.sharded(ring, _mesh(4), seq_axis="seq", strategy="heads")
    with pytest.raises(ValueError, match=r"num_heads \(6\) divisible by the 4 devices.*"
                                         r"use strategy='ring' or 'allgather'"):
        attn(q, k, v)

    four = make_mesh((2, 4), ("heads", "seq"))
    attn = jd.sharded(ring, four, seq_axis="seq", head_axis="heads", strategy="heads")
    with pytest.raises(ValueError, match=r"num_heads \(3 in each shard of "
                                         r"head_axis='heads'\) divisible by the 4 devices"):
        attn(q, k[:, :, :1].repeat(2, 2), v[:, :, :1].repeat(2, 2))

    def custom(q, k, v, *, kv_mask=None, seq_axis=None):
        return q

    attn = jd.sharded(custom, _mesh(2), seq_axis="seq", strategy="allgather")
    with pytest.raises(ValueError, match=r"needs one of the library's operations.*"
                                         r"use strategy='ring' or 'heads'"):
        attn(q, k, v)


def test_ring_only_options_are_refused_by_the_other_strategies():
    """window=, logit_soft_cap=, sinks= of exact attention reach only its own ring:
    the strategies that rebuild the call refuse them, and auto picks the ring (never a
    result without them). Dilated attention runs every strategy itself and carries
    them (CASES above)."""
    q, k, v, _, _ = _inputs(4, 2)
    cases = [
        functools.partial(jd.ring_attention, is_causal=True, window=(8, 0)),
        functools.partial(jd.ring_attention, logit_soft_cap=2.0),
        functools.partial(jd.ring_attention, sinks=jnp.zeros(4)),
    ]
    for fn, what in zip(cases, ("window=", "logit_soft_cap=", "sinks=")):
        for strategy in ("heads", "allgather"):
            attn = jd.sharded(fn, _mesh(2), seq_axis="seq", strategy=strategy)
            with pytest.raises(ValueError, match=rf"does not carry .*{what}.*"
                                                 r"use strategy='ring'"):
                attn(q, k, v)
        assert jd.explain_strategy(fn, q.shape, k.shape, num_devices=2,
                                   quiet=True)[0] == "ring"
    window = functools.partial(jd.dilated_attention, logit_soft_cap=2.0,
                               segment_lengths=(jd.SlidingWindow(8), 16),
                               dilation_rates=(1, 2))
    assert all(c.reason is None for c in jd.explain_strategy(
        window, q.shape, k.shape, num_devices=2, quiet=True)[1].values())


RETURN_LSE = [
    # (op, options, strategy, P, layout): every strategy of dilated attention, the ring
    # of the others (zigzag re-laid inside shard_map; striped with shards that do not
    # split over the devices: permuted globally, P=4 with 16 tokens per device does)
    ("dilated", dict(DILATED, is_causal=True), "ring", 4, "contiguous"),
    ("dilated", dict(DILATED, mode="head_groups"), "heads", 2, "contiguous"),
    ("dilated", dict(DILATED, is_causal=True), "allgather", 2, "contiguous"),
    ("exact", dict(is_causal=True), "ring", 2, "zigzag"),
    ("exact", dict(is_causal=False), "ring", 8, "striped"),
    ("block_sparse", dict(block_size=8, pattern=bp.LocalWindow(1), is_causal=True), "ring",
     2, "contiguous"),
]


@pytest.mark.parametrize("op,options,strategy,p,layout", RETURN_LSE,
                         ids=[f"{c[0]}-{c[2]}-P{c[3]}-{c[4]}" for c in RETURN_LSE])
def test_sharded_returns_the_lse(op, options, strategy, p, layout):
    """``jd.sharded`` of a function bound with ``return_lse=True``: ``(out, lse)`` in the
    user's token order, equal to one device's, with the gradients of a loss on both."""
    q, k, v, g, mask = _inputs(4, 2, seed=3)
    glse = np.random.default_rng(4).standard_normal((B, T, 4))
    fn = functools.partial(_FNS[op], return_lse=True, **options)
    attn = jd.sharded(fn, _mesh(p), seq_axis="seq", layout=layout, strategy=strategy)

    def run(f):
        def loss(q, k, v):
            out, lse = f(q, k, v, kv_mask=mask)
            live = jnp.isfinite(lse)  # rows with nothing to attend to: lse = -inf
            return jnp.sum(out * g) + jnp.sum(jnp.where(live, lse, 0.0) * glse), (out, lse)

        grads, (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(
            q, k, v)
        return [np.asarray(x) for x in (out, *grads)], np.asarray(lse)

    got, got_lse = run(attn)
    key = ("lse", op, repr(options))
    if key not in _ONE_DEVICE:
        _ONE_DEVICE[key] = run(fn if op != "exact" else lambda q, k, v, kv_mask: _dense(
            q, k, v, kv_mask, options["is_causal"], return_lse=True))
    want, want_lse = _ONE_DEVICE[key]
    _check(got, want)
    assert got_lse.shape == (B, T, 4)
    np.testing.assert_array_equal(np.isfinite(got_lse), np.isfinite(want_lse))
    live = np.isfinite(want_lse)
    assert np.max(np.abs(got_lse[live] - want_lse[live])) < 1e-10


def test_return_lse_refused_by_strategies_that_return_the_output_only():
    """``return_lse=True`` of exact attention: ``"heads"`` and ``"allgather"`` rebuild
    the call and return the output only, so they refuse it and name the ring."""
    q, k, v, _, _ = _inputs(4, 2)
    fn = functools.partial(jd.ring_attention, return_lse=True)
    for strategy in ("heads", "allgather"):
        with pytest.raises(ValueError, match=r"returns the output only.*use strategy='ring'"):
            jd.sharded(fn, _mesh(2), seq_axis="seq", strategy=strategy)(q, k, v)
    assert jd.explain_strategy(fn, q.shape, k.shape, num_devices=2, quiet=True)[0] == "ring"


def test_per_branch_strategy_errors_name_the_branch():
    q, k, v, _, _ = _inputs(6, 2)
    dil = functools.partial(jd.dilated_attention, **DILATED)
    with pytest.raises(ValueError, match=r"one entry of \('ring', 'allgather', 'heads'\) "
                                         r"for each of the 3 branches, got \('ring', "
                                         r"'heads'\)"):
        jd.sharded(dil, _mesh(4), seq_axis="seq", strategy=("ring", "heads"))(q, k, v)
    with pytest.raises(ValueError, match=r"strategy must be one of .* or for dilated "
                                         r"attention a tuple .* got \('ring', 'ulysses'\)"):
        jd.sharded(dil, _mesh(4), seq_axis="seq", strategy=("ring", "ulysses"))
    with pytest.raises(ValueError, match=r"a per-branch strategy \('ring', 'heads'\) needs "
                                         r"dilated_attention, got ring_attention"):
        jd.sharded(jd.ring_attention, _mesh(4), seq_axis="seq",
                   strategy=("ring", "heads"))(q, k, v)
    # 6 heads: the branch of 64 spans 4 devices, the one of 32 spans 2
    jd.sharded(dil, _mesh(4), seq_axis="seq", strategy=("ring", "heads", "ring"))
    with pytest.raises(ValueError, match=r"branch 2 \(64, rate 4\) spans 4 devices and "
                                         r"runs 6 query heads: its strategy 'heads' needs "
                                         r"them divisible by 4; use 'ring' or 'allgather'"):
        jd.sharded(dil, _mesh(4), seq_axis="seq", strategy=("ring", "heads", "heads"))(q, k, v)
    window = functools.partial(jd.dilated_attention, segment_lengths=(jd.SlidingWindow(4), 64),
                               dilation_rates=(1, 4))
    with pytest.raises(ValueError, match=r"branch 0 \(SlidingWindow.*is a sliding window.*"
                                         r"must be 'ring', got 'heads'"):
        jd.sharded(window, _mesh(2), seq_axis="seq", strategy=("heads", "ring"))(q, k, v)
    with pytest.raises(ValueError, match=r"strategy='heads' says how to parallelise the "
                                         r"sequence axis: it needs seq_axis="):
        dil(q, k, v, strategy="heads")
    with pytest.raises(ValueError, match=r"strategy='heads' needs num_heads \(6\) "
                                         r"divisible by the 4 devices of the sequence "
                                         r"axis \('seq'\), and it cannot run branch by "
                                         r"branch either .* each spanning branch's query "
                                         r"heads divisible .*; use 'ring' or 'allgather'"):
        spec = jax.sharding.PartitionSpec(None, "seq")
        jax.shard_map(lambda q, k, v: dil(q, k, v, seq_axis="seq", strategy="heads"),
                      mesh=jax.sharding.Mesh(mesh_devices(4), ("seq",)),
                      in_specs=spec, out_specs=spec)(q, k, v)


def test_auto_prices_the_per_branch_mix(capsys, monkeypatch):
    """The per-branch mix competes in "auto". On CPU a branch's all-to-all costs what
    its ring costs (measured, docs/benchmarks.md), and memory decides: 12 heads on 8
    devices keep their rings at 4096 tokens, where the ring's kernel blocks are the
    smaller, and exchange heads in the branch of 2 devices from 8192 (measured: the
    mix 1.28-1.31x the rings' time at 4096, 0.95-0.96x at 8192).

    On a GPU a ring hides its transfers only behind its own step's compute, so the
    long sparse branch over 8 devices (little compute per byte) exchanges heads, while
    the branch over 2 keeps its ring: ``("ring", "ring", "heads")``, 8 heads. At 4096
    tokens auto picks that mix: "heads" run branch by branch (the branch over 2
    exchanging heads too) is within 10% of its time and holds more (the exchange's
    full logits blocks). At 8192 the mix is still priced, and still the fastest, but
    branch-by-branch "heads" is within 10% of it (its exchange sends q, k', v' once:
    the compiled program merges the backward's re-exchange with the forward's,
    tests/test_strategy_bytes.py) and holds less, so auto picks "heads".

    jd.sharded runs the tuple auto picks, and it equals one device."""
    for t, want in ((4096, "ring"), (8192, ("ring", "heads", "ring"))):
        dil = functools.partial(jd.dilated_attention, dilation_rates=(1, 2, 4),
                                segment_lengths=(t // 16, t // 4, t), is_causal=True)
        pick, costs, _ = jd.explain_strategy(dil, (1, t, 12, 64), num_devices=8,
                                             platform="cpu", quiet=True)
        assert pick == want and costs["heads"].reason is not None, (t, pick)
    mix = ("ring", "ring", "heads")
    for t in (4096, 8192):
        dil = functools.partial(jd.dilated_attention, dilation_rates=(1, 2, 4),
                                segment_lengths=(t // 16, t // 4, t), is_causal=True)
        pick, costs, _ = jd.explain_strategy(dil, (1, t, 8, 64), num_devices=8,
                                             platform="gpu", quiet=t != 4096)
        assert costs["per_branch"].strategy == mix and costs["heads"].reason is None
        price = cost.pricing_for(describe(dil), "gpu", 1, t, 8, 64).of
        times = {s: price(costs[s]) for s in ("per_branch", "heads")}
        # branch-by-branch heads within 10% of the mix: the least memory decides
        assert times["per_branch"] <= times["heads"] <= 1.1 * times["per_branch"], times
        assert costs["heads"].sent_bytes < costs["per_branch"].sent_bytes \
            < costs["ring"].sent_bytes
        if t == 4096:
            assert costs["per_branch"].held_bytes < costs["heads"].held_bytes
            assert pick == mix, pick
            assert "per-branch ('ring', 'ring', 'heads')" in capsys.readouterr().out
        else:  # 7.5 MiB sent against the mix's 13.5 and the ring's 33, and held less
            assert costs["heads"].held_bytes < costs["per_branch"].held_bytes
            assert pick == "heads", pick
    # the tuple through jd.sharded: auto on a (pretended) GPU at this module's shapes
    small = functools.partial(jd.dilated_attention, segment_lengths=(4, 16, 64),
                              dilation_rates=(1, 2, 4), is_causal=True)
    monkeypatch.setattr(cost, "_device_kind", lambda: "gpu")
    # 8 heads: at these sizes the compute is nothing beside the bytes, and each
    # spanning branch sends the fewest exchanging heads (q, k', v' once), so the best
    # of each branch is branch-by-branch "heads" itself, which auto picks
    q, k, v, g, mask = _inputs(8, 4)
    pick, costs, _ = jd.explain_strategy(small, q.shape, k.shape, num_devices=8,
                                         dtype=q.dtype, quiet=True)
    assert pick == "heads" and "per_branch" not in costs, pick
    # 4 heads: the branch over 8 devices cannot split them (and "heads" cannot serve),
    # so it gathers, and the branch over 2 exchanges heads: the mix sends what the
    # all-gather sends and holds less (nothing of the exchanged branch until the merge)
    q, k, v, g, mask = _inputs(4, 2)
    pick, costs, _ = jd.explain_strategy(small, q.shape, k.shape, num_devices=8,
                                         dtype=q.dtype, quiet=True)
    assert pick == ("ring", "heads", "allgather") == costs["per_branch"].strategy, pick
    assert costs["heads"].reason is not None
    want = _value_and_grads(lambda q, k, v: small(q, k, v, kv_mask=mask), q, k, v, g)
    attn = jd.sharded(small, _mesh(8), seq_axis="seq", strategy="auto")
    assert "all_to_all" in str(jax.make_jaxpr(lambda q, k, v: attn(q, k, v))(q, k, v))
    _check(_value_and_grads(lambda q, k, v: attn(q, k, v, kv_mask=mask), q, k, v, g), want)


def test_cost_model_figures():
    """Bytes and memory per device follow the documented formulas."""
    fn = functools.partial(jd.ring_attention, is_causal=True)
    b, t, h, hkv, d, p = 1, 4096, 8, 2, 64, 4
    costs = cost.estimate(fn, batch=b, seq_len=t, num_heads=h, num_kv_heads=hkv,
                          head_dim=d, num_devices=p, dtype="float32",
                          layout="zigzag")
    kshard = b * (t // p) * hkv * d * 4
    qshard = b * (t // p) * h * d * 4
    # ring: k, v P times forward (the XLA kernel's ring steps bring the block home for
    # the backward), k, v P - 1 times and the dk, dv accumulators (float32) P times
    # backward: 2 P + 2 (P - 1) + 2 P = 6 P - 2 shards (22 at P = 4)
    assert costs["ring"].sent_bytes == (2 * p + 2 * (p - 1) + 2 * p) * kshard
    assert costs["ring"].sent_bytes == (6 * p - 2) * kshard == 22 * kshard
    assert costs["ring"].forward_bytes == 2 * p * kshard
    # all-gather: k, v gathered forward ((P - 1) shards each), dk, dv reduce-scattered
    # backward (as many); the backward reuses the gathered keys, it does not gather again
    assert costs["allgather"].sent_bytes == 4 * (p - 1) * kshard
    assert costs["allgather"].forward_bytes == 2 * (p - 1) * kshard
    assert costs["allgather"].held_bytes - costs["ring"].held_bytes == 4 * (p - 1) * kshard
    # 2 kv heads on 4 devices: each kv head is repeated twice before the all-to-all
    assert costs["heads"].sent_bytes == pytest.approx(2 * (p - 1) / p * (2 * qshard
                                                                        + 2 * 2 * kshard))
    assert costs["ring"].overlap and not costs["heads"].overlap
    assert costs["heads"].work == costs["ring"].work == 1 / p  # zigzag balances
    # dilated: only the branch spanning devices sends, n / r tokens of the kv heads
    # it gathers (8 here: one per query head, each at its own offset)
    dil = functools.partial(jd.dilated_attention, segment_lengths=(1024, 4096),
                            dilation_rates=(1, 4))
    costs = cost.estimate(dil, batch=b, seq_len=t, num_heads=h, num_kv_heads=h,
                          head_dim=d, num_devices=p)
    kb = b * (t // p // 4) * h * d * 4
    assert costs["ring"].sent_bytes == (6 * p - 2) * kb  # the branch's ring spans all p
    assert costs["allgather"].sent_bytes == 4 * (p - 1) * kb


def test_branch_results_held_follow_the_kernel_that_serves(monkeypatch):
    """The cost model counts each branch's held results only where the one-device program
    cannot stream them into one partial: with cuDNN. On a GPU that is half-precision
    inputs; float32 runs on the XLA kernel there, which streams, as on CPU. (Without
    the XLA kernel's logits blocks, float32 whatever the inputs: the next test.)"""
    monkeypatch.setattr(cost, "_logits_blocks_held", lambda *shape: 0.0)
    dil = functools.partial(jd.dilated_attention, segment_lengths=(1024, 4096, 16384),
                            dilation_rates=(1, 2, 4))
    shape = dict(batch=1, seq_len=16384, num_heads=8, num_kv_heads=8, head_dim=64,
                 num_devices=4)

    def held_per_element(dtype, platform, **options):
        fn = functools.partial(dil, **options)
        costs = cost.estimate(fn, dtype=dtype, platform=platform, **shape)
        return costs["ring"].held_bytes / jnp.dtype(dtype).itemsize

    cpu = held_per_element("float32", "cpu")
    assert held_per_element("bfloat16", "cpu") == cpu
    assert held_per_element("float32", "gpu") == cpu  # the XLA kernel there too
    assert held_per_element("bfloat16", "gpu") > cpu  # cuDNN: every branch holds its own
    assert held_per_element("bfloat16", "gpu", implementation="xla") == cpu
    assert held_per_element("float32", "cpu", implementation="cudnn") == \
        held_per_element("bfloat16", "gpu")


def test_layers_take_the_strategy():
    """Mesh-built layers pass strategy= to jd.sharded (NNX and Linen)."""
    from flax import nnx

    q, k, v, _, mask = _inputs(2, 2)
    mesh = _mesh(2)
    options = dict(segment_lengths=(16, 64), dilation_rates=(1, 4))
    want = jax.jit(lambda q, k, v: jd.dilated_attention(q, k, v, is_causal=True, kv_mask=mask,
                                                         **options))(q, k, v)
    for strategy in ("heads",):
        layer = jd.nnx.DilatedAttention(mesh=mesh, seq_axis="seq", strategy=strategy,
                                        **options)
        assert layer.core.strategy == strategy
        got = jax.jit(lambda q, k, v: layer(q, k, v, is_causal=True, kv_mask=mask))(q, k, v)
        _check([np.asarray(got)], [np.asarray(want)])
    # a multi-head dilated layer with learnt sinks and a soft-cap, one strategy per
    # branch over the mesh: the same as without a mesh
    kw = dict(embed_dim=16, num_heads=2, segment_lengths=(16, 64), dilation_rates=(1, 4),
              sinks=True, logit_soft_cap=2.0)
    plain = jd.nnx.MultiheadDilatedAttention(**kw, rngs=nnx.Rngs(0))
    plain.sinks.logit[...] = jnp.asarray([0.7, -0.4], plain.sinks.logit[...].dtype)
    meshed = jd.nnx.MultiheadDilatedAttention(**kw, mesh=mesh, seq_axis="seq",
                                              strategy=("ring", "heads"), rngs=nnx.Rngs(1))
    nnx.update(meshed, nnx.state(plain))
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, T, 16)), jnp.float32)
    want = nnx.jit(lambda m, x: m(x, x, x, is_causal=True))(plain, x)
    got = jax.jit(lambda x: meshed(x, x, x, is_causal=True))(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    ring = jd.linen.RingAttention(mesh=mesh, seq_axis="seq", strategy="heads")
    got = ring.apply({}, q, k, v, is_causal=True, kv_mask=mask)
    want = jax.jit(lambda q, k, v: _dense(q, k, v, mask, True))(q, k, v)  # one compilation
    _check([np.asarray(got)], [np.asarray(want)])
    with pytest.raises(ValueError, match="strategy must be one of"):
        jd.nnx.MultiheadRingAttention(embed_dim=16, num_heads=2, mesh=mesh, seq_axis="seq",
                                      strategy="ulysses", rngs=nnx.Rngs(0))


def test_auto_avoids_strategies_the_operation_would_refuse():
    """4-token zigzag chunks (T=64, P=8)
    cannot hold blocks of 8, so ring and allgather are out and 'auto' runs 'heads'."""
    fn = functools.partial(jd.block_sparse_attention, block_size=8,
                           pattern=bp.LocalWindow(1), is_causal=True)
    pick, costs, _ = jd.explain_strategy(fn, (B, T, 8, D), num_devices=8, layout="zigzag",
                                         quiet=True)
    assert pick == "heads" and "zigzag chunk length 4" in costs["ring"].reason
    q, k, v, g, mask = _inputs(8, 4)
    attn = jd.sharded(fn, _mesh(8), seq_axis="seq", layout="zigzag", strategy="auto")
    got = _value_and_grads(lambda q, k, v: attn(q, k, v, kv_mask=mask), q, k, v, g)
    want = _value_and_grads(lambda q, k, v: fn(q, k, v, kv_mask=mask), q, k, v, g)
    _check(got, want)


def test_auto_on_cpu_prefers_heads_and_elsewhere_the_overlapped_ring():
    """The calibration of docs/benchmarks.md: on CPU (devices sharing cores, nothing
    overlaps, a shard's queries in small kernel calls) heads wins wherever it serves;
    on a GPU the ring's overlapped transfers make it the pick for balanced layouts."""
    shapes = ((1, 8192, 8, 64), (1, 8192, 1, 64))
    for fn in (functools.partial(jd.ring_attention, is_causal=True),
               functools.partial(jd.block_sparse_attention, block_size=64, is_causal=True,
                                 pattern=jd.block_patterns.LocalWindow(2))):
        pick = jd.explain_strategy(fn, *shapes, num_devices=8, layout="zigzag",
                                   platform="cpu", quiet=True)[0]
        assert pick == "heads", fn
    assert jd.explain_strategy(functools.partial(jd.ring_attention, is_causal=True),
                               *shapes, num_devices=8, layout="zigzag", platform="gpu",
                               quiet=True)[0] == "ring"


def test_sharded_is_compiled_when_called_eagerly():
    """jd.sharded's function is jitted: eager calls of one shape trace the operation
    once (an eager shard_map re-ran it primitive by primitive at every call), a new
    shape traces it again, and the result equals the call under the user's jit."""
    mesh = make_mesh((2,), ("seq",), devices=jax.devices()[:2])
    q, k, v = (jnp.asarray(x) for x in _inputs(2, 2)[:3])
    traces = []

    def op(q, k, v, *, seq_axis, kv_mask=None):
        traces.append(q.shape)
        return jd.ring_attention(q, k, v, seq_axis=seq_axis, kv_mask=kv_mask, scale=0.5)

    attn = jd.sharded(op, mesh, seq_axis="seq")
    outs = [attn(q, k, v) for _ in range(3)]
    assert len(traces) == 1
    attn(q[:, :32], k[:, :32], v[:, :32])
    assert len(traces) == 2
    want = jax.jit(attn)(q, k, v)
    for out in outs:
        np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


def test_dilated_over_heads_is_a_deprecated_spelling_of_over_heads():
    """``strategies.dilated_over_heads`` (renamed ``over_heads``, which now returns the
    program for its caller to enter) still gives ``(out, lse)``, with a
    DeprecationWarning: equal to dilated attention's own "heads" strategy."""
    from jax.sharding import PartitionSpec as PS

    from jax_dilated import ops
    from jax_dilated.ops.dilated_programs import DilatedCall

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 64, 4, 8)).astype(np.float32) for _ in range(3))
    cfg = dict(segment_lengths=(8, 16), dilation_rates=(1, 2))
    call = DilatedCall.of(mode="longnet", head_offsets="modulo", head_dim=8, is_causal=False,
                          **cfg)
    spec = PS(None, "seq")
    mesh = build_mesh((4,), ("seq",), "auto")

    def old(q, k, v):
        with pytest.warns(DeprecationWarning, match="over_heads"):
            return ops.strategies.dilated_over_heads(call, q, k, v, None, None, None,
                                                     axis_name="seq", num_devices=4)[0]

    def new(q, k, v):
        return jd.dilated_attention(q, k, v, seq_axis="seq", strategy="heads", **cfg)

    got, want = (jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))(
        q, k, v) for f in (old, new))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
