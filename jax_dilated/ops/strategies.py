"""Context-parallel strategies: how ``jd.sharded`` runs an operation over a sequence axis.

With the sequence sharded over the ``P`` devices of a mesh axis (``n = T / P`` tokens
each), an attention operation can run three ways (docs/semantics.md, section 8):

* ``"ring"`` (the default): the operation's own ring. Key/value shards travel with
  ``ppermute``, one hop per step, each transfer overlapped with the previous step's
  compute (:mod:`jax_dilated.ops.ring`, :mod:`jax_dilated.ops.distributed`).
* ``"allgather"`` (Llama-3 style): every device gathers all keys and values (with
  their padding mask) over the axis, ``jax.lax.all_gather``, and attends its local
  queries to all of them in one kernel call, with global positions so that causal
  attention is exact in every layout (zigzag / striped balance the causal work). The
  gradient of ``all_gather`` is a reduce-scatter (``psum_scatter``) of dk/dv, which
  JAX's autodiff inserts. Dilated attention gathers per branch that spans devices,
  over the devices of its segment only; block-sparse attention visits the listed
  blocks of the gathered keys. Anything travelling with the keys per token (the
  padding mask, the document ids of packed rows) is gathered the same way
  (:func:`gather_tokens`); the kernel compares the local queries' ids with them.
* ``"heads"`` (DeepSpeed-Ulysses): one ``all_to_all`` turns the sequence-sharded
  ``[B, n, H, D]`` into head-sharded ``[B, T, H / P, D]`` (the whole sequence, a
  ``1/P`` slice of the heads), the single-device operation runs unchanged on it, and
  a second ``all_to_all`` brings the output back. It needs ``H % P == 0``. GQA:
  when ``P`` does not divide the kv heads, every kv head is repeated
  ``R = P / gcd(H_kv, P)`` times first (the least that makes the kv heads divide by
  ``P`` while every device still reads whole GQA groups), so each device receives
  exactly the kv heads its query heads read. Dilated attention keeps the *global*
  head numbering for its offsets (a device whose heads have other offsets runs its
  own static plan), so the result is the single-device one. Document ids are
  gathered whole and given to the single-device operation.

Dilated attention runs every strategy itself (``strategy=`` of
:func:`jax_dilated.dilated_attention`, :mod:`jax_dilated.ops.distributed`), and also
takes one per branch: a tuple such as ``("ring", "heads", "allgather")``, where
``"heads"`` for a branch spanning ``g`` devices is an all-to-all among those ``g``.
Packed dilated attention (``segment_ids``) restarts its segment grid at every document,
so its segments do not sit on the shards: under every strategy each device runs the
single-device packed program on the whole sequence of some heads
(:func:`dilated_over_heads`).

``"auto"`` chooses one (for dilated attention possibly a per-branch tuple) from the
cost model of :func:`estimate` (bytes sent and memory held per device, whether the
transfer overlaps compute); :func:`explain_strategy` prints the choice and the
numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_dilated.backends import get_kernel, selection
from jax_dilated.backends.base import KeySide, QuerySide, RowGrads
from jax_dilated.backends.xla.layout import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q
from jax_dilated.core import branch_plans, layouts, softmax, validation
from jax_dilated.core.branches import is_window
from jax_dilated.ops import block_sparse as block_sparse_ops
from jax_dilated.ops import dilated as dilated_ops
from jax_dilated.ops import distributed, head_parallel
from jax_dilated.ops.block_sparse_plan import head_classes, resolve_mask, ring_blocks
# the head-parallel transforms are part of this module's public names
from jax_dilated.ops.head_parallel import (gather_tokens, heads_to_seq, dilated_over_heads,
                                           seq_to_heads)
from jax_dilated.ops.ring import ring_attention

__all__ = ["STRATEGIES", "Operation", "describe", "accepts", "check_strategy", "servable",
           "seq_to_heads", "heads_to_seq", "gather_tokens", "heads_local",
           "allgather_local", "dilated_over_heads", "StrategyCost", "estimate", "choose",
           "explain_strategy"]

STRATEGIES = ("ring", "allgather", "heads", "auto")


# --------------------------------------------------------------------- the operation


@dataclasses.dataclass(frozen=True, eq=False)
class Operation:
    """What ``jd.sharded`` was given: which library operation and its bound options.

    kind: ``"exact"`` (:func:`jax_dilated.ring_attention`), ``"dilated"``,
      ``"block_sparse"``, or ``"custom"`` (any other function: only ``"ring"``, which
      passes it ``seq_axis``, and ``"heads"``, which calls it without, can run it).
    fn: the function as given; options: the keywords bound with ``functools.partial``.
    """

    kind: str
    fn: object
    options: dict

    @property
    def name(self) -> str:
        return {"exact": "ring_attention", "dilated": "dilated_attention",
                "block_sparse": "block_sparse_attention"}.get(self.kind, "a custom function")


def describe(fn) -> Operation:
    """The :class:`Operation` of ``fn`` (a library operation, possibly under
    ``functools.partial`` with keywords only, or anything else: ``"custom"``)."""
    base, options = fn, {}
    while isinstance(base, functools.partial) and not base.args:
        options = {**base.keywords, **options}
        base = base.func
    kinds = {ring_attention: "exact", dilated_ops.dilated_attention: "dilated",
             block_sparse_ops.block_sparse_attention: "block_sparse"}
    kind = kinds.get(base, "custom")
    return Operation(kind, fn, options if kind != "custom" else {})


def accepts(fn, name: str) -> bool:
    """Whether ``fn`` takes the keyword ``name`` (True when its signature cannot be read:
    the call then decides)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def servable(op: Operation, *, num_heads: int, num_devices: int, layout: str,
             seq_len: int | None = None, heads_of: str = "",
             segment_ids: bool = False) -> dict:
    """``{strategy: None or why it cannot serve}`` for the concrete strategies.

    With ``seq_len`` the operation's own sharding rules are checked too (dilated
    segments that would straddle devices, block-sparse blocks that would straddle
    shards), so that ``"auto"`` never picks a strategy that would then refuse.
    ``heads_of`` says whose heads ``num_heads`` counts in messages (e.g. those of one
    ``head_axis`` shard). ``segment_ids``: the call has packed rows; a custom function
    must then take ``segment_ids=``, and packed dilated attention has no segment rule
    to check (it runs whole sequences of some heads, :func:`dilated_over_heads`).
    """
    why = {"ring": None, "allgather": None, "heads": None}
    why["heads"] = head_parallel.heads_unservable(num_heads, num_devices, heads_of)
    if (why["heads"] and op.kind == "dilated" and not segment_ids and seq_len is not None
            and layout == "contiguous"
            and _dilated_heads_by_branch(op, seq_len, num_heads, num_devices)):
        why["heads"] = None  # it runs branch by branch (distributed.heads_by_branch)
    if op.kind == "custom":
        why["allgather"] = ("strategy='allgather' needs one of the library's operations "
                            "(ring_attention, dilated_attention, block_sparse_attention), "
                            f"got {_fn_name(op.fn)}")
        if segment_ids and not accepts(op.fn, "segment_ids"):
            for s in ("ring", "heads"):
                why[s] = why[s] or (f"segment_ids needs a function that takes "
                                    f"segment_ids=, and {_fn_name(op.fn)} does not")
    sequence = None
    if op.kind == "dilated" and layout != "contiguous":
        sequence = f"dilated attention shards the sequence contiguously, got layout={layout!r}"
    elif op.kind == "block_sparse" and layout == "striped":
        sequence = ("block-sparse attention needs shards made of whole blocks, got "
                    "layout='striped'")
    elif seq_len is not None and op.kind == "dilated" and segment_ids:
        pass  # packed rows: every strategy runs whole sequences (dilated_over_heads)
    elif seq_len is not None and op.kind in ("dilated", "block_sparse"):
        try:
            n = seq_len // num_devices
            if op.kind == "dilated":
                branches = branch_plans.validate_branches(op.options["segment_lengths"],
                                                          op.options["dilation_rates"])
                distributed.shard_branches(branches, local_len=n, num_devices=num_devices)
            else:
                ring_blocks(n, num_devices, layout, op.options["block_size"])
        except (ValueError, TypeError, KeyError) as err:
            sequence = str(err).rstrip(".")
    if sequence:
        why["ring"] = why["allgather"] = sequence
    unsupported = _ring_only_options(op)
    if unsupported:
        for s in ("allgather", "heads"):
            why[s] = why[s] or (f"strategy={s!r} does not carry {unsupported} yet (only "
                                "the operation's own ring does)")
    if op.options.get("return_lse") and op.kind != "dilated":
        # dilated attention returns its lse under every strategy (strategy=)
        for s in ("allgather", "heads"):
            why[s] = why[s] or (f"strategy={s!r} returns the output only, not the "
                                "log-sum-exp of return_lse=True (the operation's own "
                                "ring does)")
    return why


