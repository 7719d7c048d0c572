"""What one step of a ring computes: the :class:`RingSteps` protocol a kernel's fused
ring steps implement (:meth:`~jax_dilated.backends.base.Kernel.ring_steps`), and what a
step sees: this device's queries (:class:`QuerySide`), the visiting key/value block
(:class:`KeySide`) and, in the backward, the global rows (:class:`RowGrads`).

The ring loop (:mod:`jax_dilated.ops.ring`) owns the transfers and the skipping; a
RingSteps owns the layout of the travelling keys/values and the arithmetic of folding
one visiting block into accumulators. Shapes and the stats dtype as in
:mod:`jax_dilated.backends.base`.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

__all__ = ["QuerySide", "KeySide", "RowGrads", "RingSteps"]


class QuerySide(NamedTuple):
    """This device's queries, the same at every step of a ring.

    q: [N, Lq, H, D].
    positions: int [Lq], global positions for the causal rule (None: ``arange``).
    index: this device's index in its ring (int or traced int32).
    segments: int [N, Lq] document ids of the queries (packed sequences), or None.
    """

    q: Any
    positions: Any = None
    index: Any = 0
    segments: Any = None


class KeySide(NamedTuple):
    """The key/value block visiting one ring step.

    kv: the block as :meth:`RingSteps.pack_kv` made it (a pytree that travels).
    positions: int [Lk] global positions (None: ``arange``).
    valid: bool [N, Lk] or [N, Lk, H_kv] key padding mask, or None.
    index: the ring index of the device the block belongs to (int or traced).
    dropout_rng: the dropout key of (this device, this block), or None.
    blocks: a :class:`~jax_dilated.backends.base.BlockLists` in blocks of exactly ``args.block_q`` x
      ``args.block_k``, the key blocks each query block visits (block-sparse ring
      steps only; None: every block).
    segments: int [N, Lk] document ids of the keys (they travel with the block), or
      None (then ``QuerySide.segments`` is None too).
    """

    kv: Any
    positions: Any = None
    valid: Any = None
    index: Any = 0
    dropout_rng: Any = None
    blocks: Any = None
    segments: Any = None


class RowGrads(NamedTuple):
    """The backward's per-query-row inputs, the same at every step.

    do: [N, Lq, H, D] output cotangent; lse: [N, Lq, H] the *global* log-sum-exp
    (rounded); delta: [N, Lq, H] :func:`~jax_dilated.core.softmax.backward_delta` of
    the global output. ``do`` and ``delta`` carry the global log-sum-exp's low part
    (:func:`~jax_dilated.core.softmax.backward_rows`). (lse, delta in the stats
    dtype.) out: None, or the global output [N, Lq, H, D] in the queries' dtype when
    the global log-sum-exp has no cotangent (``delta = rowsum(do * out)``): handed to
    ``Kernel.backward(out=)``, so cuDNN runs its own backward at every step.
    """

    do: Any
    lse: Any
    delta: Any
    out: Any = None


class RingSteps(Protocol):
    """One ring step's work, forward and backward, with accumulators carried in place.

    A ring of ``P`` steps (:mod:`jax_dilated.ops.ring`) packs this device's keys and
    values once, sends the packed block around, and at every step folds the
    visiting block into accumulators::

        kv = pack_kv(k, v)                                     # once per ring
        acc = empty_partial(q.shape, stats)                    # (o, lse, lse_lo)
        for each visiting block:  keys, needed = visit(query, keys)
                                  acc = forward(query, keys, acc)   where needed
        dq, dkv = zeros                                        # stats dtype
        for each visiting block:  keys, needed = visit(query, keys)
                                  (dq, dkv) = backward(query, keys, rows, (dq, dkv))  where needed
        dk, dv = unpack_kv(dkv)                                # after dkv came home

    ``forward`` and ``backward`` must draw the same dropout masks from the same
    ``keys.dropout_rng``. :func:`jax_dilated.ops.ring_steps.kernel_steps` gives a
    backend's fused steps (:meth:`~jax_dilated.backends.base.Kernel.ring_steps`) or,
    without them, the generic adapter over the kernel's plain ``forward``/``backward``.
    """

    #: True: the ring keeps the forward's packed block (home again after P hops) for
    #: the backward; False: packing is free (identity) and the backward packs again.
    keep_packed: bool

    def pack_kv(self, k, v):
        """k, v [N, Lk, H_kv, D] -> the block in this step's layout (a pytree)."""

    def visit(self, query: QuerySide, keys: KeySide) -> tuple[KeySide, object]:
        """``(keys, needed)``: the visiting block's keys as :meth:`forward` and
        :meth:`backward` read them (``keys`` itself, or with what the steps add, e.g.
        a block-sparse step's ``blocks``), and whether the step has any allowed
        (query, key) pair: None (statically always, or steps that skip inside
        ``forward``/``backward`` themselves), a Python bool, or a traced bool; the
        ring skips the step (forward and backward, accumulators unchanged) where it
        is False."""

    def forward(self, query: QuerySide, keys: KeySide, acc):
        """Fold the visiting block into the running normalised partial ``acc = (o,
        lse, lse_lo)``, o [N, Lq, H, D], lse and lse_lo [N, Lq, H] (stats dtype): the
        result is the partial over the keys of both, as
        :func:`~jax_dilated.core.softmax.merge_partials` gives it."""

    def backward(self, query: QuerySide, keys: KeySide, rows: RowGrads, acc):
        """Add the visiting block's gradients to ``acc = (dq, dkv)``: dq [N, Lq, H, D]
        and dkv shaped like ``keys.kv``, both in the stats dtype."""

    def unpack_kv(self, dkv):
        """The gradient accumulator of a packed block -> (dk, dv) [N, Lk, H_kv, D]."""
