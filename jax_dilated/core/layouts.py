"""How a global sequence is laid out over the devices of a ring (docs/semantics.md, section 3).

* ``"contiguous"``: device ``d`` of ``P`` holds tokens ``[d n, (d + 1) n)``, ``n = T / P``.
* ``"zigzag"``: the sequence is cut into ``2P`` chunks; device ``d`` holds chunks ``d``
  and ``2P - 1 - d`` (so every device holds one early and one late chunk, and a causal
  ring does the same work on every device at every step).
* ``"striped"``: token ``t`` lives on device ``t mod P``.

:func:`to_layout` permutes a global sequence so that cutting it into ``P`` contiguous
shards gives every device its tokens in the layout; :func:`from_layout` undoes it.
:func:`local_positions` gives, inside ``shard_map``, the global positions of a
device's tokens (for the causal rule). :func:`shard_to_layout` /
:func:`shard_from_layout` do the same re-layout inside ``shard_map`` on contiguous
shards, moving only O(T / P) per device (``ppermute`` for zigzag, ``all_to_all``
for striped), which is how ``jd.sharded`` uses them.
"""

from __future__ import annotations

from typing import get_args

import jax
import jax.numpy as jnp
import numpy as np

from jax_dilated.core.types import Array, Layout

__all__ = ["LAYOUTS", "check_layout", "check_divisible", "global_order", "to_layout",
           "from_layout", "local_positions", "shard_to_layout", "shard_from_layout"]

LAYOUTS = get_args(Layout)  # ("contiguous", "zigzag", "striped")


def check_layout(layout: Layout) -> Layout:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")
    return layout


def check_divisible(seq_len: int, num_devices: int, layout: str, *, what="sequence length"):
    """The global length must split evenly: by ``P``, or by ``2P`` for zigzag."""
    parts = 2 * num_devices if layout == "zigzag" else num_devices
    if seq_len % parts:
        raise ValueError(
            f"{what} {seq_len} must be divisible by {parts} "
            f"({'2 x ' if layout == 'zigzag' else ''}{num_devices} devices) for "
            f'layout="{layout}".'
        )


