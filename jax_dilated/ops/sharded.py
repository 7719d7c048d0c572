"""``jd.sharded``: run a sequence-parallel operation on global arrays over a mesh.

The user passes global ``[batch, seq, heads, head_dim]`` arrays; ``sharded``
shards batch / sequence / heads over the named mesh axes, runs the operation inside
``jax.shard_map`` (with ``check_vma=True``), where the contiguous sequence shards are
re-laid out into the ring layout and the result back (O(T / P) moved per device;
a striped layout whose shards do not split over the devices is permuted globally),
and returns the global result in the user's token order. It
works eagerly, under ``jax.jit`` and under ``jax.grad``, on meshes with Auto or
Explicit axes (``jax.make_mesh`` makes Explicit ones).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_dilated.core import layouts, validation
from jax_dilated.core.types import Array, Layout, StrategyLike
from jax_dilated.ops import strategies

__all__ = ["sharded", "place"]


def _name(fn) -> str:
    inner = getattr(fn, "func", fn)  # functools.partial
    return getattr(inner, "__name__", repr(inner))


def _axis_keyword(fn) -> str:
    """``"seq_axis"``, or ``"axis_name"`` (deprecated, with a warning) for an operation
    written against the old spelling only."""
    if strategies.accepts(fn, "seq_axis") or not strategies.accepts(fn, "axis_name"):
        return "seq_axis"
    validation.warn_renamed(
        "an operation taking axis_name= and not seq_axis=", "seq_axis=",
        f"jd.sharded({_name(fn)})", stacklevel=4)
    return "axis_name"


def place(x, mesh, spec):
    """Put ``x`` on ``mesh`` as ``spec`` says (reshard for Explicit axes)."""
    sharding = NamedSharding(mesh, spec)
    explicit = any(str(t).endswith("Explicit") for t in getattr(mesh, "axis_types", ()))
    if explicit:
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def _hybrid_axes(mesh, seq_axis, batch_axis, head_axis) -> tuple[str, str] | None:
    """``(a, b)`` for a ``seq_axis`` naming two mesh axes, None for one;
    a ``ValueError`` naming the argument when they are not mesh axes, or the same."""
    validation.check_mesh_axes(mesh, seq_axis, batch_axis, head_axis)
    return tuple(seq_axis) if isinstance(seq_axis, (tuple, list)) else None


def sharded(fn: Callable[..., Array | tuple[Array, Array]], mesh: jax.sharding.Mesh, *,
            seq_axis: str | tuple[str, str], batch_axis: str | None = None,
            head_axis: str | None = None,
            layout: Layout = "contiguous", strategy: StrategyLike = "ring",
            ) -> Callable[..., Array | tuple[Array, Array]]:
    """Wrap ``fn`` (``jd.ring_attention``, ``jd.dilated_attention``) to run on global arrays over ``mesh``.

    Args:
      fn: a sequence-parallel operation called as ``fn(query, key, value, *,
        seq_axis, kv_mask)`` on the local shards (plus ``layout=`` when ``layout``
        is not ``"contiguous"``); bind its other options with ``functools.partial``.
        An ``fn`` that takes ``axis_name=`` but not ``seq_axis=`` (the old spelling)
        still gets the axis as ``axis_name=``, with a DeprecationWarning.
      mesh: a ``jax.sharding.Mesh``.
      seq_axis: mesh axis to shard the sequence over, or two axes ``(a, b)``: with
        ``strategy="hybrid"`` the sequence is sharded over both (``b`` major), heads
        are exchanged over ``a`` and the operation's ring runs over ``b``
        (docs/semantics.md, section 8, "Hybrid"); with a one-axis strategy it runs over
        the two as one axis (in the mesh's order); ``"auto"`` prices both hybrid
        splits (heads over ``a``, or over ``b``) beside the one-axis strategies.
      batch_axis, head_axis: optional mesh axes to shard batch and heads over (heads
        and kv heads must both divide by the head axis size).
      layout: how the sequence is laid out over ``seq_axis`` (ring attention only;
        dilated attention is contiguous); the permutation into it and back is done
        here. With ``strategy="heads"`` the layout does not apply (each device
        holds the whole sequence of some heads).
      strategy: how the sequence axis is parallelised (docs/semantics.md, section 8):
        ``"ring"`` (default: the operation's own ring, ``fn`` gets ``seq_axis=``),
        ``"allgather"`` (keys and values gathered over the axis; the library's
        operations only), ``"heads"`` (all-to-all to head-sharded arrays, ``fn``
        runs unchanged, without ``seq_axis``, on the whole sequence of ``H / P``
        heads; needs the heads divisible by the axis size), ``"hybrid"`` (with
        ``seq_axis=(a, b)``: an all-to-all over ``a`` to ``H / P_a`` heads of a ring
        chunk, the operation's ring over ``b`` in ``layout``, and back; the library's
        operations (dilated attention runs it itself); needs the heads divisible by
        ``P_a``) or ``"auto"`` (chosen per call by the cost model of
        :func:`jax_dilated.explain_strategy`).
        :func:`jax_dilated.dilated_attention` runs every strategy itself: it gets
        ``seq_axis=`` and the strategy as ``strategy=``, which may also be a tuple
        with one of ``"ring"``, ``"allgather"``, ``"heads"`` per branch (how each
        branch spanning devices brings its segment together: its ring, a gather, or
        an all-to-all among its devices), and ``"auto"`` may pick such a tuple.

    Returns:
      ``g(query, key, value, *, kv_mask=None, segment_ids=None, sinks=None)`` on global
      arrays (a ``jax.jit``-compiled function: an eager call compiles once per input
      shape, and inside a jitted step it is inlined), returning the global ``[batch,
      seq, heads, head_dim]`` output in token order; with ``fn`` bound with
      ``return_lse=True``, ``(output, lse)``, the log-sum-exp ``[batch, seq, heads]``
      sharded and ordered like the output (every strategy of dilated attention, the
      ring of the others).
      ``segment_ids`` (int ``[batch, seq]``, packed documents) is sharded and laid out
      like ``kv_mask``; ``"ring"`` passes the local shard to ``fn`` (which must take
      ``segment_ids=``), ``"heads"`` gives the single-device operation the whole
      sequence's ids, ``"allgather"`` gathers them with the keys (packed dilated
      attention: docs/semantics.md, section 8). ``sinks`` (float ``[num_heads]``, the
      attention sinks of docs/semantics.md, section 1) go to ``fn`` as ``sinks=``,
      replicated (sliced by ``head_axis``), with their gradient; only ``"ring"``
      carries them (``"auto"`` then picks it).

    Example:
      >>> import functools, jax, jax_dilated as jd
      >>> mesh = jax.make_mesh((1,), ("seq",))
      >>> attn = jd.sharded(functools.partial(jd.ring_attention, is_causal=True),
      ...                   mesh, seq_axis="seq", layout="zigzag")
      >>> x = jax.random.normal(jax.random.key(0), (1, 64, 2, 8))
      >>> attn(x, x, x).shape
      (1, 64, 2, 8)
    """
    if not callable(fn):
        raise TypeError(f"fn must be an attention function (e.g. jd.ring_attention), got "
                        f"{fn!r}.")
    pair = _hybrid_axes(mesh, seq_axis, batch_axis, head_axis)
    layouts.check_layout(layout)
    strategy = strategies.check_sharded_strategy(strategy)
    if pair is None and strategy == "hybrid":
        raise ValueError(f"strategy='hybrid' needs two mesh axes, seq_axis=(a, b) (heads "
                         f"exchanged over a, a ring over b), got seq_axis={seq_axis!r}.")
    op = strategies.describe(fn)
    axis_kw = _axis_keyword(fn)
    # Only the ring takes a layout; dilated attention shards contiguously.
    layout_kw = {} if layout == "contiguous" else {"layout": layout}
    if layout_kw and not strategies.accepts(fn, "layout"):
        raise ValueError(
            f"layout={layout!r} needs an operation that takes a layout (ring_attention); "
            f"{_name(fn)} shards the sequence contiguously: use layout='contiguous'."
        )
    # The one-axis strategies over a pair see its axes as one, in the mesh's order
    # (the order in which JAX's collectives number the devices of several axes)
    flat = seq_axis if pair is None else tuple(x for x in mesh.axis_names if x in pair)
    num = math.prod(mesh.shape[x] for x in ((seq_axis,) if pair is None else pair))

    def run(query, key, value, *, kv_mask=None, segment_ids=None, sinks=None):
        # check the global shapes here: inside shard_map a mistake would be reported
        # with shard shapes, or by JAX's sharding machinery
        b, t, h, hkv, tk = validation.check_qkv(query, key, value)
        if tk != t:
            raise ValueError(
                f"jd.sharded shards query and key/value over the same sequence axis: they "
                f"must have the same length, got query {tuple(query.shape)} and key "
                f"{tuple(key.shape)}.")
        if batch_axis is not None and b % mesh.shape[batch_axis]:
            raise ValueError(
                f"batch_axis={batch_axis!r} has {mesh.shape[batch_axis]} devices: the "
                f"batch size must be divisible by it, got query {tuple(query.shape)}.")
        validation.check_kv_mask(kv_mask, query.shape[0], key.shape[1])
        segment_ids = validation.check_segment_ids(segment_ids, query.shape, key.shape)
        packed = segment_ids is not None
        sinks = validation.check_sinks(sinks, h)
        if sinks is not None and not strategies.accepts(fn, "sinks"):
            raise ValueError(f"sinks= needs a function that takes sinks=, and "
                             f"{_name(fn)} does not.")
        if head_axis is not None:
            hsize = mesh.shape[head_axis]
            if h % hsize or hkv % hsize:
                raise ValueError(
                    f"head_axis={head_axis!r} has {hsize} devices: num_heads "
                    f"({h}) and num_kv_heads ({hkv}) must both be "
                    f"divisible by it."
                )
        heads_per_shard = h // mesh.shape[head_axis] if head_axis is not None else h
        heads_of = "" if head_axis is None else f" in each shard of head_axis={head_axis!r}"
        # a call with sinks: the strategies that rebuild the call cannot carry them
        # (strategies.servable), so the operation is described with them bound
        op_call = op if sinks is None else dataclasses.replace(
            op, options={**op.options, "sinks": True})
        kv_per_shard = hkv // mesh.shape[head_axis] if head_axis is not None else hkv
        chosen, axes = strategy, flat
        if strategy == "auto":
            sizes = None if pair is None else (mesh.shape[pair[0]], mesh.shape[pair[1]])
            chosen = strategies.choose(
                op_call, batch=b, seq_len=t, num_heads=heads_per_shard,
                num_kv_heads=kv_per_shard, head_dim=query.shape[-1], num_devices=num,
                dtype=query.dtype, layout=layout, segment_ids=packed, axis_sizes=sizes)[0]
            if isinstance(chosen, tuple) and chosen[0] == "hybrid":
                # heads over the axis whose size came first: the pair as given, or swapped
                chosen, axes = "hybrid", (pair if chosen[1:] == sizes else pair[::-1])
        elif strategy == "hybrid":
            axes = pair
        if chosen == "hybrid":
            size_a, size_b = mesh.shape[axes[0]], mesh.shape[axes[1]]
            why = strategies.hybrid_unservable(op, num_heads=heads_per_shard,
                                               size_a=size_a, heads_of=heads_of,
                                               axis=axes[0])
            if why:
                raise ValueError(f"{why}.")
            # pieces over both axes, the layout over the ring's
            layouts.check_divisible(t, num, "contiguous")
            layouts.check_divisible(t, size_b, layout)
            return compiled("hybrid", "contiguous", False, axes, query, key, value, kv_mask,
                            segment_ids, sinks)
        layouts.check_divisible(t, num, layout)
        strategies.require(
            op_call, chosen, num_heads=heads_per_shard, num_devices=num, layout=layout,
            seq_len=t, heads_of=heads_of, segment_ids=packed,
            num_kv_heads=kv_per_shard)
        # the heads strategy needs no layout: it moves whole heads, not tokens
        lay = "contiguous" if chosen == "heads" else layout
        # Re-layout inside shard_map (O(T / P) moved per device) when the shards allow
        # it: striped needs the local length to split over the P devices.
        in_shard = lay == "zigzag" or (lay == "striped"
                                       and (query.shape[1] // num) % num == 0)
        return compiled(chosen, lay, in_shard, axes, query, key, value, kv_mask, segment_ids,
                        sinks)

    def program(chosen, lay, in_shard, axes, query, key, value, kv_mask, segment_ids, sinks):
        """The checked call: placement, ``shard_map`` and the way back. ``axes``: the
        sequence axis (a name, or a pair's axes as one) of a one-axis strategy, or the
        pair ``(a, b)`` of ``"hybrid"`` (heads over ``a``, the ring over ``b``)."""
        # hybrid: b major, so that after the all-to-all over a ring chunk i_b is whole
        # on device i_b
        seq_spec = (axes[1], axes[0]) if chosen == "hybrid" else axes
        qkv_spec = P(batch_axis, seq_spec, head_axis, None)
        mask_spec = P(batch_axis, seq_spec)
        # (output, lse) when fn is bound with return_lse=True, else the output
        out_specs = (qkv_spec, P(batch_axis, seq_spec, head_axis)) if op.options.get(
            "return_lse") else qkv_spec

        def to(x, spec):
            if lay == "contiguous" or in_shard:
                return place(x, mesh, spec)
            # Permute the global sequence (a transient O(T) copy per device), with the
            # sequence unsharded: a gather along a sharded axis is ambiguous on
            # Explicit meshes.
            whole = P(*(None if a == seq_spec else a for a in spec))
            x = layouts.to_layout(place(x, mesh, whole), num, lay)
            return place(x, mesh, spec)

        # per-token arrays (padding mask, document ids) go where their tokens go
        given = [x for x in (kv_mask, segment_ids) if x is not None]
        args = [to(x, qkv_spec) for x in (query, key, value)] + [
            to(x, mask_spec) for x in given]
        specs = [qkv_spec] * 3 + [mask_spec] * len(given)
        if sinks is not None:  # per head: replicated over the sequence
            args.append(place(sinks, mesh, P(head_axis)))
            specs.append(P(head_axis))

        def local(q, k, v, *tokens):
            """One device's shards: re-laid out, the strategy run, laid back."""
            tokens = iter(tokens)
            mask = None if kv_mask is None else next(tokens)
            ids = None if segment_ids is None else next(tokens)
            sink = None if sinks is None else next(tokens)
            if in_shard:
                q, k, v, mask, ids = (None if x is None else
                                      layouts.shard_to_layout(x, axes, num, lay)
                                      for x in (q, k, v, mask, ids))
            # dilated attention runs every strategy itself (strategy=); the others'
            # strategies are the library's, around the operation
            own = op.kind == "dilated" or chosen == "ring"
            if own:
                extra = {} if chosen == "ring" else {"strategy": chosen}
                if ids is not None:
                    extra["segment_ids"] = ids
                if sink is not None:
                    extra["sinks"] = sink
                out = fn(q, k, v, kv_mask=mask, **{axis_kw: axes}, **layout_kw, **extra)
            elif chosen == "hybrid":
                out = strategies.hybrid_local(
                    op, q, k, v, mask, ids, sink, axes=axes, layout=layout,
                    sizes=(mesh.shape[axes[0]], mesh.shape[axes[1]]))
            elif chosen == "heads":
                out = strategies.heads_local(op, q, k, v, mask, ids, axis_name=axes,
                                             num_devices=num)
            else:
                out = strategies.allgather_local(op, q, k, v, mask, ids, axis_name=axes,
                                                 num_devices=num, layout=lay)
            if not in_shard:
                return out
            if isinstance(out, tuple):  # (output, lse)
                return tuple(layouts.shard_from_layout(x, axes, num, lay) for x in out)
            return layouts.shard_from_layout(out, axes, num, lay)

        out = jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=out_specs,
                            check_vma=True)(*args)
        if lay == "contiguous" or in_shard:
            return out

        def back(x, spec):  # back in token order, sharded like a contiguous result
            whole = P(*(None if a == seq_spec else a for a in spec))
            return place(layouts.from_layout(place(x, mesh, whole), num, lay), mesh, spec)

        if isinstance(out, tuple):
            return tuple(back(x, spec) for x, spec in zip(out, out_specs))
        return back(out, out_specs)

    # Compiled, also when called eagerly: an eager shard_map runs its body one
    # primitive at a time on every shard (a dilated call on 32 tokens took 9 s per
    # call that way, against 0.3 s to compile it once). The checks stay outside, so
    # that their errors read as raised here; inside a user's jit it is all inlined.
    compiled = jax.jit(program, static_argnums=(0, 1, 2, 3))
    return run
