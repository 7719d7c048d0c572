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
(:func:`over_heads`).

``"auto"`` chooses one (for dilated attention possibly a per-branch tuple) from the
cost model of :func:`estimate` (bytes sent and memory held per device, whether the
transfer overlaps compute); :func:`explain_strategy` prints the choice and the
numbers.

``"hybrid"`` (two mesh axes ``seq_axis=(a, b)``, :mod:`.hybrid`): the heads strategy's
all-to-all over ``a`` and the operation's own ring over ``b`` on ``H / P_a`` heads, so
that the sequence scales past the head count (USP / long-context-attention's Ulysses x
ring); the library's operations (dilated attention runs it itself).

The package, by job: :mod:`.operation` (what ``jd.sharded`` was given, which strategies
can serve it), :mod:`.heads`, :mod:`.allgather` and :mod:`.hybrid` (each strategy's program inside
``shard_map``; ``"ring"`` is the operation's own), :mod:`.cost` (the cost model) with
:mod:`.pricing` (its figures' record and how a device kind prices them), and
:mod:`.choice` (``"auto"``'s pick, :func:`explain_strategy`).
"""

from __future__ import annotations

# the head-parallel transforms are part of this package's public names
from jax_dilated.core import validation
from jax_dilated.ops.head_parallel import (gather_tokens, heads_to_seq, over_heads,
                                           seq_to_heads)
from jax_dilated.ops.strategies.allgather import allgather_local
from jax_dilated.ops.strategies.choice import choose, explain_strategy
from jax_dilated.ops.strategies.cost import StrategyCost, estimate
from jax_dilated.ops.strategies.heads import heads_local
from jax_dilated.ops.strategies.hybrid import hybrid_local, hybrid_unservable
from jax_dilated.ops.strategies.operation import (STRATEGIES, Operation, accepts,
                                                  check_sharded_strategy, describe, require,
                                                  servable)

__all__ = ["STRATEGIES", "Operation", "describe", "accepts", "check_sharded_strategy",
           "servable", "require", "seq_to_heads", "heads_to_seq", "gather_tokens",
           "heads_local", "allgather_local", "hybrid_local", "hybrid_unservable",
           "over_heads", "StrategyCost",
           "estimate", "choose", "explain_strategy"]


def dilated_over_heads(call, q, k, v, mask, segment_ids, rng, **kw):
    """Deprecated: ``(out, lse)`` of :func:`over_heads`, which returns the program, its
    operands and the way back so that its caller enters the program itself."""
    validation.warn_renamed("dilated_over_heads", "over_heads (returns (program, "
                            "operands, back): back(*program(*operands)))",
                            "jax_dilated.ops.strategies")
    program, operands, back = over_heads(call, q, k, v, mask, rng, segment_ids=segment_ids,
                                         **kw)
    return back(*program(*operands))