def _plans_of(op: Operation, *, seq_len: int, num_heads: int, num_kv_heads: int):
    """``(branches, plans)`` of a dilated ``op`` for these shapes (its own validation
    errors propagate)."""
    branches = branch_plans.validate_branches(op.options["segment_lengths"],
                                              op.options["dilation_rates"])
    plans = branch_plans.plan_branches(
        branches, seq_len=seq_len, num_heads=num_heads, num_kv_heads=num_kv_heads,
        mode=op.options.get("mode", "longnet"),
        offsets_rule=op.options.get("head_offsets", "modulo"))
    return branches, plans


def _dilated_heads_by_branch(op: Operation, seq_len: int, num_heads: int,
                            num_devices: int) -> bool:
    """Whether dilated attention's ``"heads"`` runs branch by branch
    (:func:`jax_dilated.ops.distributed.heads_by_branch`; its query heads decide)."""
    try:
        branches, plans = _plans_of(op, seq_len=seq_len, num_heads=num_heads,
                                    num_kv_heads=num_heads)
    except (ValueError, TypeError, KeyError):
        return False
    return distributed.heads_by_branch(branches, plans, local_len=seq_len // num_devices,
                                       num_devices=num_devices) is not None


def _ring_only_options(op: Operation) -> str:
    """The options of ``op`` that only its own ring applies (the other strategies
    rebuild the call from plain options and would drop them), as ``"a=, b="``.
    Dilated attention runs every strategy itself (``strategy=`` of
    :func:`jax_dilated.dilated_attention`), so it carries all of its options."""
    if op.kind == "dilated":
        return ""
    names = [name for name in ("window", "logit_soft_cap", "sinks")
             if op.options.get(name) is not None]
    return ", ".join(f"{n}=" for n in names)


def _fn_name(fn) -> str:
    inner = getattr(fn, "func", fn)
    return getattr(inner, "__name__", repr(inner))


def check_strategy(strategy):
    """``strategy`` as given: one of :data:`STRATEGIES`, or (dilated attention) a
    tuple of ``"ring"``, ``"allgather"``, ``"heads"``, one per branch (its length is
    checked against the branches at the call)."""
    if isinstance(strategy, str) and strategy in STRATEGIES:
        return strategy
    if (isinstance(strategy, (tuple, list)) and strategy
            and all(isinstance(e, str) and e in distributed.BRANCH_STRATEGIES
                    for e in strategy)):
        return tuple(strategy)
    raise ValueError(f"strategy must be one of {STRATEGIES}, or for dilated attention a "
                     f"tuple with one of {distributed.BRANCH_STRATEGIES} per branch, got "
                     f"{strategy!r}.")


def require(op: Operation, strategy, *, num_heads: int, num_devices: int,
            layout: str, seq_len: int | None = None, heads_of: str = "",
            segment_ids: bool = False, num_kv_heads: int | None = None) -> None:
    """Raise ``ValueError`` naming the strategies that can serve when ``strategy``
    cannot. (``"ring"`` without segment ids is left to the operation, whose own
    messages say why.)"""
    if isinstance(strategy, tuple):
        return _require_per_branch(op, strategy, num_heads=num_heads,
                                   num_kv_heads=num_kv_heads or num_heads,
                                   num_devices=num_devices, layout=layout,
                                   seq_len=seq_len, segment_ids=segment_ids)
    if strategy == "ring" and not segment_ids:
        return
    why = servable(op, num_heads=num_heads, num_devices=num_devices, layout=layout,
                   seq_len=seq_len, heads_of=heads_of, segment_ids=segment_ids)
    if why.get(strategy) is None:
        return
    others = [s for s, w in why.items() if w is None]
    alt = (f"use strategy={others[0]!r}" + "".join(f" or {s!r}" for s in others[1:])
           if others else "no strategy can serve this call")
    raise ValueError(f"{why[strategy]}; {alt} (strategy='auto' chooses among those).")


