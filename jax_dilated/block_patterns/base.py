"""The pattern algebra: :class:`BlockPattern`, explicit masks, union, intersection
and density top-up (see :mod:`jax_dilated.block_patterns`)."""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import numpy as np
import numpy.typing as npt

from jax_dilated.core import validation


def _nonneg_int(name: str, value, *, positive: bool = False, allow_none: bool = False):
    """The library's integer checks (core.validation), with None allowed where a
    pattern reads it as "unbounded"."""
    if value is None and allow_none:
        return None
    check = validation.check_positive_int if positive else validation.check_nonnegative_int
    return check(name, value)


def _density(density, sparsity_ratio, what: str) -> float:
    if (density is None) == (sparsity_ratio is None):
        raise ValueError(
            f"{what}: give exactly one of density and sparsity_ratio, got "
            f"density={density!r}, sparsity_ratio={sparsity_ratio!r}.")
    name, value = (("density", density) if density is not None
                   else ("sparsity_ratio", sparsity_ratio))
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)):
        raise TypeError(f"{what}: {name} must be a float in [0, 1], got {value!r}.")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{what}: {name} must be in [0, 1], got {value!r}.")
    return float(value) if density is not None else 1.0 - float(value)


def _rng(seed: int, *salt) -> np.random.Generator:
    """Generator determined by the seed and the mask geometry (and head)."""
    return np.random.default_rng([seed, *(int(s) for s in salt)])


