"""How a global sequence is laid out over the devices of a ring (DESIGN.md section 3).

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

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["LAYOUTS", "check_layout", "check_divisible", "global_order", "to_layout",
           "from_layout", "local_positions", "shard_to_layout", "shard_from_layout"]

LAYOUTS = ("contiguous", "zigzag", "striped")


def check_layout(layout: str) -> str:
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


def to_layout(x, num_devices: int, layout: str, axis: int = 1):
    """Permute the global sequence axis of ``x`` into ``layout`` order."""
    if layout == "contiguous":
        return x
    return jnp.take(x, global_order(x.shape[axis], num_devices, layout), axis=axis)


def from_layout(x, num_devices: int, layout: str, axis: int = 1):
    """Inverse of :func:`to_layout`: back to the user's token order."""
    if layout == "contiguous":
        return x
    inverse = np.argsort(global_order(x.shape[axis], num_devices, layout))
    return jnp.take(x, inverse, axis=axis)


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