def _require_per_branch(op, strategy, *, num_heads, num_kv_heads, num_devices, layout,
                        seq_len, segment_ids):
    """A per-branch strategy: dilated attention only, one entry per branch, each able
    to serve its branch (:func:`jax_dilated.ops.distributed.branch_strategies`)."""
    if op.kind != "dilated":
        raise ValueError(f"a per-branch strategy {strategy!r} needs dilated_attention, got "
                         f"{op.name}; use one of {STRATEGIES}.")
    branches = branch_plans.validate_branches(op.options["segment_lengths"],
                                              op.options["dilation_rates"])
    distributed.check_strategy(strategy, len(branches))
    if segment_ids or seq_len is None:
        return  # packed rows run whole sequences of some heads under every strategy
    if layout != "contiguous":
        raise ValueError(f"dilated attention shards the sequence contiguously, got "
                         f"layout={layout!r}.")
    plans = branch_plans.plan_branches(
        branches, seq_len=seq_len, num_heads=num_heads, num_kv_heads=num_kv_heads,
        mode=op.options.get("mode", "longnet"),
        offsets_rule=op.options.get("head_offsets", "modulo"))
    sbs = distributed.shard_branches(branches, local_len=seq_len // num_devices,
                                     num_devices=num_devices)
    distributed.branch_strategies(strategy, plans, sbs)


# ------------------------------------------------------------------ heads strategy


def heads_local(op: Operation, q, k, v, mask, segment_ids=None, *, axis_name: str,
                num_devices: int):
    """Inside ``shard_map`` on contiguous shards: the ``"heads"`` strategy.

    ``q`` [B, n, H, D], ``k``/``v`` [B, n, H_kv, D], ``mask`` and ``segment_ids`` None or
    [B, n]; returns [B, n, H, D]. ``H`` must divide by ``P`` (checked by
    :func:`require`). The ids are gathered whole, like the mask, and the single-device
    operation gets them (exact attention: the kernel's document mask). Dilated
    attention runs its strategies itself (``strategy=`` of
    :func:`jax_dilated.dilated_attention`), so it does not come here.
    """
    p, num_heads = num_devices, q.shape[2]
    q, k, v, mask, ids = head_parallel.to_heads(q, k, v, mask, segment_ids, axis_name, p)
    kw = {key: val for key, val in op.options.items()
          if key not in ("seq_axis", "axis_name", "layout", "kv_mask", "segment_ids")}
    extra = {} if ids is None else {"segment_ids": ids}
    if op.kind == "exact" and ids is not None:
        # packed rows: the kernel's document mask (equal ids attend wherever they are;
        # dilated attention's packed program would cut repeated runs apart)
        kernel = get_kernel(kw.get("implementation"))
        out = kernel.attention(q, k, v, head_parallel.kernel_args(kw, q.shape[-1]),
                               kv_valid=mask, q_segment_ids=ids, k_segment_ids=ids,
                               lse_grad=False)[0].astype(q.dtype)
    elif op.kind == "exact":
        # exact attention on one device: one segment of the whole sequence, rate 1
        out = dilated_ops.dilated_attention(
            q, k, v, segment_lengths=(q.shape[1],), dilation_rates=(1,), kv_mask=mask,
            **{key: kw[key] for key in ("is_causal", "scale", "implementation",
                                        "block_q", "block_k") if key in kw})
    elif op.kind == "block_sparse":
        out = _block_sparse_heads(op.fn, kw, q, k, v, mask, axis_name, p, num_heads, extra)
    else:
        out = op.fn(q, k, v, kv_mask=mask, **extra)
    return heads_to_seq(out, axis_name)


