"""Relative position encodings applied to queries and keys: rotary (RoPE) and xPos.

Both are ``qk_transform`` callables of the multi-head layers
(:class:`jax_dilated.nnx.MultiheadDilatedAttention` ``qk_transform=``): they take the
projected ``q`` [batch, seq, heads, head_dim], ``k`` [batch, seq, kv_heads,
head_dim] and the tokens' positions ``positions`` int32 [seq] (or [batch, seq]:
positions within packed documents, see ``segment_ids``), and return ``(q, k)`` of
the same shapes. They are frozen dataclasses (hashable, static under
``jax.jit``).

Rotary (Su et al., RoFormer): feature ``i`` and ``i + head_dim/2`` of every head form
a pair that is rotated by the angle ``position * theta_i``, ``theta_i =
base^(-2i/head_dim)``. The score ``rot(q, n) . rot(k, m)`` depends on ``n - m`` only.

xPos (Sun et al., "A Length-Extrapolatable Transformer", used by LongNet): rotary,
plus the pair ``i`` of ``q`` at position ``n`` is scaled by ``zeta_i^((n - c)/B)``
and that of ``k`` at ``m`` by ``zeta_i^(-(m - c)/B)``, ``zeta_i = (2i/head_dim +
gamma) / (1 + gamma)``, ``B = scale_base``. The score of ``(n, m)`` is the rotary
score with pair ``i`` weighted by ``zeta_i^((n - m)/B)``: still relative, and
decaying with distance for ``n > m``. The centre ``c`` cancels in every score; it
only keeps the exponents small (``c`` = half the longest sequence) so that neither
scale under- or overflows in float32 up to ~2x the 32K-token range of a centre at 0.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_dilated.core import validation
from jax_dilated.core.types import Array, ArrayLike, DTypeLike

__all__ = ["Rotary", "XPos", "rotate"]


def _compute_dtype(dtype):
    """float32, or float64 for float64 inputs (angles are never computed in 16 bits)."""
    return jnp.promote_types(dtype, jnp.float32)


def _check_head_dim(head_dim: int, who: str):
    if head_dim % 2:
        raise ValueError(
            f"{who} rotates pairs of features: head_dim must be even, got {head_dim}.")


def _per_row(positions, ct):
    """Positions [T] or [B, T] as [1 or B, T] in dtype ``ct``."""
    positions = jnp.asarray(positions, ct)
    return positions[None] if positions.ndim == 1 else positions


def rotate(x: ArrayLike, positions: ArrayLike, base: float = 10000.0) -> Array:
    """Rotary embedding of ``x`` [batch, seq, heads, head_dim] at ``positions`` [seq]
    (the same for every row) or [batch, seq].

    Pairs ``(x[..., i], x[..., i + head_dim/2])`` are rotated by ``positions *
    base^(-2i/head_dim)``. Returns an array of the shape and dtype of ``x``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax_dilated.models import rotate
      >>> x = jax.random.normal(jax.random.key(0), (1, 4, 2, 8))
      >>> y = rotate(x, jnp.arange(4))
      >>> bool(jnp.allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), atol=1e-5))
      True
    """
    d = x.shape[-1]
    _check_head_dim(d, "rotary")
    ct = _compute_dtype(x.dtype)
    half = d // 2
    theta = base ** (-jnp.arange(half, dtype=ct) * (2.0 / d))  # [D/2]
    angle = _per_row(positions, ct)[..., None] * theta  # [1 or B, T, D/2]
    cos, sin = jnp.cos(angle)[:, :, None, :], jnp.sin(angle)[:, :, None, :]
    xc = x.astype(ct)
    x1, x2 = xc[..., :half], xc[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class Rotary:
    """Rotary position embedding of queries and keys (a ``qk_transform``).

    Attributes:
      base: the wavelength base (``theta_i = base^(-2i/head_dim)``).

    Call: ``(q [B, T, H, D], k [B, T, Hkv, D], positions int [T] or [B, T]) -> (q,
    k)``, same shapes and dtypes; ``D`` must be even.

    Example (scores depend on relative positions only):
      >>> import jax, jax.numpy as jnp
      >>> from jax_dilated.models import Rotary
      >>> q = k = jnp.ones((1, 1, 1, 8))
      >>> def score(i, j):
      ...     qi, _ = Rotary()(q, k, jnp.array([i]))
      ...     _, kj = Rotary()(q, k, jnp.array([j]))
      ...     return float((qi * kj).sum())
      >>> abs(score(5, 2) - score(13, 10)) < 1e-4
      True
    """

    base: float = 10000.0

    def __post_init__(self):
        validation.check_positive_float("Rotary base", self.base)
        if not self.base > 1:
            raise ValueError(f"Rotary base must be a float > 1, got {self.base!r}.")

    def __call__(self, q: ArrayLike, k: ArrayLike,
                 positions: ArrayLike) -> tuple[Array, Array]:
        return rotate(q, positions, self.base), rotate(k, positions, self.base)


@dataclasses.dataclass(frozen=True)
class XPos:
    """xPos: rotary embedding with a relative exponential decay (a ``qk_transform``).

    Attributes:
      base: rotary wavelength base.
      scale_base: ``B``; the decay of pair ``i`` over a distance ``d`` is
        ``zeta_i^(d/B)``.
      gamma: ``zeta_i = (2i/head_dim + gamma) / (1 + gamma)``.
      center: the position ``c`` where both scales are 1 (cancels in the scores).

    Call: ``(q [B, T, H, D], k [B, T, Hkv, D], positions int [T] or [B, T]) -> (q,
    k)``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax_dilated.models import XPos
      >>> q = k = jax.random.normal(jax.random.key(0), (1, 16, 2, 8))
      >>> q2, k2 = XPos(center=8)(q, k, jnp.arange(16))
      >>> q2.shape, k2.shape
      ((1, 16, 2, 8), (1, 16, 2, 8))
    """

    base: float = 10000.0
    scale_base: float = 512.0
    gamma: float = 0.4
    center: int = 0

    def __post_init__(self):
        Rotary(self.base)
        for name in ("scale_base", "gamma"):
            validation.check_positive_float(f"XPos {name}", getattr(self, name))

    def scales(self, positions: ArrayLike, head_dim: int,
               dtype: DTypeLike = jnp.float32) -> Array:
        """The query scale ``zeta^((n - c)/B)`` [T, head_dim] for positions [T], or
        [B, T, head_dim] for positions [B, T] (keys use its inverse)."""
        _check_head_dim(head_dim, "xPos")
        half = head_dim // 2
        zeta = (jnp.arange(half, dtype=dtype) * (2.0 / head_dim) + self.gamma) \
            / (1.0 + self.gamma)
        power = (jnp.asarray(positions, dtype) - self.center) / self.scale_base
        s = zeta ** power[..., None]
        return jnp.concatenate([s, s], axis=-1)

    def __call__(self, q: ArrayLike, k: ArrayLike,
                 positions: ArrayLike) -> tuple[Array, Array]:
        ct = _compute_dtype(jnp.promote_types(q.dtype, k.dtype))
        s = self.scales(_per_row(positions, ct), q.shape[-1], ct)[:, :, None, :]
        q = (rotate(q, positions, self.base).astype(ct) * s).astype(q.dtype)
        k = (rotate(k, positions, self.base).astype(ct) / s).astype(k.dtype)
        return q, k