class BlockPattern:
    """Base class of block-sparsity patterns.

    Subclasses implement ``_build(nq, nk, num_heads) -> bool [1 or num_heads, nq, nk]``
    (``num_heads`` is None when no head count was given; per-head parts then raise).

    Example:
      >>> from jax_dilated import block_patterns as bp
      >>> p = (bp.LocalWindow(0) | bp.GlobalBlocks([0])) & bp.CausalBlocks()
      >>> p.to_mask(4).astype(int)
      array([[1, 0, 0, 0],
             [1, 1, 0, 0],
             [1, 0, 1, 0],
             [1, 0, 0, 1]])
    """

    per_head: bool = False
    # ``mask_array | pattern``: make NumPy defer to __ror__ instead of broadcasting
    __array_ufunc__ = None

    def _build(self, nq: int, nk: int, num_heads: int | None) -> np.ndarray:
        raise NotImplementedError

    def to_mask(self, num_q_blocks: int, num_k_blocks: int | None = None,
                num_heads: int | None = None) -> np.ndarray:
        """The block mask: bool ``[num_q_blocks, num_k_blocks]`` or, when ``num_heads``
        is given, ``[num_heads, num_q_blocks, num_k_blocks]`` (a shared pattern is
        repeated). ``num_k_blocks`` defaults to ``num_q_blocks``.
        """
        nq = _nonneg_int("num_q_blocks", num_q_blocks, positive=True)
        nk = nq if num_k_blocks is None else _nonneg_int("num_k_blocks", num_k_blocks,
                                                        positive=True)
        h = _nonneg_int("num_heads", num_heads, positive=True, allow_none=True)
        if h is None and self.per_head:
            raise ValueError(
                f"{self!r} differs per head: to_mask needs num_heads to build it.")
        mask = np.asarray(self._build(nq, nk, h), dtype=bool)
        assert mask.ndim == 3 and mask.shape[1:] == (nq, nk), mask.shape
        if h is None:
            return mask[0].copy()
        return np.broadcast_to(mask, (h, nq, nk)).copy()

    def realised_density(self, num_q_blocks: int, num_k_blocks: int | None = None,
                num_heads: int | None = None, *, within: "BlockPattern | None" = None
                ) -> float:
        """Fraction of blocks that are active (among the blocks of ``within``)."""
        mask = self.to_mask(num_q_blocks, num_k_blocks, num_heads)
        if within is None:
            return float(mask.mean())
        support = np.broadcast_to(as_pattern(within).to_mask(num_q_blocks, num_k_blocks,
                                                             num_heads), mask.shape)
        return float((mask & support).sum() / max(support.sum(), 1))

    def with_density(self, density: float | None = None, *,
                     sparsity_ratio: float | None = None, seed: int = 0,
                     within: "BlockPattern | None" = None, per_head: bool = False
                     ) -> "TopUp":
        """This pattern topped up with random blocks to ``density`` (module docstring)."""
        return TopUp(self, _density(density, sparsity_ratio, "with_density"), seed=seed,
                     within=None if within is None else as_pattern(within),
                     per_head=per_head)

    def __or__(self, other: BlockPattern | np.ndarray) -> Union:
        return Union((self, as_pattern(other)))

    def __ror__(self, other: BlockPattern | np.ndarray) -> Union:
        return Union((as_pattern(other), self))

    def __and__(self, other: BlockPattern | np.ndarray) -> Intersection:
        return Intersection((self, as_pattern(other)))

    def __rand__(self, other: BlockPattern | np.ndarray) -> Intersection:
        return Intersection((as_pattern(other), self))

    def draw(self, num_q_blocks: int = 16, num_k_blocks: int | None = None, *,
             num_heads: int | None = None, head: int = 0, ax: Any = None,
             title: str | None = None) -> Any:
        """Plot the mask (query blocks down, key blocks across) with matplotlib.

        Per-head patterns draw head ``head`` of ``num_heads`` (default ``head + 1``).
        Returns the matplotlib ``Axes``.
        """
        import matplotlib.pyplot as plt  # lazily: matplotlib is optional

        if self.per_head:
            num_heads = head + 1 if num_heads is None else num_heads
        mask = self.to_mask(num_q_blocks, num_k_blocks, num_heads)
        if mask.ndim == 3:
            mask = mask[head]
        if ax is None:
            _, ax = plt.subplots(figsize=(4, 4 * mask.shape[0] / mask.shape[1]))
        ax.imshow(mask, cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
        ax.set_xticks(np.arange(-0.5, mask.shape[1], 1), minor=True)
        ax.set_yticks(np.arange(-0.5, mask.shape[0], 1), minor=True)
        ax.grid(which="minor", color="0.8", linewidth=0.5)
        ax.tick_params(which="minor", length=0)
        ax.set_xlabel("key block")
        ax.set_ylabel("query block")
        ax.set_title(title if title is not None else
                     f"{self!r}\ndensity {mask.mean():.3f}", fontsize=8)
        return ax


def as_pattern(pattern: BlockPattern | np.ndarray) -> BlockPattern:
    """A :class:`BlockPattern` from a pattern or a (NumPy) bool mask.

    Example:
      >>> import numpy as np
      >>> from jax_dilated import block_patterns as bp
      >>> type(bp.as_pattern(np.ones((2, 2), bool))).__name__
      'MaskPattern'
    """
    if isinstance(pattern, BlockPattern):
        return pattern
    if isinstance(pattern, np.ndarray):
        return MaskPattern(pattern)
    raise TypeError(
        f"pattern must be a BlockPattern or a bool NumPy array [q_blocks, k_blocks] or "
        f"[heads, q_blocks, k_blocks], got {type(pattern).__name__}.")


def _random_rows(rng, candidates: np.ndarray, base: np.ndarray, targets: np.ndarray):
    """Per row, ``base`` plus random candidates until ``targets`` blocks are active."""
    out = base.copy()
    for i in range(candidates.shape[0]):
        free = np.flatnonzero(candidates[i] & ~base[i])
        need = int(targets[i]) - int((base[i] & candidates[i]).sum())
        if need > 0 and free.size:
            out[i, rng.choice(free, size=min(need, free.size), replace=False)] = True
    return out


def _row_targets(candidates: np.ndarray, density: float | None, num_blocks: int | None):
    counts = candidates.sum(axis=-1)
    if num_blocks is not None:
        return np.minimum(counts, num_blocks)
    # round half up, so that density 0.5 of 3 candidates gives 2, not banker's 2/1
    return np.minimum(counts, np.floor(density * counts + 0.5).astype(int))


@dataclasses.dataclass(frozen=True)
class TopUp(BlockPattern):
    """``base`` plus random blocks until every row holds ``round(density * c_i)`` of its
    ``c_i`` candidates (all key blocks, or those of ``within``); see the module
    docstring. Made by :meth:`BlockPattern.with_density`.

    Example:
      >>> from jax_dilated import block_patterns as bp
      >>> p = bp.LocalWindow(0).with_density(0.5, seed=0)       # the diagonal, topped up
      >>> m = p.to_mask(8); bool(m.diagonal().all()), m.sum(axis=1).tolist()
      (True, [4, 4, 4, 4, 4, 4, 4, 4])
    """

    base: BlockPattern
    density: float
    seed: int = 0
    within: BlockPattern | None = None
    per_head: bool = False

    def __post_init__(self):
        object.__setattr__(self, "per_head", bool(
            self.per_head or self.base.per_head
            or (self.within is not None and self.within.per_head)))

    def _build(self, nq, nk, num_heads):
        base = self.base._build(nq, nk, num_heads)
        cands = (np.ones((1, nq, nk), bool) if self.within is None
                 else self.within._build(nq, nk, num_heads))
        heads = num_heads if self.per_head else 1
        out = np.zeros((heads, nq, nk), bool)
        for h in range(heads):
            b = base[min(h, base.shape[0] - 1)]
            cand = cands[min(h, cands.shape[0] - 1)]
            out[h] = _random_rows(_rng(self.seed, nq, nk, h), cand, b,
                                  _row_targets(cand, self.density, None))
        return out


@dataclasses.dataclass(frozen=True)
class _Combination(BlockPattern):
    """Parts combined block by block with ``_op`` (:class:`Union`: any part,
    :class:`Intersection`: every part); a part that is itself a combination of the same
    kind is flattened into its parts."""

    parts: tuple[BlockPattern, ...]
    _op = None  # the subclass's: np.logical_or or np.logical_and

    def __post_init__(self):
        flat = []
        for p in self.parts:
            flat.extend(p.parts if isinstance(p, type(self)) else (as_pattern(p),))
        object.__setattr__(self, "parts", tuple(flat))

    @property
    def per_head(self):
        return any(p.per_head for p in self.parts)

    def _build(self, nq, nk, num_heads):
        masks = [p._build(nq, nk, num_heads) for p in self.parts]
        heads = max(m.shape[0] for m in masks)
        out = np.broadcast_to(masks[0], (heads, nq, nk)).copy()
        for m in masks[1:]:
            out = self._op(out, m)
        return out


@dataclasses.dataclass(frozen=True)
class Union(_Combination):
    """Blocks active in any part (``a | b``).

    Example:
      >>> from jax_dilated import block_patterns as bp
      >>> (bp.LocalWindow(0) | bp.Strided(4)).to_mask(3).astype(int)
      array([[1, 0, 0],
             [1, 1, 0],
             [1, 0, 1]])
    """

    _op = np.logical_or

    def __repr__(self):
        return " | ".join(repr(p) for p in self.parts)


@dataclasses.dataclass(frozen=True)
class Intersection(_Combination):
    """Blocks active in every part (``a & b``).

    Example:
      >>> from jax_dilated import block_patterns as bp
      >>> (bp.LocalWindow(1) & bp.CausalBlocks()).to_mask(3).astype(int)
      array([[1, 0, 0],
             [1, 1, 0],
             [0, 1, 1]])
    """

    _op = np.logical_and

    def __repr__(self):
        return " & ".join(f"({p!r})" if isinstance(p, Union) else repr(p)
                          for p in self.parts)


class MaskPattern(BlockPattern):
    """An explicit bool mask ``[q_blocks, k_blocks]`` (shared) or
    ``[heads, q_blocks, k_blocks]`` (per head); its shape must match the call's.

    Example:
      >>> import numpy as np
      >>> from jax_dilated import block_patterns as bp
      >>> bp.MaskPattern(np.eye(2, dtype=bool)).to_mask(2).astype(int)
      array([[1, 0],
             [0, 1]])
    """

    def __init__(self, mask: npt.ArrayLike):
        arr = np.asarray(mask)
        if arr.dtype != np.bool_:
            raise TypeError(f"a block mask must be a bool array, got dtype {arr.dtype}.")
        if arr.ndim not in (2, 3):
            raise ValueError(
                f"a block mask must have shape [q_blocks, k_blocks] or [heads, q_blocks, "
                f"k_blocks], got shape {arr.shape}.")
        self.mask = arr.copy()
        self.mask.flags.writeable = False
        self._key = (arr.shape, zlib.crc32(np.packbits(arr).tobytes()))

    @property
    def per_head(self):
        return self.mask.ndim == 3

    def _build(self, nq, nk, num_heads):
        m = self.mask if self.mask.ndim == 3 else self.mask[None]
        if m.shape[1:] != (nq, nk) or (m.ndim == 3 and self.per_head and num_heads is not None
                                       and m.shape[0] != num_heads):
            want = (nq, nk) if not self.per_head else (num_heads, nq, nk)
            raise ValueError(
                f"block mask has shape {self.mask.shape} but the call has {nq} query blocks "
                f"and {nk} key blocks (and {num_heads} heads): expected shape {want}.")
        return m

    def __eq__(self, other):
        return (isinstance(other, MaskPattern) and self._key == other._key
                and np.array_equal(self.mask, other.mask))

    def __hash__(self):
        return hash(self._key)

    def __repr__(self):
        return f"MaskPattern(shape={self.mask.shape}, density={self.mask.mean():.3f})"