def _block_sparse_heads(fn, kw, q, k, v, mask, axis_name, num_devices, num_heads, extra):
    """Block-sparse attention of this device's heads: a per-head pattern is cut to them."""
    bs = validation.check_positive_int("block_size", kw["block_size"])
    nb = -(-q.shape[1] // bs)
    pattern = resolve_mask(kw["pattern"], nb, nb, num_heads)
    if pattern.shape[0] == 1:
        return fn(q, k, v, kv_mask=mask, **extra)
    h = q.shape[2]
    if not isinstance(pattern, np.ndarray):  # traced: this device's slice of it
        mine = jax.lax.dynamic_slice_in_dim(pattern, jax.lax.axis_index(axis_name) * h, h)
        return fn(q, k, v, kv_mask=mask, pattern=mine, **extra)
    variants = [(pattern[d * h:(d + 1) * h].tobytes(), pattern[d * h:(d + 1) * h])
                for d in range(num_devices)]
    return head_parallel.by_device(axis_name, variants,
                      lambda m: fn(q, k, v, kv_mask=mask, pattern=m, **extra))


# -------------------------------------------------------------- allgather strategy


def _chunk_block(layout: str, n: int, given):
    """Kernel block aligned to the layout's chunks (zigzag: ``n / 2``), as the ring does."""
    if given is not None or layout != "zigzag":
        return given
    chunk = n // 2
    best = max(d for d in range(1, min(chunk, 512) + 1) if chunk % d == 0)
    return best if best >= min(64, chunk) else chunk


def allgather_local(op: Operation, q, k, v, mask, segment_ids=None, *, axis_name: str,
                    num_devices: int, layout: str):
    """Inside ``shard_map`` on ``layout`` shards: the ``"allgather"`` strategy.

    ``q`` [B, n, H, D], ``k``/``v`` [B, n, H_kv, D], ``mask`` and ``segment_ids`` None
    or [B, n]; returns [B, n, H, D] (this device's queries against every key). The ids
    are gathered with the keys: the kernel compares the local queries' ids [B, n] with
    the gathered keys' [B, T]. Exact and block-sparse attention only: dilated
    attention runs its strategies itself (``strategy=`` of
    :func:`jax_dilated.dilated_attention`).
    """
    o = op.options
    p, n = num_devices, q.shape[1]
    kall, vall, mall, idsall = (gather_tokens(x, axis_name)
                                for x in (k, v, mask, segment_ids))
    if op.kind == "block_sparse":
        return _block_sparse_allgather(o, q, kall, vall, mall, axis_name, p, layout,
                                       segment_ids, idsall)
    # positions of this device's queries and of the gathered keys (in layout order)
    q_pos = layouts.local_positions(layout, jax.lax.axis_index(axis_name), p, n)
    k_pos = jnp.asarray(layouts.global_order(n * p, p, layout), jnp.int32)
    args = head_parallel.kernel_args(o, q.shape[-1])
    args = dataclasses.replace(args, block_q=_chunk_block(layout, n, args.block_q),
                               block_k=_chunk_block(layout, n, args.block_k))
    kernel = get_kernel(o.get("implementation"))
    ids = {} if segment_ids is None else dict(q_segment_ids=segment_ids,
                                              k_segment_ids=idsall)
    out = kernel.attention(q, kall, vall, args, q_positions=q_pos, k_positions=k_pos,
                           kv_valid=mall, lse_grad=False, **ids)[0]
    return out.astype(q.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class _SparseGather:
    """Static part of a block-sparse call against gathered keys (identity-hashed)."""

    kernel: object
    plan: object
    axis_name: str
    layout: str
    num_devices: int


def _sparse_sides(spec: _SparseGather, q, k, v, valid, ids):
    p, n = spec.num_devices, q.shape[1]
    me = jax.lax.axis_index(spec.axis_name)
    q_ids, k_ids = (None, None) if ids is None else ids
    query = QuerySide(q, layouts.local_positions(spec.layout, me, p, n), me, q_ids)
    keys = KeySide((k, v), jnp.asarray(layouts.global_order(n * p, p, spec.layout),
                                       jnp.int32), valid, 0, segments=k_ids)
    return query, keys


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sparse_gathered(spec, q, k, v, valid, aux, ids):
    return _sparse_fwd(spec, q, k, v, valid, aux, ids)[0]


def _sparse_fwd(spec, q, k, v, valid, aux, ids):
    steps = block_sparse_ops._ClassSteps(spec.kernel, spec.plan, aux)
    query, keys = _sparse_sides(spec, q, k, v, valid, ids)
    o, lse, *lse_lo = steps.partial(query, keys)  # lse_lo where the kernel splits lse
    return o, (q, k, v, valid, aux, ids, o, lse, lse_lo)


def _sparse_bwd(spec, res, do):
    q, k, v, valid, aux, ids, o, lse, lse_lo = res
    steps = block_sparse_ops._ClassSteps(spec.kernel, spec.plan, aux)
    query, keys = _sparse_sides(spec, q, k, v, valid, ids)
    zero = jnp.zeros_like(lse)
    if lse_lo:  # the log-sum-exp's low part is folded into do and delta
        do, delta = softmax.backward_rows(do, o, lse_lo[0], zero)
    else:
        delta = softmax.backward_delta(do, o, zero)
    dq, dk, dv = steps.grads(query, keys, RowGrads(do, lse, delta))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_sparse_gathered.defvjp(_sparse_fwd, _sparse_bwd)


def _block_sparse_allgather(o, q, kall, vall, mall, axis_name, p, layout, ids=None,
                            idsall=None):
    """This device's query blocks against the gathered keys, over the listed blocks
    (with ``ids`` [B, n] / ``idsall`` [B, T]: the document ids of both)."""
    bs = validation.check_positive_int("block_size", o["block_size"])
    n, h, hkv = q.shape[1], q.shape[2], kall.shape[2]
    gq = ring_blocks(n, p, layout, bs)           # [P, n / bs] global query blocks
    gk = gq.reshape(1, -1)                       # the gathered keys, in layout order
    nb = gq.size
    mask = resolve_mask(o["pattern"], nb, nb, h)
    args = dataclasses.replace(head_parallel.kernel_args(o, q.shape[-1]), block_q=bs,
                               block_k=bs)
    kernel = get_kernel(o.get("implementation"))
    classes, aux = head_classes(mask, h, hkv, gq, gk, args.is_causal)
    plan = block_sparse_ops._Plan(kernel, args, classes, h, gq, gk)
    spec = _SparseGather(kernel, plan, axis_name, layout, p)
    out = _sparse_gathered(spec, q, kall, vall, mall, aux,
                           None if ids is None else (ids, idsall))
    return out.astype(q.dtype)


# --------------------------------------------------------------------- cost model


@dataclasses.dataclass(frozen=True)
class StrategyCost:
    """Per-device figures of one strategy for one call (forward + backward).

    strategy: the strategy (a tuple with one entry per branch for the per-branch
      mix of dilated attention).
    sent_bytes: bytes each device sends (forward and backward together).
    held_bytes: the largest inputs/outputs/transfer buffers a device holds at once
      for the attention (its shards, what it gathered or received, the output and
      gradient accumulators). Kernel temporaries, the same for every strategy up to
      the block sizes, are not counted, except where the block sizes differ by
      strategy: the XLA kernel's logits blocks of a dilated branch spanning devices
      (:func:`_logits_blocks_held`).
    overlap: whether all transfers can overlap compute (a ring sends the next block
      while computing on this one).
    work: the largest share of the attention's arithmetic one device does (1 / P when
      balanced; causal contiguous shards put up to 2 / (P + 1) on the last device).
    reason: None when the strategy can serve, else why not.
    small_work: the part of ``work`` done in kernel calls over a shard's tokens (a
      ring's steps, the all-gather's blocks, dilated branches run on the shards), which
      costs more than one call over a whole sequence on CPU (:data:`_CPU_SEQ_SHARDED_WORK`).
    overlapped_bytes: the part of ``sent_bytes`` that overlaps compute (None: all of
      it when ``overlap``, else none).
    note: None, or how the strategy runs this call where that is not its usual way
      (dilated attention's ``"heads"`` branch by branch), printed by
      :func:`explain_strategy`.
    """

    strategy: str | tuple
    sent_bytes: float
    held_bytes: float
    overlap: bool
    work: float
    reason: str | None = None
    small_work: float = 0.0
    overlapped_bytes: float | None = None
    note: str | None = None

    @property
    def overlappable(self) -> float:
        """Bytes whose transfer may overlap compute (``overlapped_bytes``, or by
        ``overlap``)."""
        if self.overlapped_bytes is not None:
            return self.overlapped_bytes
        return self.sent_bytes if self.overlap else 0.0


def _causal_share(p: int, layout: str, causal: bool) -> float:
    if not causal or p == 1 or layout != "contiguous":
        return 1.0 / p
    return 2.0 / (p + 1)  # the last device's P blocks of the P (P + 1) / 2


@dataclasses.dataclass(frozen=True)
class _Pricing:
    """How :func:`choose` turns a :class:`StrategyCost` into an estimated time."""

    kind: str  # device kind: "cpu", "gpu", "tpu"
    flops: float  # of the whole call, forward and backward

    @property
    def cpu(self) -> bool:
        return self.kind == "cpu"

    @property
    def balance(self) -> float:
        return _BALANCE.get(self.kind, _BALANCE["gpu"])

    def time(self, work: float, small_work: float, sent: float,
             overlapped: float) -> float:
        """``compute + exposed transfer``, in flops (:meth:`exposed`)."""
        return (self._compute(work, small_work)
                + self.exposed(work, small_work, sent, overlapped) * self.balance)

    def exposed(self, work: float, small_work: float, sent: float,
                overlapped: float) -> float:
        """Bytes whose transfer compute does not hide: an overlapped transfer hides
        behind the compute only up to the compute's own time (a ring step waits for
        its next block), and on CPU nothing overlaps."""
        if self.cpu:
            return sent
        return sent - min(overlapped, self._compute(work, small_work) / self.balance)

    def _compute(self, work: float, small_work: float) -> float:
        factor = _CPU_SEQ_SHARDED_WORK if self.cpu else 1.0
        return (work + (factor - 1.0) * small_work) * self.flops

    def of(self, c: StrategyCost) -> float:
        return self.time(*self._parts(c))

    def exposed_of(self, c: StrategyCost) -> float:
        return self.exposed(*self._parts(c))

    @staticmethod
    def _parts(c: StrategyCost):
        return c.work, c.small_work, c.sent_bytes, c.overlappable


def _pricing(op: Operation, platform, b, t, h, d) -> _Pricing:
    return _Pricing(platform or _device_kind(), sum(_branch_flops(op, b, t, h, d)))


def estimate(op, *, batch: int, seq_len: int, num_heads: int, num_kv_heads: int,
             head_dim: int, num_devices: int, dtype="float32",
             layout: str = "contiguous", segment_ids: bool = False,
             platform: str | None = None) -> dict:
    """``{strategy: StrategyCost}`` for the three concrete strategies, and for dilated
    attention ``"per_branch"``: the best strategy for each branch on its own, where
    that mix differs from all three (its ``strategy`` is the tuple).

    ``op``: an :class:`Operation` or the function given to ``jd.sharded``. The
    figures are per device, for a forward and backward pass, from the shapes alone
    (``e`` bytes per element, ``n = T / P``, ``K = B n H_kv D e`` one shard of keys):

    * ring: sends ``(P - 1)`` shards of k and v forward and k, v, dk, dv backward:
      ``6 (P - 1) K`` (exact and block-sparse); dilated attention sends only for
      branches spanning ``g`` devices, ``6 (g - 1) K_b`` with ``K_b`` the ``n / r``
      tokens of the kv heads the branch gathers. Holds its shards plus two blocks in
      flight (dilated: also ``3 Q`` per branch, each branch's output, cotangent and
      dq before the merge); transfers overlap compute.
    * allgather: the same bytes (all-gather forward, all-gather again and a
      reduce-scatter of dk/dv backward) but holds all keys and values, and their
      gradients in the backward, ``4 P K`` (dilated: ``4 g K_b`` of the largest
      spanning branch, plus ``3 Q`` per branch as the ring); no overlap.
    * heads: two all-to-alls forward (q, k, v in; out back) and two backward, each
      moving ``(P - 1) / P`` of the arrays: ``2 (P - 1) / P (2 Q + 2 K')`` with ``Q``
      one shard of queries and ``K'`` of kv heads after the GQA repeat; holds a head
      slice of the whole sequence (as much as the shards); no overlap; the work is
      always balanced (``1 / P``) but needs ``H % P == 0``.
    * a dilated branch spanning ``g`` devices as ``"heads"`` (per branch): the same
      all-to-alls inside its group on its dilated ``n / r`` tokens,
      ``2 (g - 1) / g (2 Q_b + 2 K_b')``, holding ``2 (2 Q_b + 2 K_b')``; needs its
      query heads divisible by ``g``.
    * with the XLA kernel, a dilated branch spanning devices also holds its logits
      blocks, which differ by strategy (:func:`_logits_blocks_held`): ``H_b`` heads
      over ``n / r`` tokens on the ring (``n / r`` queries against ``g n / r`` keys
      for the all-gather), ``H_b / g`` heads over ``g n / r`` for the head exchange.

    Packed dilated attention (``segment_ids=True``) runs whole sequences of some heads
    under every strategy (:func:`dilated_over_heads`): ``"ring"`` is then the heads
    figures when ``H % P == 0``, and otherwise, like ``"allgather"``, the gathered
    program: q, k, v gathered forward and reduce-scattered backward,
    ``2 (P - 1) (Q + 2 K)``, plus the output's all-to-alls; it holds the whole q, k, v
    and their gradients and does ``ceil(H / P) / H`` of the work.

    ``platform`` (default: this machine's device kind) prices the per-branch choice
    as :func:`choose` prices the strategies.
    """
    op = op if isinstance(op, Operation) else describe(op)
    e = jnp.dtype(dtype).itemsize
    p, b, t, h, hkv, d = num_devices, batch, seq_len, num_heads, num_kv_heads, head_dim
    n = t // p
    kshard = b * n * hkv * d * e
    qshard = b * n * h * d * e
    causal = bool(op.options.get("is_causal", False))
    why = servable(op, num_heads=h, num_devices=p, layout=layout, seq_len=t,
                   segment_ids=segment_ids)
    base_held = 2 * qshard + 2 * kshard  # q, out, k, v shards
    grads_held = 2 * qshard + 2 * kshard  # dq, do, dk, dv
    out = {}

    packed = segment_ids and op.kind == "dilated"
    if packed:
        c = -(-h // p)
        out_shard = qshard * p * c / h  # one device's rows of the P c heads computed
        gathered = StrategyCost(
            "allgather", 2 * (p - 1) * (qshard + 2 * kshard)
            + 2 * (p - 1) / p * out_shard,
            base_held + grads_held + 2 * p * (qshard + 2 * kshard) + 2 * p * out_shard,
            False, c / h, why["allgather"])
        out["allgather"] = gathered
        out["ring"] = dataclasses.replace(gathered, strategy="ring", reason=why["ring"])
    elif op.kind == "dilated" and why["ring"] is None:
        out.update(_dilated_costs(op, why, b, t, h, hkv, d, p, e,
                                  base_held + grads_held, qshard,
                                  _pricing(op, platform, b, t, h, d)))
    else:
        share = _causal_share(p, layout, causal)
        if op.kind == "block_sparse":
            share = 1.0 / p if layout != "contiguous" or not causal else share
        out["ring"] = StrategyCost("ring", 6 * (p - 1) * kshard,
                                   base_held + grads_held + 4 * kshard, True, share,
                                   why["ring"], small_work=share)
        out["allgather"] = StrategyCost("allgather", 6 * (p - 1) * kshard,
                                        base_held + grads_held + 4 * p * kshard, False,
                                        share, why["allgather"], small_work=share)
    rep = head_parallel.kv_repeat(hkv, p)
    kprime = kshard * rep
    sent_heads = 2 * (p - 1) / p * (2 * qshard + 2 * kprime)
    # the shards and, as large, their head-sharded copies (q, out, k', v' and grads)
    held_heads = base_held + grads_held + 2 * (2 * qshard + 2 * kprime)
    if "heads" not in out:  # (dilated attention's "heads" by branch is priced above)
        out["heads"] = StrategyCost("heads", sent_heads, held_heads, False, 1.0 / p,
                                    why["heads"])
    if packed and h % p == 0:  # the packed ring path is the heads all-to-all
        out["ring"] = dataclasses.replace(out["heads"], strategy="ring",
                                          reason=why["ring"])
    return out


def _dilated_costs(op, why, b, t, h, hkv, d, p, e, shards_held, qshard,
                   pricing: _Pricing) -> dict:
    """``ring``, ``allgather`` and, where it differs from both, ``per_branch`` costs of
    unpacked distributed dilated attention (:func:`estimate`)."""
    n = t // p
    try:
        branches, plans = _plans_of(op, seq_len=t, num_heads=h, num_kv_heads=hkv)
        sbs = distributed.shard_branches(branches, local_len=n, num_devices=p)
    except (ValueError, TypeError) as err:
        return {s: StrategyCost(s, 0.0, 0.0, s == "ring", 1.0 / p, str(err))
                for s in ("ring", "allgather")}
    flops = _branch_flops(op, b, t, h, d)
    total = max(sum(flops), 1.0)
    streamed = _streams_branches(op, pricing.kind, e, d)
    longnet = op.options.get("mode", "longnet") == "longnet"
    # per branch: {entry: (sent, held while it runs, overlapped, small work share,
    # held until the merge)}, and its work share
    options, shares = [], [f / total / p for f in flops]
    for plan, sb, share in zip(plans, sbs, shares):
        kept = _branch_result_held(plan, sb, h, qshard, streamed, longnet)
        if sb.is_local:
            options.append({"ring": (0.0, 0.0, 0.0, share, kept)})
            continue
        g, hb, lb = sb.ring_size, len(plan.query_heads), n // sb.rate
        kb = b * lb * len(plan.kv_heads) * d * e
        sent = 6 * (g - 1) * kb
        # the XLA kernel's logits blocks differ by strategy (_logits_blocks_held)
        blocks = functools.partial(_logits_blocks_held, b, e) if streamed else (
            lambda *_: 0.0)
        mine = {"ring": (sent, 4 * kb + blocks(hb, lb, lb), sent, share, kept),
                "allgather": (sent, 4 * g * kb + blocks(hb, lb, g * lb), 0.0, share,
                              kept)}
        if plan.branch.window is not None:
            del mine["allgather"]  # a window branch runs its windowed ring only
        elif hb % g == 0:
            qb = b * lb * hb * d * e
            kprime = kb * head_parallel.kv_repeat(len(plan.kv_heads), g)
            if streamed:
                # inside the streamed program (ops/distributed.py): the backward
                # exchanges q, k', v' again rather than holding them, and nothing of
                # the branch is held until the merge
                moved, kept = 5 * qb + 6 * kprime, 0.0
            else:
                moved = 2 * (2 * qb + 2 * kprime)
            # priced on CPU as the ring's calls (measured, 12 heads on 8 devices: the
            # mix with "heads" for the branch of 2 devices ran 1.28-1.31x the time of
            # all rings at 4096 tokens, 0.95-0.96x at 8192; docs/benchmarks.md)
            mine["heads"] = ((g - 1) / g * moved, 2 * (2 * qb + 2 * kprime)
                             + blocks(hb // g, g * lb, g * lb), 0.0, share, kept)
        options.append(mine)
    streamed_held = 3 * qshard if streamed else 0.0

    def total_cost(name, entries):
        parts = [opts[e] for opts, e in zip(options, entries)]
        sent = sum(x[0] for x in parts)
        # a branch's ring hides its transfers behind its own compute only
        overlapped = sum(min(x[2], share * pricing.flops / pricing.balance)
                         for x, share in zip(parts, shares))
        return StrategyCost(
            name, sent, shards_held + max((x[1] for x in parts), default=0.0)
            + streamed_held + sum(x[4] for x in parts), overlapped == sent, 1.0 / p,
            why[name] if isinstance(name, str) else None,
            small_work=sum(x[3] for x in parts), overlapped_bytes=overlapped)

    uniform = {}
    for name in ("ring", "allgather"):
        uniform[name] = total_cost(name, [name if name in opts else "ring"
                                          for opts in options])
    by_branch = distributed.heads_by_branch(branches, plans, local_len=n,
                                            num_devices=p) is not None
    if by_branch:  # "heads" runs branch by branch (distributed.heads_by_branch)
        uniform["heads"] = dataclasses.replace(
            total_cost("heads", ["heads" if "heads" in opts else "ring"
                                 for opts in options]),
            note="branch by branch: the spanning branches exchange heads among their "
                 "segments' devices, the local ones move nothing")
    order = ("ring", "heads", "allgather")
    best = []
    for opts, share in zip(options, shares):  # each alone: least time, then memory
        times = {s: pricing.time(share, x[3], x[0], x[2]) for s, x in opts.items()}
        low = min(times.values())
        near = [s for s in order if s in times and times[s] <= 1.1 * low]
        best.append(min(near, key=lambda s: (opts[s][1] + opts[s][4], order.index(s))))
    mix = tuple(best)
    spanning = {x for x, o in zip(mix, options) if len(o) > 1}
    if spanning == {"heads"} and by_branch or (
            "heads" not in mix and len(spanning) <= 1):
        return uniform  # the same as one of the uniform strategies
    uniform["per_branch"] = total_cost(mix, mix)
    return uniform


def _logits_blocks_held(batch: int, itemsize: int, heads: int, len_q: int,
                        len_k: int) -> float:
    """Bytes of the XLA kernel's logits blocks in one call of ``heads`` heads over
    ``len_q`` queries and ``len_k`` keys: four ``[B, heads, block_q, block_k]`` arrays
    in float32 or wider (the forward's logits and probabilities, the backward's and
    their cotangent), blocks of at most 512 (``backends/xla/layout.py``).

    The only kernel temporaries the cost model counts, because a spanning dilated
    branch's differ by strategy: its ring and all-gather run its ``H_b`` heads over a
    shard's ``n / r`` queries (blocks as small as ``n / r``), its head exchange ``H_b /
    g`` heads over ``g n / r`` (full blocks). Compiled (docs/benchmarks.md), P = 8,
    8 heads: the ring held 8.8 MiB less than ``"heads"`` at 4096 tokens and 7.8 MiB
    more at 8192; this term gives it 8 MiB less and 16 MiB more, the other terms 0.25
    and 0.5 MiB more (docs/semantics.md, section 8). With the native CPU kernel's
    forward only the backward's blocks remain, and the compiled differences shrink
    with the same signs (2.5 MiB less, 11.0 MiB more at b372848); the term is kept
    as an order, not a size."""
    bq, bk = min(len_q, DEFAULT_BLOCK_Q), min(len_k, DEFAULT_BLOCK_K)
    return 4.0 * batch * heads * bq * bk * max(itemsize, 4)


def _streams_branches(op, kind: str, itemsize: int, head_dim: int) -> bool:
    """Whether the one-device program streams the local branches into one partial:
    with the XLA kernel (``ops/dilated_local.py``), not with cuDNN. With
    ``implementation=None`` that is every call on CPU and TPU, and on a GPU the calls
    cuDNN cannot take: float32 and wider (``itemsize`` >= 4), or a head_dim it has no
    kernel for (priced as on Hopper, the widest: :func:`selection.cudnn_call_reason`)."""
    impl = op.options.get("implementation")
    if impl is not None:
        return impl in ("xla", "native")  # native: the XLA kernel's backward
    if kind != "gpu":
        return True
    dtype = {2: "bfloat16", 4: "float32", 8: "float64"}.get(itemsize, "float32")
    spec = selection.CallSpec(dtype, head_dim, is_causal=True)
    return selection.cudnn_call_reason(_PRICED_GPU, spec) is not None


# The GPU whose kernel limits the cost model assumes when it prices a GPU.
_PRICED_GPU = selection.DeviceInfo("gpu", "NVIDIA GPU (priced as Hopper)", (9, 0), "cuda")


def _branch_result_held(plan, sb, h: int, qshard: float, streamed: bool,
                        longnet: bool) -> float:
    """Bytes of one branch's result held until the merge, per device: its output and,
    in the backward, its cotangent and dq. With the XLA kernel (``streamed``,
    :func:`_streams_branches`) the local branches stream into one partial (``3 Q``
    for all of them, counted once by the caller) and, in longnet mode, a spanning
    branch merges into it at its ``n / r`` selected rows (ops/distributed.py);
    otherwise (cuDNN) every branch holds its own, for its heads. (The heads
    strategy's one-device program streams them all: it has no such term.)"""
    if streamed and sb.is_local and plan.branch.window is None:
        return 0.0
    share = len(plan.query_heads) / h
    if streamed and longnet and plan.branch.window is None:
        share = 1.0 / sb.rate  # its dilated rows only
    return 3 * qshard * share


# Relative price of one exposed byte against the work of the whole attention: the
# attention of one query row over T keys costs about 4 T H D flops (x 2.5 with the
# backward) while a byte moves at ``bandwidth``; with flops/bandwidth the device's
# balance point. Rough figures, per device kind (documented in docs/semantics.md).
_BALANCE = {"cpu": 2.0, "gpu": 100.0, "tpu": 200.0}  # flop per byte moved

# On CPU the devices of one process share the same cores: a transfer is a copy made
# by the cores that compute, so nothing overlaps; and the sequence-sharded strategies
# compute a shard's T / P queries in many small kernel calls (a ring's P steps, the
# all-gather's blocks of a causal layout), slower than the heads strategy's one call
# over the whole sequence. Measured on the project's 2-core CPU (docs/benchmarks.md,
# "Context-parallel strategies: time", P=8, n 4096 and 8192, 8 and 1 kv heads, exact
# and block-sparse attention): ring 1.10-1.77x and allgather 1.14-2.58x the time of
# heads (medians 1.45x and 1.5x). The model prices their work by this factor there.
_CPU_SEQ_SHARDED_WORK = 1.45


def _device_kind() -> str:
    try:
        platform = jax.devices()[0].platform
    except RuntimeError:  # pragma: no cover
        return "cpu"
    return {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)


def choose(op, *, batch: int, seq_len: int, num_heads: int, num_kv_heads: int,
           head_dim: int, num_devices: int, dtype="float32", layout: str = "contiguous",
           platform: str | None = None, segment_ids: bool = False):
    """``(strategy, costs, why)``: the strategy ``"auto"`` picks for this call.

    Among the strategies that can serve, the one with the least estimated time,
    ``time ~ work x F + exposed bytes / bandwidth`` per device, where ``F`` is the
    flops of the whole attention (forward and backward, ``10 B T^2 H D`` dense;
    dilated: the branches' segments; block-sparse as dense, a bound) and
    ``flops / bandwidth`` the device kind's balance (``_BALANCE``: flops one byte
    moved costs). On CPU no transfer overlaps and the work done in calls over a
    shard's tokens costs ``_CPU_SEQ_SHARDED_WORK`` times as much (measured; see the
    constant). Ties (within 10%) go to the one holding less memory, then to the
    order ring, heads, per-branch mix, allgather. For dilated attention the
    per-branch mix of :func:`estimate` competes too; ``strategy`` is then its tuple.
    ``segment_ids``: the call has packed rows (only strategies that can serve them
    are considered; :func:`estimate`).
    """
    op = op if isinstance(op, Operation) else describe(op)
    costs = estimate(op, batch=batch, seq_len=seq_len, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim,
                     num_devices=num_devices, dtype=dtype, layout=layout,
                     segment_ids=segment_ids, platform=platform)
    pricing = _pricing(op, platform, batch, seq_len, num_heads, head_dim)
    times = {s: pricing.of(c) for s, c in costs.items() if c.reason is None}
    if not times:
        raise ValueError("no strategy can serve this call: " + "; ".join(
            f"{s}: {c.reason}" for s, c in costs.items()))
    best = min(times.values())
    order = ("ring", "heads", "per_branch", "allgather")
    near = [s for s in order if s in times and times[s] <= 1.1 * best]
    key = min(near, key=lambda s: (costs[s].held_bytes, order.index(s)))
    c = costs[key]
    exposed = pricing.exposed_of(c)
    why = (f"least estimated time (work {c.work:.3f} of {pricing.flops:.3g} flops, "
           f"{c.sent_bytes / 2**20:.2f} MiB sent, {exposed / 2**20:.2f} MiB of it "
           f"exposed at {pricing.balance:g} flop/byte)")
    if len(near) > 1:
        why += f"; within 10% of {[s for s in near if s != key]}, and holds least memory"
    return c.strategy, costs, why


def _branch_flops(op: Operation, b, t, h, d) -> list[float]:
    """Forward + backward flops of the call (``10 B Lq Lk H D`` per dense block): one
    entry per branch for dilated attention, else one entry."""
    causal = 0.5 if op.options.get("is_causal", False) else 1.0
    dense = [10.0 * b * t * t * h * d * causal]
    if op.kind != "dilated":
        return dense
    try:
        pairs = branch_plans.validate_branches(op.options["segment_lengths"],
                                               op.options["dilation_rates"])
    except (ValueError, TypeError, KeyError):
        return dense
    flops = []
    for w, r in pairs:
        if is_window(w):  # every query, its window of keys
            flops.append(10.0 * b * t * min(w.left + (w.right or 0) + 1, t) * h * d)
            continue
        seg = min(w, t)
        flops.append(10.0 * b * (t / r) * (seg / r) * h * d * causal)
    return flops


def explain_strategy(fn, query_shape, key_shape=None, *, num_devices: int,
                     dtype="float32", layout: str = "contiguous", platform=None,
                     file=None, quiet: bool = False, segment_ids: bool = False):
    """Which strategy ``strategy="auto"`` picks for ``fn`` on these shapes, and why.

    Args:
      fn: the operation as given to ``jd.sharded`` (e.g.
        ``functools.partial(jd.dilated_attention, segment_lengths=..., ...)``).
      query_shape, key_shape: global ``[batch, seq, heads, head_dim]`` shapes
        (``key_shape`` defaults to ``query_shape``).
      num_devices: devices of the sequence axis.
      dtype, layout: of the call; platform: ``"cpu"``, ``"gpu"`` or ``"tpu"`` (default:
        this machine's).
      file, quiet: where to print (default stdout); ``quiet`` only returns.
      segment_ids: whether the call has packed rows (``segment_ids=``).

    Returns:
      ``(strategy, {strategy: StrategyCost}, why)``.

    Example:
      >>> import functools, jax_dilated as jd
      >>> pick, costs, why = jd.explain_strategy(
      ...     functools.partial(jd.ring_attention, is_causal=True), (1, 4096, 8, 64),
      ...     (1, 4096, 2, 64), num_devices=4, layout="zigzag", quiet=True)
      >>> pick in ("ring", "heads", "allgather"), costs["heads"].reason is None
      (True, True)
    """
    key_shape = tuple(query_shape) if key_shape is None else tuple(key_shape)
    b, t, h, d = query_shape
    hkv = key_shape[2]
    pick, costs, why = choose(fn, batch=b, seq_len=t, num_heads=h, num_kv_heads=hkv,
                              head_dim=d, num_devices=num_devices, dtype=dtype,
                              layout=layout, platform=platform,
                              segment_ids=segment_ids)
    if not quiet:
        out = sys.stdout if file is None else file
        op = describe(fn)
        print(f"strategy for {op.name} on query {tuple(query_shape)}, key {key_shape}, "
              f"{jnp.dtype(dtype).name}, {num_devices} devices, layout={layout!r}: "
              f"{pick} - {why}", file=out)
        for s, c in costs.items():
            state = "can serve" if c.reason is None else f"cannot serve: {c.reason}"
            if c.note:
                state += f" ({c.note})"
            s = s if isinstance(c.strategy, str) else f"per-branch {c.strategy}"
            print(f"  {s:<9} sent {c.sent_bytes / 2**20:9.2f} MiB/device, held "
                  f"{c.held_bytes / 2**20:9.2f} MiB/device, "
                  f"{'overlapped' if c.overlap else 'not overlapped'}, work share "
                  f"{c.work:.3f}; {state}", file=out)
    return pick, costs, why
