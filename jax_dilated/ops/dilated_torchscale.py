"""``mode="torchscale"``: dilated attention as torchscale's LongNet computes it
(docs/semantics.md, section 2, "torchscale"), the arithmetic that pretrained LongNet
weights (Prov-GigaPath's slide encoder, LongViT) were trained with.

For a branch ``(w, r)`` on ``L`` tokens torchscale cuts the sequence into segments of
``w' = min(w, L)`` tokens, zero-pads the sequence to whole segments and every segment
to ``m = ceil(w' / r) r`` tokens, and runs dense attention among the ``m / r`` slots of
each (segment, head offset). The padded slots are zero vectors: keys of logit 0 and
value 0 that stay in every softmax, and zero queries. The padded segments are then
concatenated and cut back to ``L`` tokens, so where ``r`` does not divide ``w'`` (and
there are several segments) a branch's outputs land ``m - w'`` positions further on
per segment, some of them a zero query's output.

That is exactly exact dilated attention of the one branch ``(m, r)`` (``"blocked"``
head offsets) on the *padded* sequence of ``n m`` tokens with every position a real
key (:class:`PaddedBranch`), whose first ``L`` outputs are torchscale's: each branch
runs as its own one-device program (:func:`jax_dilated.ops.dilated_programs.one_device`,
so on every kernel) on its padded copy of q, k, v (pads and reshapes, no gather).

Where no branch shifts its outputs (each ``w'`` a multiple of its ``r``, or one segment:
Prov-GigaPath's slides below 185,363 tiles) and a kernel serves ragged segments itself
(the native and XLA kernels; cuDNN serves whole segments only, so it keeps the padded
copies), each branch runs instead as exact dilated attention ``(w', r)`` on the
sequence itself, and its ``z`` zero slots are added afterwards (:func:`_add_zero_slots`):
``lse' = log(exp(lse) + z)``, ``o' = o exp(lse - lse')``, exactly the padded softmax
(zero keys add ``exp(0)`` each to its denominator and nothing to its numerator), with
its gradients; causal attention needs nothing added, every zero slot of a column coming
after its real ones. That skips the copies and the zero slots' work (a 1,068-tile slide's
second 1024-segment would hold 979 zero keys).

On a kernel that runs every branch in one call (the native CPU kernel), an unshifted
call that is not differentiated (inference) goes further: torchscale's mix of the
branches, ``sum_i softmax_i(lse_i) o_i``, is the softmax over every branch's pairs
together, each pair counted once per branch that holds it, with the zero slots of all
branches in its denominator. That is ``"longnet"`` attention of all the branches
(``"blocked"`` offsets) in one call, with the branches' zero slots added to its
softmax once (:func:`_inference_primal`); the five outputs and their mix are never
formed. Its derivative is this module's branch-by-branch computation (the weights
without gradient), run where the call is differentiated. What the one call cannot do is
torchscale's rule for a branch whose lse is exactly 0: a floating-point coincidence
on a real position (a branch seeing one key of logit exactly 0), which the
branch-by-branch computation keeps.

The branches are then mixed by a softmax of their log-sum-exps with no gradient through
the weights, an lse of exactly 0 or an uncovered position counting as ``-1e8``
(:func:`merge`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_dilated.core import branch_plans
from jax_dilated.ops import head_parallel
from jax_dilated.ops.dilated_programs import DilatedCall, one_device

__all__ = ["PaddedBranch", "padded_branches", "unshifted", "zero_slots", "attend",
           "device_program", "merge", "UNCOVERED_LSE", "MESH_REASON"]

# torchscale's log-sum-exp of a (position, head) that a branch does not cover
UNCOVERED_LSE = -1e8

# why over a mesh the mode runs only as the whole sequence of some heads per device
MESH_REASON = ("mode='torchscale' runs over a mesh as the whole sequence of some heads per "
               "device ('heads', or 'allgather'): its padded segments and shifted outputs "
               "are laid out over the whole sequence")


@dataclasses.dataclass(frozen=True)
class PaddedBranch:
    """One branch of torchscale's dilated attention on ``seq_len`` tokens.

    segment: ``w' = min(w, L)``; rate: ``r``; num_segments: ``n = ceil(L / w')``;
    padded_segment: ``m = ceil(w' / r) r``, the segment with its last row of ``r``
    columns completed by zero slots. The padded sequence holds ``n m`` tokens:
    token ``u`` of segment ``s`` at ``s m + u``, zeros where ``u >= w'`` or
    ``s w' + u >= L``.
    """

    segment: int
    rate: int
    num_segments: int
    seq_len: int

    @property
    def padded_segment(self) -> int:
        return -(-self.segment // self.rate) * self.rate

    @property
    def padded_len(self) -> int:
        return self.num_segments * self.padded_segment

    @property
    def unpadded(self) -> bool:
        """Whether the padded sequence is the sequence itself."""
        return self.padded_len == self.seq_len

    def lay_out(self, x):
        """``x`` [B, L, ...] -> the padded sequence [B, n m, ...] (zero slots)."""
        if self.unpadded:
            return x
        n, w, m = self.num_segments, self.segment, self.padded_segment
        rest = [(0, 0)] * (x.ndim - 2)
        x = jnp.pad(x, [(0, 0), (0, n * w - self.seq_len)] + rest)
        x = x.reshape(x.shape[0], n, w, *x.shape[2:])
        x = jnp.pad(x, [(0, 0), (0, 0), (0, m - w)] + rest)
        return x.reshape(x.shape[0], n * m, *x.shape[3:])

    @property
    def plan_branch(self) -> tuple[int, int]:
        """The exact-dilated branch that runs on the padded sequence: ``(m, r)``."""
        return (self.padded_segment, self.rate)


def padded_branches(branches, seq_len: int) -> list[PaddedBranch]:
    """Every ``(w, r)`` of ``branches`` as torchscale lays it out on ``seq_len`` tokens."""
    out = []
    for w, r in branches:
        seg = min(w, seq_len)
        out.append(PaddedBranch(seg, r, -(-seq_len // seg), seq_len))
    return out


def merge(outs, lses, dtype):
    """torchscale's mix of the branches' ``(out [B, L, H, D], lse [B, L, H])``: weights
    ``softmax_i(lse_i)`` with no gradient, an uncovered position's lse (``-inf`` here)
    and an lse of exactly 0 counting as :data:`UNCOVERED_LSE`. Returns ``(out, lse)``,
    ``lse`` the log-sum-exp of those lses (without gradient)."""
    lse = jnp.stack([jnp.where(jnp.isfinite(x) & (x != 0), x, UNCOVERED_LSE) for x in lses])
    lse = jax.lax.stop_gradient(lse)
    weights = jax.nn.softmax(lse, axis=0)
    acc = sum(w[..., None] * o.astype(w.dtype) for w, o in zip(weights, outs))
    return acc.astype(dtype), jax.scipy.special.logsumexp(lse, axis=0)


def unshifted(branches) -> bool:
    """Whether every branch's outputs stay at their positions: its segment a multiple
    of its rate (``m = w'``), or one segment (the padding falls past ``L``)."""
    return all(pb.padded_segment == pb.segment or pb.num_segments == 1 for pb in branches)


def zero_slots(pb: PaddedBranch, heads, num_heads: int) -> np.ndarray:
    """[L, len(heads)] the zero slots in the softmax of each (position, head) the branch
    covers: ``m / r`` slots per (segment, offset) less the real positions of that
    column; 0 where the branch does not cover the pair."""
    w, r, m, t = pb.segment, pb.rate, pb.padded_segment, pb.seq_len
    offsets = branch_plans.head_offsets(num_heads, r, "blocked")[np.asarray(heads)]  # [Hs]
    pos = np.arange(t)
    start = (pos // w) * w
    real_len = np.minimum(w, t - start)  # [L]: the length of each position's segment
    column = (pos - start) % r
    real = -(-(real_len[:, None] - offsets[None, :]) // r)  # ceil, [L, Hs]
    z = m // r - np.maximum(real, 0)
    return np.where(column[:, None] == offsets[None, :], z, 0)


def _add_zero_slots(o, lse, z: np.ndarray):
    """The result of a softmax with ``z`` [L, Hs] more keys of logit 0 and value 0 from
    the exact one: ``lse' = log(exp(lse) + z)`` and ``o' = o exp(lse - lse')``
    (differentiable: the result is a function of the exact softmax's own statistics).
    Uncovered pairs (``lse = -inf``) stay as they are."""
    if not z.any():
        return o, lse
    covered = jnp.isfinite(lse)
    log_z = jnp.asarray(np.log(np.maximum(z, 1)), lse.dtype)
    safe = jnp.where(covered, lse, 0.0)
    padded = jnp.where(jnp.asarray(z > 0), jnp.logaddexp(safe, log_z), safe)
    factor = jnp.where(covered, jnp.exp(safe - padded), 0.0)
    o = (o.astype(factor.dtype) * factor[..., None]).astype(o.dtype)
    return o, jnp.where(covered, padded, lse)


def attend(call: DilatedCall, query, key, value, rng, *, heads=None,
           num_heads: int | None = None, valid_length: int | None = None):
    """``(out [B, L, H, D], lse [B, L, H])`` of torchscale's dilated attention on one
    device (module docstring). ``heads``: the global indices of ``query``'s heads
    (default all of them; a device's share under a head exchange, whose offsets
    follow the global numbering of ``num_heads``); ``valid_length``: only the first
    that many tokens exist (the rest are padding: output 0, lse ``-inf``)."""
    t = query.shape[1]
    length = t if valid_length is None else valid_length
    if length < t:
        query, key, value = (x[:, :length] for x in (query, key, value))
    heads = np.arange(query.shape[2]) if heads is None else np.asarray(heads)
    num_heads = query.shape[2] if num_heads is None else num_heads
    branches = padded_branches(call.branches, length)
    in_place = rng is None and unshifted(branches) and (call.kernel.blockwise
                                                        or call.kernel.fused_dilated)
    by_branch = functools.partial(_branch_by_branch, call, branches, rng, heads, num_heads,
                                  in_place)
    if in_place and call.kernel.fused_dilated:
        all_at_once = functools.partial(_all_branches_at_once, call, branches, heads,
                                        num_heads)
        out, lse = _inference_primal(all_at_once, by_branch)(query, key, value)
    else:
        out, lse = by_branch(query, key, value)
    if length < t:
        out = jnp.pad(out, [(0, 0), (0, t - length), (0, 0), (0, 0)])
        lse = jnp.pad(lse, [(0, 0), (0, t - length), (0, 0)], constant_values=-jnp.inf)
    return out, lse


def _branch_by_branch(call: DilatedCall, branches, rng, heads, num_heads: int,
                      in_place: bool, query, key, value):
    """torchscale's computation as it is defined: each branch's ``(o, lse)``, on the
    sequence with its zero slots added afterwards (``in_place``) or on its padded copy,
    then :func:`merge`."""
    length, hkv = query.shape[1], key.shape[2]
    outs, lses = [], []
    for i, pb in enumerate(branches):
        if in_place:  # the zero slots added to each softmax afterwards
            plans = head_parallel.head_plans(((pb.segment, pb.rate),), length, num_heads,
                                             heads, hkv, "longnet", "blocked")
            o, lse = one_device(call.kernel, call.args, plans, "longnet", query, key, value,
                                None, None, lse_grad=True)
            if not call.args.is_causal:  # (causal: every zero slot follows the real ones)
                o, lse = _add_zero_slots(o, lse, zero_slots(pb, heads, num_heads))
        else:
            plans = head_parallel.head_plans((pb.plan_branch,), pb.padded_len, num_heads,
                                             heads, hkv, "longnet", "blocked")
            key_i = None if rng is None else jax.random.fold_in(rng, i)
            o, lse = one_device(call.kernel, call.args, plans, "longnet", pb.lay_out(query),
                                pb.lay_out(key), pb.lay_out(value), None, key_i,
                                lse_grad=False)
            o, lse = o[:, :length], lse[:, :length]
        outs.append(o)
        lses.append(lse)
    return merge(outs, lses, query.dtype)


def _all_branches_at_once(call: DilatedCall, branches, heads, num_heads: int,
                          query, key, value):
    """The unshifted branches' mix as one ``"longnet"`` call of all of them, their zero
    slots added to its softmax once (module docstring)."""
    plans = head_parallel.head_plans(tuple((pb.segment, pb.rate) for pb in branches),
                                     query.shape[1], num_heads, heads, key.shape[2],
                                     "longnet", "blocked")
    o, lse = one_device(call.kernel, call.args, plans, "longnet", query, key, value, None,
                        None, lse_grad=False)
    if not call.args.is_causal:
        o, lse = _add_zero_slots(o, lse, sum(zero_slots(pb, heads, num_heads)
                                             for pb in branches))
    return o.astype(query.dtype), jax.lax.stop_gradient(lse)


def _inference_primal(primal, derivative):
    """``f(q, k, v)`` that computes ``primal(q, k, v)`` and, where it is differentiated,
    the value and reverse-mode derivative of ``derivative(q, k, v)`` (the same function
    computed another way)."""
    @jax.custom_vjp
    def f(query, key, value):
        return primal(query, key, value)

    def f_fwd(query, key, value):
        return jax.vjp(derivative, query, key, value)  # the value, and the vjp as residual

    def f_bwd(vjp, cotangent):
        return vjp(cotangent)

    f.defvjp(f_fwd, f_bwd)
    return f


def device_program(call: DilatedCall, heads, *, num_heads: int,
                   valid_length: int | None = None):
    """``(key, program)`` for a device that runs the global heads ``heads`` of
    ``num_heads`` on the whole sequence (:func:`jax_dilated.ops.head_parallel.over_heads`):
    devices whose heads have the same offsets in every branch share a program."""
    offsets = tuple(branch_plans.head_offsets(num_heads, r, "blocked")[np.asarray(heads)]
                    .tobytes() for _, r in call.branches)
    program = functools.partial(_program, call, heads=tuple(int(j) for j in heads),
                                num_heads=num_heads, valid_length=valid_length)
    return offsets, program


def _program(call, q, k, v, mask, rng, *, heads, num_heads, valid_length):
    # the head exchange's program signature; torchscale has no key padding mask
    del mask
    return attend(call, q, k, v, rng, heads=heads, num_heads=num_heads,
                  valid_length=valid_length)