def global_order(seq_len: int, num_devices: int, layout: str) -> np.ndarray:
    """Global token index at each position of the laid-out sequence, [seq_len]."""
    check_layout(layout)
    check_divisible(seq_len, num_devices, layout)
    t = np.arange(seq_len)
    if layout == "contiguous":
        return t
    if layout == "striped":
        return t.reshape(seq_len // num_devices, num_devices).T.reshape(-1)
    chunks = t.reshape(2 * num_devices, -1)
    order = [c for d in range(num_devices) for c in (d, 2 * num_devices - 1 - d)]
    return chunks[order].reshape(-1)


def to_layout(x: Array, num_devices: int, layout: Layout, axis: int = 1) -> Array:
    """Permute the global sequence axis of ``x`` into ``layout`` order.

    Args:
      x: a global array, e.g. [batch, seq, heads, head_dim].
      num_devices: ``P``, the devices of the ring.
      layout: ``"contiguous"`` (unchanged), ``"zigzag"`` (the sequence in ``2P`` chunks;
        device ``d`` gets chunks ``d`` and ``2P-1-d``) or ``"striped"`` (token ``t`` to
        device ``t mod P``); ``seq`` must divide by ``2P`` (zigzag) or ``P``.
      axis: the sequence axis.

    Returns:
      ``x`` with its sequence axis permuted so that the ``d``-th contiguous ``seq / P``
      slice is what device ``d`` holds. :func:`from_layout` undoes it.

    Example:
      >>> import jax.numpy as jnp, jax_dilated as jd
      >>> jd.to_layout(jnp.arange(8)[None], 2, "zigzag").tolist()   # devices 0 | 1
      [[0, 1, 6, 7, 2, 3, 4, 5]]
      >>> jd.to_layout(jnp.arange(8)[None], 2, "striped").tolist()
      [[0, 2, 4, 6, 1, 3, 5, 7]]
    """
    if layout == "contiguous":
        return x
    check_layout(layout)
    check_divisible(x.shape[axis], num_devices, layout)
    # Reshapes, transposes and flips rather than a gather by global_order: their
    # transposes are the same kind of op, where a gather's is a scatter-add whose
    # output sharding is ambiguous on Explicit meshes (batch sharded, sequence not).
    x = jnp.moveaxis(x, axis, 0)
    t, rest, p = x.shape[0], x.shape[1:], num_devices
    if layout == "striped":  # [n, P] -> [P, n]: token i P + d to device d
        x = x.reshape(t // p, p, *rest).swapaxes(0, 1)
    else:  # chunks [2P] -> [P, 2]: device d holds chunks d and 2P - 1 - d
        chunks = x.reshape(2 * p, t // (2 * p), *rest)
        x = jnp.stack([chunks[:p], jnp.flip(chunks[p:], axis=0)], axis=1)
    return jnp.moveaxis(x.reshape(t, *rest), 0, axis)


def from_layout(x: Array, num_devices: int, layout: Layout, axis: int = 1) -> Array:
    """Inverse of :func:`to_layout`: back to the user's token order.

    Arguments as in :func:`to_layout`; ``from_layout(to_layout(x, P, l), P, l) == x``.

    Example:
      >>> import jax.numpy as jnp, jax_dilated as jd
      >>> x = jnp.arange(8)[None]
      >>> bool((jd.from_layout(jd.to_layout(x, 2, "zigzag"), 2, "zigzag") == x).all())
      True
    """
    if layout == "contiguous":
        return x
    check_layout(layout)
    check_divisible(x.shape[axis], num_devices, layout)
    x = jnp.moveaxis(x, axis, 0)  # the steps of to_layout, undone in reverse order
    t, rest, p = x.shape[0], x.shape[1:], num_devices
    if layout == "striped":
        x = x.reshape(p, t // p, *rest).swapaxes(0, 1)
    else:
        pairs = x.reshape(p, 2, t // (2 * p), *rest)
        x = jnp.concatenate([pairs[:, 0], jnp.flip(pairs[:, 1], axis=0)], axis=0)
    return jnp.moveaxis(x.reshape(t, *rest), 0, axis)


def local_positions(layout: str, device, num_devices: int, local_len: int):
    """Global positions [local_len] (int32) of the tokens device ``device`` holds.

    ``device`` may be a traced index (``jax.lax.axis_index``).
    """
    a = jnp.arange(local_len, dtype=jnp.int32)
    device = jnp.asarray(device, jnp.int32)
    if layout == "contiguous":
        return device * local_len + a
    if layout == "striped":
        return a * num_devices + device
    half = local_len // 2
    late = 2 * num_devices - 1 - device
    return jnp.where(a < half, device * half + a, late * half + (a - half))


def _zigzag_home(chunk: int, num_devices: int) -> int:
    """The device that holds ``chunk`` (of ``2P``) in the zigzag layout."""
    return chunk if chunk < num_devices else 2 * num_devices - 1 - chunk


def shard_to_layout(x, axis_name, num_devices: int, layout: str):
    """Inside ``shard_map``: this device's contiguous shard [B, n, ...] -> its ``layout`` shard.

    Contiguous device ``e`` holds chunks ``2e`` and ``2e + 1`` of ``2P`` (zigzag), or
    tokens ``e n + i P + j`` that belong to striped devices ``j`` (striped).
    """
    p = num_devices
    if layout == "contiguous" or p == 1:
        return x
    if layout == "zigzag":
        halves = jnp.split(x, 2, axis=1)  # chunks 2e and 2e + 1
        got = [jax.lax.ppermute(halves[h], axis_name,
                                [(e, _zigzag_home(2 * e + h, p)) for e in range(p)])
               for h in (0, 1)]
        # device d receives chunk d and chunk 2P-1-d, one by each permute; which
        # one arrives through the even-chunk permute depends on d's parity
        even = jax.lax.axis_index(axis_name) % 2 == 0
        return jnp.where(even, jnp.concatenate(got, 1), jnp.concatenate(got[::-1], 1))
    b, n = x.shape[:2]
    y = jnp.moveaxis(x.reshape(b, n // p, p, *x.shape[2:]), 2, 1)  # [B, dest j, i, ...]
    y = jax.lax.all_to_all(y, axis_name, 1, 1, tiled=True)  # [B, source e, i, ...]
    return y.reshape(b, n, *x.shape[2:])


def shard_from_layout(x, axis_name, num_devices: int, layout: str):
    """Inverse of :func:`shard_to_layout`: a ``layout`` shard back to the contiguous one."""
    p = num_devices
    if layout == "contiguous" or p == 1:
        return x
    if layout == "zigzag":
        first, second = jnp.split(x, 2, axis=1)  # chunks d and 2P-1-d
        even = jax.lax.axis_index(axis_name) % 2 == 0
        parts = (jnp.where(even, first, second), jnp.where(even, second, first))  # even, odd
        back = [jax.lax.ppermute(parts[h], axis_name,
                                 [(_zigzag_home(2 * e + h, p), e) for e in range(p)])
                for h in (0, 1)]
        return jnp.concatenate(back, 1)
    b, n = x.shape[:2]
    y = jax.lax.all_to_all(x.reshape(b, p, n // p, *x.shape[2:]), axis_name, 1, 1,
                           tiled=True)  # [B, j, i, ...]
    return jnp.moveaxis(y, 1, 2).reshape(b, n, *x.shape[2:])
