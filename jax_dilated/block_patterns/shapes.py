"""The structured and random patterns: local windows, dilated diagonals, global and
strided blocks, causal, dense, random (see :mod:`jax_dilated.block_patterns`)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jax_dilated.block_patterns.base import (
    BlockPattern,
    _density,
    _nonneg_int,
    _random_rows,
    _rng,
    _row_targets,
    as_pattern,
)


def _grid(nq: int, nk: int):
    return np.arange(nq)[:, None], np.arange(nk)[None, :]


@dataclasses.dataclass(frozen=True)
class LocalWindow(BlockPattern):
    """Key blocks ``i - before <= j <= i + after`` (``after`` defaults to ``before``).

    Example:
      >>> from jax_dilated import block_patterns as bp
      >>> bp.LocalWindow(1, 0).to_mask(4).astype(int)
      array([[1, 0, 0, 0],
             [1, 1, 0, 0],
             [0, 1, 1, 0],
             [0, 0, 1, 1]])
    """

    before: int
    after: int | None = None

    def __post_init__(self):
        _nonneg_int("LocalWindow.before", self.before)
        _nonneg_int("LocalWindow.after", self.after, allow_none=True)

    def _build(self, nq, nk, num_heads):
        i, j = _grid(nq, nk)
        after = self.before if self.after is None else self.after
        return ((j >= i - self.before) & (j <= i + after))[None]


@dataclasses.dataclass(frozen=True)
class Dilated(BlockPattern):
    """Every ``rate``-th block relative to the query block: ``(i - j) mod rate ==
    offset`` and ``|i - j| <= span`` (``span`` None: unlimited).

    Example:
      >>> from jax_dilated import block_patterns as bp
      >>> bp.Dilated(2).to_mask(4).astype(int)
      array([[1, 0, 1, 0],
             [0, 1, 0, 1],
             [1, 0, 1, 0],
             [0, 1, 0, 1]])
    """

    rate: int
    span: int | None = None
    offset: int = 0

    def __post_init__(self):
        _nonneg_int("Dilated.rate", self.rate, positive=True)
        _nonneg_int("Dilated.span", self.span, allow_none=True)
        _nonneg_int("Dilated.offset", self.offset)
        if self.offset >= self.rate:
            raise ValueError(
                f"Dilated.offset must be smaller than rate={self.rate}, got {self.offset}.")

    def _build(self, nq, nk, num_heads):
        i, j = _grid(nq, nk)
        mask = (i - j) % self.rate == self.offset
        if self.span is not None:
            mask &= np.abs(i - j) <= self.span
        return mask[None]


@dataclasses.dataclass(frozen=True)
class GlobalBlocks(BlockPattern):
    """Global blocks: query block ``g`` sees every key block and every query block
    sees key block ``g``, for each ``g`` in ``indices`` (negative counts from the end).

    Example:
      >>> from jax_dilated import block_patterns as bp
      >>> bp.GlobalBlocks([0]).to_mask(3).astype(int)
      array([[1, 1, 1],
             [1, 0, 0],
             [1, 0, 0]])
    """

    indices: tuple[int, ...] = (0,)

    def __init__(self, indices: int | Sequence[int] = (0,)):
        if isinstance(indices, (int, np.integer)) and not isinstance(indices, bool):
            indices = (indices,)
        try:
            idx = tuple(indices)
        except TypeError:
            raise TypeError(
                f"GlobalBlocks.indices must be an int or a sequence of ints, got "
                f"{indices!r}.") from None
        for g in idx:
            if isinstance(g, bool) or not isinstance(g, (int, np.integer)):
                raise TypeError(f"GlobalBlocks.indices must hold ints, got {g!r}.")
        object.__setattr__(self, "indices", tuple(int(g) for g in idx))

    def _build(self, nq, nk, num_heads):
        mask = np.zeros((nq, nk), bool)
        for g in self.indices:
            if not -min(nq, nk) <= g < min(nq, nk):
                raise ValueError(
                    f"GlobalBlocks index {g} is out of range for {nq} query blocks and "
                    f"{nk} key blocks.")
            mask[g, :] = True
            mask[:, g] = True
        return mask[None]


@dataclasses.dataclass(frozen=True)
class Strided(BlockPattern):
    """Fixed columns ``j mod stride == offset`` that every query block sees.

    Example:
      >>> from jax_dilated import block_patterns as bp
      >>> bp.Strided(2).to_mask(2, 4).astype(int)
      array([[1, 0, 1, 0],
             [1, 0, 1, 0]])
    """

    stride: int
    offset: int = 0

    def __post_init__(self):
        _nonneg_int("Strided.stride", self.stride, positive=True)
        _nonneg_int("Strided.offset", self.offset)
        if self.offset >= self.stride:
            raise ValueError(
                f"Strided.offset must be smaller than stride={self.stride}, got "
                f"{self.offset}.")

    def _build(self, nq, nk, num_heads):
        _, j = _grid(nq, nk)
        return np.broadcast_to(j % self.stride == self.offset, (nq, nk))[None]


@dataclasses.dataclass(frozen=True)
class CausalBlocks(BlockPattern):
    """Key blocks at or before the query block: ``j <= i``.

    Example:
      >>> from jax_dilated import block_patterns as bp
      >>> bp.CausalBlocks().to_mask(3).astype(int)
      array([[1, 0, 0],
             [1, 1, 0],
             [1, 1, 1]])
    """

    def _build(self, nq, nk, num_heads):
        i, j = _grid(nq, nk)
        return (j <= i)[None]


@dataclasses.dataclass(frozen=True)
class AllBlocks(BlockPattern):
    """Every block (dense attention).

    Example:
      >>> from jax_dilated import block_patterns as bp
      >>> bool(bp.AllBlocks().to_mask(3).all())
      True
    """

    def _build(self, nq, nk, num_heads):
        return np.ones((1, nq, nk), bool)


@dataclasses.dataclass(frozen=True)
class RandomBlocks(BlockPattern):
    """Random key blocks per query block.

    Give ``density`` (or ``sparsity_ratio = 1 - density``): row ``i`` gets exactly
    ``round(density * c_i)`` blocks out of its ``c_i`` candidates (all key blocks, or
    those of ``within``); or ``num_blocks``: that many per row (fewer if a row has
    fewer candidates). ``per_head``: an independent draw for every head. The draw is
    a function of ``seed``, the mask shape and the head.

    Example:
      >>> from jax_dilated import block_patterns as bp
      >>> bp.RandomBlocks(0.25, seed=0).to_mask(8).sum(axis=1).tolist()   # 2 of 8 per row
      [2, 2, 2, 2, 2, 2, 2, 2]
    """

    density: float | None = None
    num_blocks: int | None = None
    seed: int = 0
    per_head: bool = False
    within: BlockPattern | None = None

    def __init__(self, density: float | None = None, *, num_blocks: int | None = None,
                 sparsity_ratio: float | None = None, seed: int = 0, per_head: bool = False,
                 within: BlockPattern | None = None):
        if num_blocks is not None:
            if density is not None or sparsity_ratio is not None:
                raise ValueError(
                    f"RandomBlocks: give one of density, sparsity_ratio and num_blocks, got "
                    f"density={density!r}, sparsity_ratio={sparsity_ratio!r}, "
                    f"num_blocks={num_blocks!r}.")
            _nonneg_int("RandomBlocks.num_blocks", num_blocks)
            dens = None
        else:
            dens = _density(density, sparsity_ratio, "RandomBlocks")
        if not isinstance(per_head, bool):
            raise TypeError(f"RandomBlocks.per_head must be a bool, got {per_head!r}.")
        object.__setattr__(self, "density", dens)
        object.__setattr__(self, "num_blocks", None if num_blocks is None else int(num_blocks))
        object.__setattr__(self, "seed", _nonneg_int("RandomBlocks.seed", seed))
        object.__setattr__(self, "per_head", per_head)
        object.__setattr__(self, "within", None if within is None else as_pattern(within))
        if self.within is not None and self.within.per_head and not per_head:
            object.__setattr__(self, "per_head", True)

    def _build(self, nq, nk, num_heads):
        heads = num_heads if self.per_head else 1
        cands = (np.ones((1, nq, nk), bool) if self.within is None
                 else self.within._build(nq, nk, num_heads))
        out = np.zeros((heads, nq, nk), bool)
        for h in range(heads):
            cand = cands[min(h, cands.shape[0] - 1)]
            targets = _row_targets(cand, self.density, self.num_blocks)
            out[h] = _random_rows(_rng(self.seed, nq, nk, h), cand, np.zeros_like(cand),
                                  targets)
        return out
