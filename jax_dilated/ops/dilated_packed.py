"""Dilated attention over packed rows (``segment_ids``): the segment grid restarts at
every document (docs/semantics.md, section 2, "Packed sequences").

A document is a maximal run of equal ids. Inside it, positions count from its first
token (``rel = p - start``), and the selection rule of the unpacked operation applies
to ``rel``: in branch ``(w, r)`` a head with offset ``o`` selects ``p`` when
``(rel mod w) mod r == o``, and a selected query attends to the selected keys of its
*group*, the segment ``floor(rel / w)`` of its document. That is running every document
alone, exactly.

Where segments no longer sit at fixed positions, the dense gather of the unpacked path
(``core/dilation.py``: a reshape and a strided slice) cannot cut them out. Instead every
head's selected positions are gathered, in order, into one *stream* per (row, head), in
which every group occupies a run of slots; attention inside every group is then one
kernel call, a selected query still attending to ``w / r`` keys. With a static bound on
the documents per row (``max_documents``) every group gets its own ``w / r`` slots and
the streams are the unpacked operation's batch of segments; without one, the groups
follow each other and the kernel tells them apart by segment id (:func:`packed_branch`).
The results go back to the positions they came from, and the branches merge as
unpacked.

A third layout serves the common case without streams: when every segment length
divides the largest ``A`` and a row holds ``D <= T / A`` documents (short segments
against the row, as in a LongNet), every document is moved to start at a multiple
of ``A`` in a row of ``T' = floor((T + D (A - 1)) / A) A <= 2T`` slots
(:func:`padded_layout`), where the unpacked segment grid restarts at each document by
itself. The unpacked one-device program (``dilated_local``: chunk streaming, in-place
accumulation) then runs on those slots, its chunks gathering their rows from the
packed arrays and scattering results into packed accumulators (nothing of size
``T'`` is made), with the empty slots as invalid keys (kernel blocks without a valid
key are skipped): the packed row costs about what its documents cost as a batch.

Shapes: query [B, T, H, D], key/value [B, T, Hkv, D], segment_ids [B, T] int32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_dilated.backends.base import KernelArgs, Masks
from jax_dilated.core import branch_plans, softmax
from jax_dilated.core.arrays import take_rows
from jax_dilated.core.documents import document_starts
from jax_dilated.core.vma import varying_like
from jax_dilated.ops import dilated_local, dilated_window

__all__ = ["group_count", "packed_branch", "packed_attention",
           "slots_capacity", "padded_layout"]


def group_count(seq_len: int, segment_length: int, max_documents: int) -> int:
    """Static bound on the groups (segments of documents) of one branch in a row of at
    most ``max_documents`` documents: ``sum_d ceil(L_d / w) <= (T + D (w - 1)) / w``."""
    return (seq_len + max_documents * (segment_length - 1)) // segment_length


def packed_branch(kernel, args: KernelArgs, plan: branch_plans.BranchPlan, query, key,
                  value, kv_mask, starts, dropout_rng, max_documents: int | None):
    """One branch over packed rows: ``(o [B, T, Hq, D], lse, lse_lo [B, T, Hq])`` for the
    heads ``plan.query_heads`` (zero / ``-inf`` / 0 where a head selects nothing), and
    ``overflow`` [B] bool: a row that needed more stream slots than the static layout
    holds (its result is then incomplete; the caller refuses it).

    Two layouts of the streams (module docstring):

    * ``max_documents`` given (*aligned*): group ``g`` of a row (its ``g``-th segment of
      a document, in order) owns slots ``[g w/r, (g+1) w/r)`` of every head's stream,
      whatever the head's offset, for :func:`group_count` groups. The streams are then
      a batch of ``[groups, w/r]`` independent sequences, exactly the unpacked
      operation's batch of dilated segments: one kernel call without document ids,
      with the empty slots (short last segments, unused groups) as invalid keys, costs
      what the documents cost alone (kernel chunks of empty groups are skipped).
    * otherwise (*compact*): each head's selected tokens in order, ``T`` slots, each
      token's group as its kernel segment id; correct for any number of documents, but
      groups straddle kernel blocks (up to about twice the work) and every stream is
      ``T`` long.

    Args:
      starts: :func:`document_starts` of the segment ids.
      max_documents: the static bound on documents per row, or None.
    """
    b, t, h, d = query.shape
    w, r = plan.branch.segment_length, plan.branch.rate
    heads = np.asarray(plan.query_heads)
    hs = len(heads)
    kv_of = heads // (h // key.shape[2])  # the kv head each query head reads
    pos = jnp.arange(t, dtype=jnp.int32)
    rel = pos[None, :] - starts                                         # [B, T]
    offsets = jnp.asarray(plan.offsets, jnp.int32)
    selected = ((rel % w) % r)[..., None] == offsets                    # [B, T, Hs]
    aligned = max_documents is not None
    if aligned:
        per_group = -(-w // r)  # slots of a group: ceil(w / r) (r need not divide w)
        groups = group_count(t, w, max_documents)
        length = groups * per_group
        ordinal = jnp.cumsum(rel % w == 0, axis=1, dtype=jnp.int32) - 1  # group of p
        slot = (ordinal * per_group + (rel % w) // r)[..., None]         # [B, T, 1]
        overflow = ordinal[:, -1] >= groups
    else:
        length = t  # the offset-0 head of a row of 1-token documents selects every token
        slot = jnp.cumsum(selected, axis=1, dtype=jnp.int32) - 1        # [B, T, Hs]
        overflow = jnp.any(slot[:, -1] >= length, axis=-1)
    # source position of every stream slot; T marks an empty slot
    rows = jnp.arange(b)[:, None, None]
    cols = jnp.arange(hs)[None, None, :]
    where = jnp.where(selected, slot, length)                           # dropped if past
    source = jnp.full((b, length, hs), t, jnp.int32).at[rows, where, cols].set(
        jnp.broadcast_to(pos[None, :, None], selected.shape), mode="drop")
    filled = source < t
    src = jnp.minimum(source, t - 1)

    # every gather below is arrays.take_rows (flat indices), not jnp.take_along_axis
    # (batching dimensions over the rows; see take_rows)
    def stream(x):  # [B, T, Hs, ...] -> [B, length, Hs, ...] along ``src``
        return take_rows(x, src)

    def along_src(x):  # [B, T] -> [B, length, Hs]
        return take_rows(x, src.reshape(b, -1)).reshape(src.shape)

    q = stream(query[:, :, heads])
    k = stream(key[:, :, kv_of])
    v = stream(value[:, :, kv_of])
    valid = filled if kv_mask is None else filled & along_src(kv_mask)
    if aligned:
        def split(x):  # [B, length, Hs, ...] -> [B groups, w/r, Hs, ...]
            return x.reshape(b * groups, per_group, *x.shape[2:])

        o, lse, lse_lo = kernel.attention(split(q), split(k), split(v), args,
                                          Masks(kv_valid=split(valid), dropout_rng=dropout_rng))
        o, lse, lse_lo = (x.reshape(b, length, *x.shape[2:]) for x in (o, lse, lse_lo))
    else:
        # a group is one segment of one document: the absolute position where it starts
        group = along_src(starts) + (along_src(rel) // w) * w
        # Empty slots get different ids on the query side (-1) and the key side (-2):
        # equal ids would make the empty tail of every stream one "group" whose blocks
        # the kernel could not skip.
        q_group = jnp.where(filled, group, -1)
        k_group = jnp.where(filled, group, -2)

        def flat(x):  # [B, length, Hs, ...] -> [B Hs, length, 1, ...]
            return jnp.moveaxis(x, 2, 1).reshape(b * hs, length, 1, *x.shape[3:])

        def unflat(x):  # the inverse
            return jnp.moveaxis(x.reshape(b, hs, length, *x.shape[3:]), 1, 2)

        ids = lambda x: flat(x)[:, :, 0]  # noqa: E731
        o, lse, lse_lo = kernel.attention(flat(q), flat(k), flat(v), args,
                                          Masks(kv_valid=ids(valid), q_segment_ids=ids(q_group),
                                                k_segment_ids=ids(k_group),
                                                dropout_rng=dropout_rng))
        o, lse, lse_lo = (unflat(x) for x in (o, lse, lse_lo))

    def back(y, fill):  # [B, length, Hs, ...] -> [B, T, Hs, ...]: each token's slot
        y = take_rows(y, jnp.minimum(slot, length - 1))
        keep = selected.reshape(*selected.shape, *(1,) * (y.ndim - 3))
        return jnp.where(keep, y, jnp.asarray(fill, y.dtype))

    return back(o, 0), back(lse, -jnp.inf), back(lse_lo, 0), overflow


def slots_capacity(plans, seq_len: int) -> tuple[int, int] | None:
    """``(A, D_max)``: the alignment ``A`` of the padded layout (module docstring) and
    the most documents per row it serves without more than doubling the row, ``seq_len
    // A``; None where it does not serve: no segment-grid branch, a segment length that
    does not divide the largest or that its rate does not divide (the slots are the
    unpacked program's segments, unpadded), or room for fewer than 2 documents."""
    lengths = [p.branch.effective_length for p in plans if p.branch.window is None]
    if not lengths or any(p.branch.padded_length != p.branch.effective_length
                          for p in plans if p.branch.window is None):
        return None
    unit = max(lengths)
    if any(unit % w for w in lengths) or seq_len // unit < 2:
        return None
    return unit, seq_len // unit


def padded_layout(segment_ids, unit: int, max_documents: int):
    """The slots of the padded layout: ``source`` [B, T'] int32, the position of the
    token in each slot (``T`` for an empty one) when every document starts at a
    multiple of ``unit``; ``T' = group_count(T, unit, max_documents) * unit``. A
    document of ``L`` tokens takes ``ceil(L / unit) unit`` slots, so the slots suffice
    for ``max_documents`` documents (a row with more loses its last tokens: the caller
    refuses it)."""
    b, t = segment_ids.shape
    length = group_count(t, unit, max_documents) * unit
    pos = jnp.arange(t, dtype=jnp.int32)
    rel = pos[None, :] - document_starts(segment_ids)
    last = jnp.concatenate([segment_ids[:, 1:] != segment_ids[:, :-1],
                            jnp.ones_like(segment_ids[:, :1], bool)], axis=1)
    gap = jnp.where(last, (-(rel + 1)) % unit, 0)  # empty slots after a document's end
    dest = pos[None, :] + jnp.cumsum(gap, axis=1, dtype=jnp.int32) - gap
    return jnp.full((b, length), t, jnp.int32).at[jnp.arange(b)[:, None], dest].set(
        jnp.broadcast_to(pos, (b, t)), mode="drop")


def packed_attention(kernel, args: KernelArgs, plans, mode: str, query, key, value,
                     kv_mask, rng, *, segment_ids, max_documents: int | None):
    """``(out [B, T, H, D], lse [B, T, H])`` of dilated attention over packed rows, every
    branch of ``plans`` (window branches: the windowed kernel inside each document),
    combined as unpacked; a row with more than ``max_documents`` documents is a
    ``ValueError`` (concrete ids) or NaN output (traced ids).

    The layout (module docstring): the slots where they serve ``max_documents``; else
    the streams, bounded by ``max_documents`` or compact. Where the slots serve fewer
    documents than the bound allows (or there is no bound), a row batch with few
    enough documents still takes the slots: chosen now for concrete ids, by a
    ``lax.cond`` on the count for traced ones. Either layout gives the partial of the
    segment-grid branches, entered from here (the slots: the streamed program,
    :func:`jax_dilated.ops.dilated_local.attend`); the sliding windows are mixed in
    after (:func:`jax_dilated.ops.dilated_window.add_windows`).
    """
    starts = document_starts(segment_ids)
    documents = jnp.sum(starts == jnp.arange(starts.shape[1]), axis=1)
    concrete = not isinstance(documents, jax.core.Tracer)
    if max_documents is not None and concrete:
        most = int(jnp.max(documents))
        if most > max_documents:
            raise ValueError(
                f"segment_ids has a row of {most} documents (maximal runs of equal "
                f"ids), more than max_documents={max_documents}.")
    dense = tuple(p for p in plans if p.branch.window is None)
    # a row with more documents than max_documents (reachable only under jit, where
    # the ids are traced): NaN, never a result computed from cut streams or slots
    overflow = (jnp.zeros(query.shape[0], bool) if max_documents is None
                else documents > max_documents)
    partial = None
    if dense:
        streams = functools.partial(_streams, kernel, args, plans, mode, query, key, value,
                                    kv_mask, starts, max_documents, rng)
        slots = slots_capacity(plans, query.shape[1])
        if slots is not None:
            unit, capacity = slots
            bound = (max_documents if max_documents is not None and max_documents <= capacity
                     else capacity)
            fits = True if bound == max_documents else jnp.max(documents) <= capacity
            padded = functools.partial(
                dilated_local.attend, dilated_local.StreamedCall(kernel, args, dense, mode,
                                                                 len(plans)),
                query, key, value, kv_mask, rng, padded_layout(segment_ids, unit, bound))
            if concrete or fits is True:
                partial = padded() if bool(fits) else streams()
            else:
                partial = jax.lax.cond(fits, padded, streams)
        else:
            partial = streams()
    o, lse = dilated_window.add_windows(partial, kernel, args, plans, mode, query, key, value,
                                        kv_mask, rng, segment_ids)
    return jnp.where(overflow[:, None, None, None], jnp.asarray(jnp.nan, o.dtype), o), lse


def _streams(kernel, args: KernelArgs, plans, mode: str, query, key, value, kv_mask,
             starts, max_documents: int | None, rng):
    """The partial ``(o, lse, lse_lo)`` of the segment-grid branches of ``plans``
    through their streams (:func:`packed_branch`), as the streamed program gives it
    (longnet: merged, ``o`` in query's dtype; head_groups: each branch's heads hold its
    output divided by ``len(plans)``, the window branches' heads 0 and ``-inf``); NaN
    in a row with more than ``max_documents`` documents."""
    b, t, h, d = query.shape
    stats = softmax.stats_dtype(query.dtype)
    partial, overflow, pieces = None, jnp.zeros(b, bool), []
    for i, plan in enumerate(plans):
        if plan.branch.window is not None:
            if mode == "head_groups":  # its heads: 0 and -inf here, the window's later
                pieces.append(varying_like(softmax.empty_partial(
                    (b, t, len(plan.query_heads), d), stats), (query, key, value)))
            continue
        o_i, lse_i, lo_i, over = packed_branch(
            kernel, args, plan, query, key, value, kv_mask, starts,
            None if rng is None else jax.random.fold_in(rng, i), max_documents)
        overflow = overflow | over
        part = (o_i.astype(stats), lse_i, lo_i)
        if mode == "longnet":  # every branch holds every head
            partial = part if partial is None else softmax.merge_partials(*partial, *part)
        else:  # the groups' heads side by side, in order
            pieces.append((part[0] / len(plans), *part[1:]))
    if mode == "head_groups":
        partial = tuple(jnp.concatenate(x, axis=2) for x in zip(*pieces))
    o, lse, lse_lo = partial
    o = jnp.where(overflow[:, None, None, None], jnp.asarray(jnp.nan, o.dtype), o)
    return o.astype(query.dtype), lse, lse_lo
