"""The devices that hold one dilated segment, and how they bring it together.

A dilated branch whose segment spans ``g`` consecutive devices of the axis
(:mod:`jax_dilated.ops.distributed`) runs among that :class:`Group`: its
``"allgather"`` strategy gathers the segment's dilated keys and values
(:func:`group_gather`, :func:`gathered`), its ``"heads"`` strategy exchanges heads by an
all-to-all inside the group around each kernel call (:class:`HeadExchange`, which is
itself a kernel, so the one-device streamed program can run it chunk by chunk).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_dilated.backends import KernelArgs
from jax_dilated.backends.base import NO_MASKS, KernelBase, Masks
from jax_dilated.ops.head_parallel import kv_repeat

__all__ = ["group_gather", "Group", "gathered", "HeadExchange", "head_exchanged"]


def group_gather(x, axis_name: str, num_devices: int, group: int):
    """``[B, L, ...]`` of the ``group`` consecutive devices of this device's group,
    concatenated in device order along axis 1 (all of them when ``group == P``)."""
    if x is None:
        return None
    if group == num_devices:
        return jax.lax.all_gather(x, axis_name, axis=1, tiled=True)
    # g - 1 shifts inside each group: blocks[s] is the block of ring index (i - s) % g
    g, p = group, num_devices
    blocks = [x]
    for s in range(1, g):
        perm = [(j, j - j % g + (j % g + s) % g) for j in range(p)]
        blocks.append(jax.lax.ppermute(x, axis_name, perm))
    # order by source ring index c: source c sits at s = (i - c) % g
    stacked = jnp.stack([blocks[(-c) % g] for c in range(g)])  # [g, ...]: source (c - i)
    i = jax.lax.axis_index(axis_name) % g
    stacked = jnp.roll(stacked, i, axis=0)
    return jnp.concatenate(list(stacked), axis=1)


@dataclasses.dataclass(frozen=True)
class Group:
    """The ``size`` consecutive devices of ``axis_name`` (of ``num_devices``) that hold
    one dilated segment, and the kernel that attends inside it (``lse_grad``: whether
    its calls' lse is differentiated, ``Kernel.attention``)."""

    axis_name: str
    num_devices: int
    size: int
    kernel: object
    args: KernelArgs
    lse_grad: bool = True


def gathered(grp: Group, rng, q, k, v, valid):
    """Strategy ``"allgather"``: this device's dilated queries [N, L, Hq, D] against the
    segment's dilated keys of all ``g`` devices (global positions inside it)."""
    length = q.shape[1]
    kg, vg, validg = (group_gather(x, grp.axis_name, grp.num_devices, grp.size)
                      for x in (k, v, valid))
    start = (jax.lax.axis_index(grp.axis_name) % grp.size) * length
    return grp.kernel.attention(
        q, kg, vg, grp.args, Masks(q_positions=start + jnp.arange(length, dtype=jnp.int32),
                                   k_positions=jnp.arange(grp.size * length, dtype=jnp.int32),
                                   kv_valid=validg, dropout_rng=rng),
        lse_grad=grp.lse_grad)


@dataclasses.dataclass(frozen=True)
class HeadExchange(KernelBase):
    """Strategy ``"heads"`` as a kernel: every call's ``[N, L, H, D]`` (this device's
    ``L`` dilated tokens of a segment spanning the ``g`` devices of ``grp``, ``H``
    heads) is exchanged by an all-to-all inside the group for ``[N, g L, H / g, D]``
    (the whole dilated segment of a ``1 / g`` slice of the heads), ``grp.kernel``
    runs on that, and the results come back the same way.

    kv heads are repeated first where ``g`` does not divide them, their gradients
    summed back. Rows are in segment order after the exchange (devices in order), so
    the kernel's own positions are the causal ones. Every device of the group calls
    it in the same order: the streamed program's chunks
    (:func:`jax_dilated.ops.dilated_local.attend`) or one call per branch.
    """

    grp: Group

    @property
    def name(self) -> str:
        return self.grp.kernel.name

    def _groups(self):
        g, p = self.grp.size, self.grp.num_devices
        return None if g == p else [list(range(s, s + g)) for s in range(0, p, g)]

    def _exchange(self, xs, *, to_heads: bool) -> list:
        """``xs`` (None passes through) moved to heads, ``[N, L, H, ...]`` -> ``[N, g L,
        H / g, ...]``, or back. Per-row arrays (``[N, L, H]``: log-sum-exps, delta) of
        one dtype travel stacked in one all-to-all, the others one each: every
        collective is a rendezvous of the group's devices, but stacking the
        ``[N, L, H, D]`` ones made copies that raised the backward's peak (at P=8,
        T=32768: temp 58.5 -> 65.5 MiB)."""
        split, concat = (2, 1) if to_heads else (1, 2)
        moved = list(xs)
        alike: dict = {}
        for i, x in enumerate(xs):
            if x is not None:
                key = (x.shape, jnp.dtype(x.dtype)) if x.ndim == 3 else i
                alike.setdefault(key, []).append(i)
        for idx in alike.values():
            one = len(idx) == 1
            x = xs[idx[0]] if one else jnp.stack([xs[i] for i in idx])
            y = jax.lax.all_to_all(x, self.grp.axis_name, split + (not one),
                                   concat + (not one), tiled=True,
                                   axis_index_groups=self._groups())
            for j, i in enumerate(idx):
                moved[i] = y if one else y[j]
        return moved

    def _repeat_kv(self, k, v, valid):
        """k, v and their validity with every kv head repeated where ``g`` does not
        divide them (query head ``i`` reads kv head ``i // G``; a repeat keeps that)."""
        rep = kv_repeat(k.shape[2], self.grp.size)
        if rep > 1:
            k, v = (jnp.repeat(x, rep, axis=2) for x in (k, v))
            valid = None if valid is None else jnp.repeat(valid, rep, axis=2)
        return k, v, valid

    @staticmethod
    def _unrepeat(dx, kv_heads: int):
        """A kv gradient in repeated heads summed back to ``kv_heads``."""
        rep = dx.shape[2] // kv_heads
        return dx if rep == 1 else dx.reshape(*dx.shape[:2], kv_heads, rep,
                                              *dx.shape[3:]).sum(3)

    def batch_chunk(self, n: int, q, k, args: KernelArgs) -> int:
        g = self.grp.size
        kv_heads = k.shape[2] * kv_repeat(k.shape[2], g)
        return self.grp.kernel.batch_chunk(
            n, jax.ShapeDtypeStruct((q.shape[0], g * q.shape[1], q.shape[2] // g,
                                     *q.shape[3:]), q.dtype),
            jax.ShapeDtypeStruct((k.shape[0], g * k.shape[1], kv_heads // g, *k.shape[3:]),
                                 k.dtype), args)

    @staticmethod
    def _inner_masks(masks: Masks, valid) -> Masks:
        """The inner call's masks: the exchanged ``kv_valid`` and the dropout key (a
        dilated segment's calls carry no positions or ids: rows are in segment order
        after the exchange)."""
        if any(x is not None for x in (masks.q_positions, masks.k_positions,
                                       masks.q_segment_ids, masks.k_segment_ids)):
            raise ValueError("a head exchange serves calls with kv_valid and dropout only "
                             "(no positions or segment ids)")
        return Masks(kv_valid=valid, dropout_rng=masks.dropout_rng)

    def forward(self, q, k, v, args: KernelArgs, masks: Masks = NO_MASKS):
        q, k, v, valid = self._exchange((q, *self._repeat_kv(k, v, masks.kv_valid)),
                                        to_heads=True)
        out = self.grp.kernel.forward(q, k, v, args, self._inner_masks(masks, valid))
        return tuple(self._exchange(out, to_heads=False))

    def backward(self, q, k, v, do, lse, delta, args: KernelArgs, masks: Masks = NO_MASKS,
                 *, out=None):
        kv_heads = k.shape[2]
        k, v, valid = self._repeat_kv(k, v, masks.kv_valid)
        q, k, v, do, lse, delta, out, valid = self._exchange(
            (q, k, v, do, lse, delta, out, valid), to_heads=True)
        grads = self.grp.kernel.backward(q, k, v, do, lse, delta, args,
                                         self._inner_masks(masks, valid), out=out)
        dq, dk, dv = self._exchange(grads, to_heads=False)
        return dq, self._unrepeat(dk, kv_heads), self._unrepeat(dv, kv_heads)

    def attention(self, q, k, v, args: KernelArgs, masks: Masks = NO_MASKS, *, sinks=None,
                  lse_grad=True):
        """``(o, lse, lse_lo)`` through the inner kernel's own ``attention`` (its
        ``custom_vjp``; the exchanges are linear and differentiate by themselves)."""
        if sinks is not None:
            raise ValueError("a head exchange folds no sinks (the caller merges them)")
        q, k, v, valid = self._exchange((q, *self._repeat_kv(k, v, masks.kv_valid)),
                                        to_heads=True)
        out = self.grp.kernel.attention(q, k, v, args, self._inner_masks(masks, valid),
                                        lse_grad=lse_grad)
        return tuple(self._exchange(out, to_heads=False))


def head_exchanged(grp: Group, rng, q, k, v, valid):
    """Strategy ``"heads"`` for one branch outside the streamed program."""
    return HeadExchange(grp).attention(q, k, v, grp.args,
                                       Masks(kv_valid=valid, dropout_rng=rng),
                                       lse_grad=grp.lse_grad)
