"""Dilated attention on one device (LongNet; docs/semantics.md, section 2).

For each branch ``(w, r)`` the sequence is cut into segments of ``w`` tokens,
each head's selected positions (offset ``o``: ``(p mod w) mod r == o``) are
gathered into dense *dilated segments* of ``w / r`` tokens, a kernel runs dense
attention inside every dilated segment, and the result goes back to the positions it
came from. With the blockwise XLA kernel this streams, a few segments at a time, into
the output in place (:mod:`jax_dilated.ops.dilated_local`); with cuDNN all segments and
heads of a branch go in one call and the branches are merged afterwards; across devices
:mod:`jax_dilated.ops.distributed` runs the branches.

``mode="longnet"`` merges the branches of every head by their softmax
denominators (Eq. 10) with :func:`jax_dilated.core.softmax.merge_partials`;
``mode="head_groups"`` runs branch ``i`` on head group ``i`` only and divides the
whole output by the number of branches.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from jax_dilated.core import softmax, validation
from jax_dilated.core.documents import document_ids
from jax_dilated.core.types import (Array, ArrayLike, BranchStrategy, DilatedStrategy,
                                    HeadOffsets, Implementation, Mode, SegmentLengths)
from jax_dilated.ops import (dilated_hybrid, dilated_packed, dilated_torchscale, distributed,
                             head_parallel)
from jax_dilated.ops.dilated_programs import DilatedCall, check_torchscale_options, one_device

__all__ = ["dilated_attention", "STRATEGIES"]

# strategy= of dilated_attention over a mesh (besides a per-branch tuple)
STRATEGIES = (*distributed.BRANCH_STRATEGIES, "hybrid")


def dilated_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike, *,
                      segment_lengths: SegmentLengths, dilation_rates: Sequence[int],
                      mode: Mode = "longnet", head_offsets: HeadOffsets = "modulo",
                      is_causal: bool = False, scale: float | None = None,
                      kv_mask: ArrayLike | None = None, dropout_rate: float = 0.0,
                      dropout_rng: Array | None = None,
                      seq_axis: str | tuple[str, str] | None = None,
                      implementation: Implementation | None = None,
                      block_q: int | None = None, block_k: int | None = None,
                      return_lse: bool = False, segment_ids: ArrayLike | None = None,
                      max_documents: int | None = None, axis_name: str | None = None,
                      logit_soft_cap: float | None = None, sinks: ArrayLike | None = None,
                      strategy: DilatedStrategy | Sequence[BranchStrategy] = "ring",
                      valid_length: int | None = None,
                      ) -> Array | tuple[Array, Array]:
    """LongNet dilated attention, on one device or with the sequence sharded over a mesh axis.

    Args:
      query: [batch, seq, num_heads, head_dim].
      key, value: [batch, seq, num_kv_heads, head_dim]; ``num_heads % num_kv_heads == 0``
        (query head ``j`` reads kv head ``j // (num_heads // num_kv_heads)``).
      segment_lengths: segment length ``w_i`` of every branch (static ints).
      dilation_rates: dilation rate ``r_i`` of every branch (any positive int: a whole
        segment selects ``ceil((w_i - o) / r_i)`` positions at offset ``o``).
      mode: ``"longnet"`` (every head runs every branch; branches mixed by their
        softmax denominators), ``"head_groups"`` (branch ``i`` on head group
        ``i``, output divided by the number of branches) or ``"torchscale"``
        (what torchscale's LongNet computes, for its checkpoints such as
        Prov-GigaPath's: zero-padded segments inside every softmax, shifted outputs
        where a rate does not divide its segment, branch weights without gradient;
        docs/semantics.md, section 2). torchscale has no padding mask, windows,
        soft-cap, sinks or packed rows, and returns no lse: those options are refused;
        over a mesh it exchanges heads (``strategy="heads"``, or ``"allgather"``).
      head_offsets: longnet offset rule, ``"modulo"`` (``j mod r``) or ``"blocked"``
        (``floor(j / ceil(H / r))``); torchscale always uses its own, ``"blocked"``.
      is_causal: key ``t`` is visible to query ``p`` only if ``t <= p``.
      scale: logit scale; default ``1 / sqrt(head_dim)``.
      kv_mask: bool [batch, seq], True where a key may be attended to.
      dropout_rate: attention-probability dropout rate (the denominators see no
        dropout); needs ``dropout_rng``. Deterministic for a given key.
      dropout_rng: a ``jax.random`` key.
      seq_axis: None on one device. Inside ``jax.shard_map``: the mesh axis the
        sequence is sharded over, contiguously (device ``d`` of ``P`` holds tokens
        ``[d n, (d+1) n)``; query/key/value/kv_mask are the local shards). The result
        equals single-device attention on the global sequence. Segments that fit in
        a shard run locally with no communication; a segment spanning ``g`` devices
        (``w = g n``, ``g | P``, or ``w >= T``; needs ``n % r == 0``) dilates locally
        and runs a ring over its ``g`` devices (:mod:`jax_dilated.ops.distributed`).
      strategy: with ``seq_axis``, how the sequence axis is parallelised
        (docs/semantics.md, section 8): ``"ring"`` (above), ``"allgather"`` (each
        spanning branch gathers its segment's dilated keys and values over its ``g``
        devices), ``"heads"`` (an all-to-all to the whole sequence of ``H / P`` heads
        and the one-device program on it; needs ``H % P == 0``), or one entry per
        branch of ``"ring"``, ``"allgather"``, ``"heads"`` (the last: an all-to-all
        among the ``g`` devices of the branch's segment, to ``1 / g`` of its heads;
        needs its query heads divisible by ``g``); a branch local to a shard moves
        nothing whatever its entry. ``"hybrid"`` with ``seq_axis=(a, b)`` (the
        sequence sharded over both, ``b`` major: ``PartitionSpec(..., (b, a))``): an
        all-to-all over ``a`` to whole ring chunks of ``H / P_a`` heads, this
        program over ``b`` on them (spanning segments ring over the devices of ``b``
        they span), and back (docs/semantics.md, section 8, "Hybrid"); with any other
        strategy two (or more) axes are one sequence axis, the first major (give them
        in the mesh's order: JAX numbers their devices so). Packed rows run whole
        sequences of some heads under every strategy (all-gathered under
        ``"allgather"``). Only ``"ring"`` without ``seq_axis``.
      implementation: kernel; None chooses by device kind (on CPU the native kernel's
        forward for float32 calls where it builds, else ``"xla"``; README, "Backends").
      block_q, block_k: kernel block sizes (None: the kernel's defaults).
      return_lse: also return the log-sum-exp ``[batch, seq, num_heads]`` (float32;
        float64 for float64 inputs; ``-inf`` where a position has no key). longnet:
        the merged ``LSE = log sum_i exp(LSE_i)`` over all branches, the log of the
        denominator of the equivalent dense softmax (so ``(out, lse)`` is a partial
        that :func:`jax_dilated.core.softmax.merge_partials` can merge).
        head_groups: head ``j``'s ``LSE_i`` of the one branch ``i`` its group runs;
        the output there is that branch's softmax output divided by the number of
        branches, so ``(out, lse)`` is *not* a mergeable partial.
      axis_name: deprecated spelling of ``seq_axis`` (DeprecationWarning).
      valid_length: ``mode="torchscale"`` only (a static int): the sequence is its
        first ``valid_length`` tokens (of the global sequence, with ``seq_axis``), the
        rest padding that outputs zeros, so that a sequence padded to divide the
        devices computes what the unpadded one computes (torchscale's segments
        depend on the length).

    Returns:
      [batch, seq, num_heads, head_dim] in the dtype of ``query`` (with
      ``return_lse``: ``(out, lse)``). Positions with no key to attend to in any
      branch are zero.

      segment_ids: int [batch, seq] document ids of packed rows (a document is a
        maximal run of equal ids): the segment grid and the offsets restart at each
        document, so every document gets exactly what it would alone
        (docs/semantics.md, section 2, "Packed sequences"). With ``seq_axis`` (this
        shard's ids) every device runs the packed program on the whole sequence of
        some heads: an all-to-all to ``H / P`` heads when ``P`` divides the heads
        (moving about a shard of q, k, v and the output per device), else q, k, v
        and the ids are all-gathered (``O(T H D)`` held per device) and each device
        computes ``ceil(H / P)`` heads (:func:`jax_dilated.ops.head_parallel.over_heads`).
        No segment-length restriction of the unpacked sharded path applies.
      max_documents: a static bound on the documents per row with ``segment_ids``.
        Give it where you can: packed rows then cost about what their documents cost
        as a batch when every segment length divides the largest ``A`` and
        ``max_documents * A <= seq`` (else about 1.5-2x; without a bound 5-7x;
        docs/semantics.md, "Packed sequences"). A row with more documents is a
        ``ValueError`` (traced ids: NaN output).
      logit_soft_cap: ``c > 0`` or None: every branch's scaled logits ``s`` become
        ``c tanh(s / c)`` before masking and the softmax.
      sinks: float [num_heads] or None (traced, differentiable): head ``h``'s logit
        ``s_h`` joins its softmax denominator once: longnet, the merged denominator of
        all branches; head_groups, the denominator of the one branch the head runs
        (the output still divided by the number of branches). With ``return_lse``
        the log-sum-exp includes the sink. A row with no key outputs zeros.

    A ``segment_lengths`` entry may be a :class:`jax_dilated.SlidingWindow`
    ``(left, right)`` (dilation rate 1): that branch's heads attend, on the whole
    sequence, to keys ``p - left <= t <= p + right`` (docs/semantics.md, section 2,
    "Sliding-window branches, soft-capping and sinks"); it runs as one windowed
    kernel call (O(window) per query), as a windowed ring with ``seq_axis``, and is
    mixed with the other branches like any branch.

    The math: for branch ``i`` a selected query attends to the selected keys of
    its segment; ``O_i`` and ``LSE_i`` are that softmax's output and log-sum-exp.
    longnet: ``O = sum_i exp(LSE_i) O_i / sum_i exp(LSE_i)``, which equals dense
    attention with logits ``scale q.k + log m(p, t)``, ``m`` the number of
    branches linking ``p`` and ``t``.

    Example:
      >>> import jax, jax.numpy as jnp, jax_dilated as jd
      >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 64, 4, 8))
      >>> attn = jax.jit(lambda q, k, v: jd.dilated_attention(
      ...     q, k, v, segment_lengths=(16, 32), dilation_rates=(1, 2), is_causal=True))
      >>> attn(q, k, v).shape
      (1, 64, 4, 8)
    """
    seq_axis = validation.renamed(axis_name, seq_axis, old="axis_name", new="seq_axis",
                                  where="dilated_attention")
    b, t, h, hkv, tk = validation.check_qkv(query, key, value)
    if tk != t:
        raise ValueError(
            f"dilated attention is self-attention over one sequence: key/value length "
            f"must equal query length, got query {tuple(query.shape)} and key "
            f"{tuple(key.shape)}."
        )
    dropout_rate = validation.check_dropout(dropout_rate, dropout_rng)
    call = DilatedCall.of(segment_lengths, dilation_rates, mode=mode,
                          head_offsets=head_offsets, head_dim=query.shape[-1],
                          is_causal=is_causal, scale=scale, dropout_rate=dropout_rate,
                          block_q=block_q, block_k=block_k, logit_soft_cap=logit_soft_cap,
                          implementation=implementation, max_documents=max_documents)
    kv_mask = validation.check_kv_mask(kv_mask, b, t)
    return_lse = validation.check_flag("return_lse", return_lse)
    sinks = validation.check_sinks(sinks, h)
    hybrid = strategy == "hybrid"
    if hybrid:
        seq_axis = validation.check_axis_pair(seq_axis)
    else:
        strategy = distributed.check_branch_strategy(strategy, len(call.branches))
        if isinstance(seq_axis, list):  # several mesh axes as one, the first major
            seq_axis = tuple(seq_axis)
    if seq_axis is None and strategy != "ring":
        raise ValueError(f"strategy={strategy!r} says how to parallelise the sequence axis: "
                         f"it needs seq_axis= (inside shard_map, or through jd.sharded); "
                         f"on one device leave the default 'ring'.")
    # with two axes (a, b) the pieces are in b-major order: the flat axis is (b, a)
    flat_axis = seq_axis[::-1] if hybrid else seq_axis
    num_devices = 1 if seq_axis is None else validation.axis_size(
        flat_axis, "dilated_attention(seq_axis=...)")
    rng = dropout_rng if dropout_rate > 0.0 else None
    if call.mode == "torchscale":
        return _torchscale(call, query, key, value, rng, seq_axis=flat_axis,
                           num_devices=num_devices, strategy=strategy,
                           valid_length=valid_length,
                           unsupported={"kv_mask": kv_mask, "segment_ids": segment_ids,
                                        "sinks": sinks, "return_lse": return_lse})
    if valid_length is not None:
        raise ValueError(f'valid_length applies to mode="torchscale" only (its segments '
                         f'depend on the sequence length), got valid_length={valid_length!r} '
                         f'with mode={call.mode!r}; use kv_mask to mark padding.')
    plans = call.plans(seq_len=t * num_devices, num_heads=h, num_kv_heads=hkv)
    segment_ids = document_ids(validation.check_segment_ids(segment_ids, query.shape, key.shape),
                               axis_name=flat_axis, num_devices=num_devices)
    # sinks join once, on the combined denominator (docs/semantics.md, s. 2): inside
    # the one-device program (which folds them into its backward), after the others
    if seq_axis is None and segment_ids is None:
        o, lse = one_device(call.kernel, call.args, plans, mode, query, key, value, kv_mask,
                            rng, sinks, lse_grad=return_lse)
        return (o, lse) if return_lse else o
    # the lse is differentiated where it is returned, or merged with the sinks below
    lse_grad = return_lse or sinks is not None
    if seq_axis is None:
        o, lse = dilated_packed.packed_attention(call.kernel, call.args, plans, mode, query,
                                                 key, value, kv_mask, rng,
                                                 segment_ids=segment_ids,
                                                 max_documents=max_documents)
    else:
        program, operands, back = _mesh_program(call, plans, query, key, value, kv_mask,
                                                rng, segment_ids, seq_axis, flat_axis,
                                                num_devices, strategy, lse_grad)
        o, lse = back(*program(*operands))
    o, lse = softmax.sinks_on_output(o, lse, sinks)
    return (o, lse) if return_lse else o


def _torchscale(call: DilatedCall, query, key, value, rng, *, seq_axis, num_devices: int,
                strategy, valid_length, unsupported: dict):
    """``mode="torchscale"`` (:mod:`jax_dilated.ops.dilated_torchscale`): on one
    device, or over ``seq_axis`` as the whole sequence of some heads per device."""
    check_torchscale_options(**unsupported)
    total = query.shape[1] * num_devices
    if valid_length is not None:
        valid_length = validation.check_valid_length(valid_length, total)
    if seq_axis is None:
        return dilated_torchscale.attend(call, query, key, value, rng,
                                         valid_length=valid_length)[0]
    if strategy not in ("heads", "allgather"):
        raise ValueError(f"{dilated_torchscale.MESH_REASON}, got strategy={strategy!r}.")
    why = head_parallel.heads_unservable(query.shape[2], num_devices)
    if strategy == "heads" and why:
        raise ValueError(f"{why} ({seq_axis!r}); use strategy='allgather'.")
    program, operands, back = head_parallel.over_heads(
        call, query, key, value, None, rng, axis_name=seq_axis, num_devices=num_devices,
        gather=strategy == "allgather",
        program=functools.partial(dilated_torchscale.device_program, call,
                                  num_heads=query.shape[2], valid_length=valid_length))
    return back(*program(*operands))[0]


def _mesh_program(call: DilatedCall, plans, query, key, value, kv_mask, rng, segment_ids,
                  seq_axis, flat_axis, num_devices: int, strategy, lse_grad: bool):
    """How a call runs with the sequence sharded over ``seq_axis`` (inside shard_map):
    ``(program, operands, back)``, the result ``back(*program(*operands)) = (out,
    lse)``. The whole sequence of some heads per device (``"heads"`` as one
    all-to-all, and packed rows under every strategy: the exchange is made here, the
    way back is ``back``), the hybrid exchange over two axes, else the branches on the
    shards (:func:`jax_dilated.ops.distributed.sharded_dilated`). Chosen here, entered
    by the caller, so that the program calls its kernels from one frame below it."""
    local_len, num_heads = query.shape[1], query.shape[2]
    operands = (query, key, value, kv_mask, rng)
    if strategy == "hybrid" and segment_ids is None:
        return (functools.partial(dilated_hybrid.hybrid, call, axes=seq_axis,
                                  lse_grad=lse_grad), operands, _unchanged)
    # "heads" runs branch by branch where it can (distributed.heads_by_branch), else
    # as the all-to-all of the whole call
    by_branch = (distributed.heads_by_branch(call.branches, plans, local_len=local_len,
                                             num_devices=num_devices)
                 if strategy == "heads" and segment_ids is None else None)
    whole_heads = strategy == "heads" and by_branch is None
    why = head_parallel.heads_unservable(num_heads, num_devices) if whole_heads else None
    if why:
        also = "" if segment_ids is not None else (
            ", and it cannot run branch by branch either (that needs every segment on "
            "the shards, no sliding-window branch, and each spanning branch's query "
            "heads divisible by the devices of its segment)")
        raise ValueError(f"{why} ({seq_axis!r}){also}; use 'ring' or 'allgather'.")
    if segment_ids is not None or whole_heads:
        # every device runs the one-device program on the whole sequence of some heads
        # (packed rows: documents start anywhere, so segments do not sit on the shards;
        # under hybrid over the two axes as one)
        return head_parallel.over_heads(
            call, *operands, segment_ids=segment_ids, axis_name=flat_axis,
            num_devices=num_devices, gather=strategy == "allgather", lse_grad=lse_grad)
    sharded_branches = by_branch or distributed.shard_branches(
        call.branches, local_len=local_len, num_devices=num_devices)
    return functools.partial(
        distributed.sharded_dilated, plans, sharded_branches, args=call.args,
        mode=call.mode, axis_name=seq_axis, num_devices=num_devices, kernel=call.kernel,
        strategies=distributed.branch_strategies(strategy, plans, sharded_branches),
        lse_grad=lse_grad), operands, _unchanged


def _unchanged(out, lse):
    return out, lse
