"""Segment / dilation index arithmetic for dilated attention (docs/semantics.md, section 2).

Everything here is static (Python ints and NumPy), computed once at trace time.

A *branch* is one (segment length ``w``, dilation rate ``r``) pair. With offset
``o``, position ``p`` is selected when ``(p mod w) mod r == o``; selected
positions of the same segment attend to each other. Cutting the sequence into
segments of ``w`` and every segment into ``w / r`` rows of ``r`` columns, the
selected positions of offset ``o`` are column ``o``: a dense *dilated segment*
of ``w / r`` tokens, in increasing position order (so causality inside it is
plain lower-triangular).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, get_args

import numpy as np

from jax_dilated.core.branches import SlidingWindow, is_window
from jax_dilated.core.types import HeadOffsets, Mode

__all__ = [
    "Branch",
    "validate_branches",
    "check_mode",
    "head_offsets",
    "head_groups",
    "BranchPlan",
    "plan_branches",
    "kv_head_plan",
    "nested_order",
]

MODES = get_args(Mode)  # ("longnet", "head_groups", "torchscale")
HEAD_OFFSETS = get_args(HeadOffsets)  # ("modulo", "blocked")


@dataclasses.dataclass(frozen=True)
class Branch:
    """One (segment length, dilation rate) pair, resolved for a sequence length.

    segment_length: ``w`` as the user gave it.
    rate: ``r``.
    effective_length: the segment length used for cutting a sequence of ``seq_len``
      tokens: ``w`` when ``w < seq_len``; otherwise the whole sequence is one
      segment, and the smallest multiple of ``r`` that holds it selects the same
      positions (``p mod w = p`` for ``p < seq_len``) without padding up to ``w``.
    window: a :class:`~jax_dilated.core.branches.SlidingWindow` for a sliding-window
      branch (then the whole sequence is one segment at rate 1, and the kernel's
      window, not the segment grid, says which keys a query sees), else None.
    """

    segment_length: int
    rate: int
    effective_length: int
    window: SlidingWindow | None = None

    @property
    def padded_length(self) -> int:
        """``effective_length`` rounded up to a multiple of ``rate``: a segment laid out
        as rows of ``rate`` columns, its last row completed by positions that do not
        exist (invalid keys, dropped queries) when the rate does not divide it."""
        return -(-self.effective_length // self.rate) * self.rate

    @property
    def dilated_length(self) -> int:
        """Slots of one dilated segment: ``ceil(effective_length / rate)``, the
        selected positions of offset 0 (offset ``o`` selects ``ceil((w - o) / r)``)."""
        return self.padded_length // self.rate

    def num_segments(self, seq_len: int) -> int:
        return -(-seq_len // self.effective_length)


def _check_int_list(name: str, values, shown=None) -> tuple[int, ...]:
    """``values`` as positive ints (errors quote ``shown``, default ``values``)."""
    shown = values if shown is None else shown
    if isinstance(values, (int, np.integer)) or not isinstance(values, Sequence):
        raise TypeError(
            f"{name} must be a list or tuple of positive ints, got {shown!r} "
            f"of type {type(values).__name__}."
        )
    if len(values) == 0:
        raise ValueError(f"{name} must not be empty, got {shown!r}.")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            also = " or jax_dilated.SlidingWindow entries" if name == "segment_lengths" else ""
            raise TypeError(f"{name} must hold ints{also}, got {shown!r} (element {v!r}).")
        if v <= 0:
            raise ValueError(f"{name} must hold positive ints, got {shown!r}.")
        out.append(int(v))
    return tuple(out)


def validate_branches(segment_lengths, dilation_rates) -> tuple[tuple[int, int], ...]:
    """Check a branch configuration and return it as ``((w_0, r_0), ...)``.

    An entry of ``segment_lengths`` may be a
    :class:`~jax_dilated.core.branches.SlidingWindow` (a sliding-window branch); it is
    returned as is, and its dilation rate must be 1.

    Any positive segment length goes with any positive rate: a segment of ``w``
    tokens selects ``ceil((w - o) / r)`` of them at offset ``o``.

    Raises:
      TypeError / ValueError naming the argument when the lists are not lists of
      positive ints or differ in length.
    """
    if isinstance(segment_lengths, (list, tuple)):
        windows = {i: w for i, w in enumerate(segment_lengths) if is_window(w)}
    else:
        windows = {}
    ws = list(_check_int_list("segment_lengths", [1 if i in windows else w for i, w in
                                                  enumerate(segment_lengths)]
                              if windows else segment_lengths, segment_lengths))
    rs = _check_int_list("dilation_rates", dilation_rates)
    if len(ws) != len(rs):
        raise ValueError(
            "segment_lengths and dilation_rates must have the same length, got "
            f"segment_lengths={list(segment_lengths)} (len {len(ws)}) and "
            f"dilation_rates={list(rs)} (len {len(rs)})."
        )
    for i, window in windows.items():
        if rs[i] != 1:
            raise ValueError(
                f"a sliding-window branch runs at dilation rate 1, got {window!r} "
                f"(segment_lengths[{i}]) with dilation_rates[{i}]={rs[i]} "
                f"(dilation_rates={list(rs)}).")
        ws[i] = window
    return tuple(zip(ws, rs))


def resolve_branch(segment_length: int, rate: int, seq_len: int) -> Branch:
    """The :class:`Branch` for ``(w, r)`` on a sequence of ``seq_len`` tokens (a
    sliding window: one segment of the whole sequence at rate 1, carrying the window)."""
    if is_window(segment_length):
        return Branch(seq_len, 1, seq_len, window=segment_length)
    if segment_length < seq_len:
        eff = segment_length
    else:
        eff = min(segment_length, -(-seq_len // rate) * rate)
    return Branch(segment_length, rate, eff)


def head_offsets(num_heads: int, rate: int, rule: HeadOffsets) -> np.ndarray:
    """Offset of every head for a branch of dilation ``rate`` (longnet mode).

    ``"modulo"``:  ``o(j) = j mod r`` (LongNet Eq. 13).
    ``"blocked"``: ``o(j) = floor(j / ceil(H / r))`` (contiguous head blocks).

    Returns int array [num_heads].
    """
    j = np.arange(num_heads)
    if rule == "modulo":
        return j % rate
    if rule == "blocked":
        return j // -(-num_heads // rate)
    raise ValueError(f"head_offsets must be one of {HEAD_OFFSETS}, got {rule!r}.")


def head_groups(num_heads: int, num_groups: int) -> list[tuple[int, int]]:
    """Contiguous head groups ``[(start, stop), ...]`` for mode ``"head_groups"``.

    Group sizes are ``H // G``, the first ``H % G`` groups one larger.
    """
    if num_heads < num_groups:
        raise ValueError(
            f'mode="head_groups" needs at least as many heads as branches, got '
            f"num_heads={num_heads} with {num_groups} branches (segment_lengths)."
        )
    base, extra = divmod(num_heads, num_groups)
    bounds, start = [], 0
    for g in range(num_groups):
        size = base + (1 if g < extra else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


def kv_head_plan(query_heads: np.ndarray, offsets: np.ndarray, num_heads: int,
                 num_kv_heads: int) -> tuple[np.ndarray, np.ndarray, int]:
    """How to gather dilated keys/values for a set of query heads.

    Query head ``j`` reads kv head ``j // (H / H_kv)`` at its own offset. Heads
    that read the same (offset, kv head) pair in contiguous runs of equal length
    share one gathered kv head, so the kernel runs grouped-query attention on the
    compact heads instead of repeating them.

    Args:
      query_heads: [Hq] indices of the query heads (in output order).
      offsets: [Hq] offset of each of those heads.
      num_heads, num_kv_heads: H and H_kv.

    Returns:
      ``(kv_offsets, kv_heads, group)``: the offset and kv-head index of each of
      the ``Hq / group`` gathered kv heads; query head ``query_heads[i]`` reads
      gathered kv head ``i // group``.
    """
    rep = num_heads // num_kv_heads
    pairs = [(int(o), int(j) // rep) for j, o in zip(query_heads, offsets)]
    hq = len(pairs)
    for group in sorted((g for g in range(1, hq + 1) if hq % g == 0), reverse=True):
        blocks = [pairs[i:i + group] for i in range(0, hq, group)]
        if all(len(set(b)) == 1 for b in blocks):
            chosen = [b[0] for b in blocks]
            return (np.array([c[0] for c in chosen]), np.array([c[1] for c in chosen]),
                    group)
    raise AssertionError("unreachable: group 1 always works")  # pragma: no cover


@dataclasses.dataclass(frozen=True)
class BranchPlan:
    """Static plan for one branch of one call.

    branch: the resolved (w, r).
    query_heads: [Hq] query heads that run this branch (all heads in longnet mode,
      one contiguous group in head_groups mode).
    offsets: [Hq] the offset of each of those heads.
    kv_offsets, kv_heads, kv_group: see :func:`kv_head_plan`.
    """

    branch: Branch
    query_heads: np.ndarray
    offsets: np.ndarray
    kv_offsets: np.ndarray
    kv_heads: np.ndarray
    kv_group: int


def check_mode(mode, head_offsets) -> None:
    """``mode`` one of :data:`MODES` and ``head_offsets`` one of :data:`HEAD_OFFSETS`
    (a ``ValueError`` naming the argument otherwise)."""
    for name, value, choices in (("mode", mode, MODES),
                                 ("head_offsets", head_offsets, HEAD_OFFSETS)):
        if value not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {value!r}.")


def plan_branches(branches, *, seq_len: int, num_heads: int, num_kv_heads: int,
                  mode: Mode, offsets_rule: HeadOffsets) -> list[BranchPlan]:
    """Static plan of every branch for ``mode`` (see docs/semantics.md, section 2).
    ``"torchscale"`` plans as ``"longnet"`` (every head every branch): the plans of
    its branches on the unpadded sequence, which the cost model prices (it runs each
    branch on its padded sequence: :mod:`jax_dilated.ops.dilated_torchscale`)."""
    # mode and offsets_rule were checked with the call (check_mode)
    plans = []
    if mode in ("longnet", "torchscale"):
        heads_of = [np.arange(num_heads)] * len(branches)
        offsets_of = [head_offsets(num_heads, r, offsets_rule) for _, r in branches]
    else:
        bounds = head_groups(num_heads, len(branches))
        heads_of = [np.arange(a, b) for a, b in bounds]
        offsets_of = [np.full(b - a, i % r) for i, ((a, b), (_, r)) in
                      enumerate(zip(bounds, branches))]
    for (w, r), heads, offs in zip(branches, heads_of, offsets_of):
        kv_offs, kv_heads, group = kv_head_plan(heads, offs, num_heads, num_kv_heads)
        plans.append(BranchPlan(resolve_branch(w, r, seq_len), heads, offs, kv_offs,
                                kv_heads, group))
    return plans


def nested_order(plans: Sequence[BranchPlan], seq_len: int) -> list[int] | None:
    """The order, finest first, in which longnet's branches nest, or None.

    Branches nest when, sorted by (effective segment length, rate), each one's
    segments lie inside the next one's (the next length is a multiple, or one segment
    holds the whole sequence), each rate divides the next and every query head's
    offsets agree (``o_next(j) mod r == o(j)``). Then a position the next branch
    selects is selected by this one, so a pair (p, t) that two branches let attend
    is let by every branch between them: each pair can be computed once, by the
    finest branch that has it, weighted ``m(p, t) exp(s)`` (docs/semantics.md,
    section 7, "shared pairs"). ``"modulo"`` offsets with rates that divide one
    another (LongNet's geometric branches) nest; ``"blocked"`` ones in general do not.

    Returns:
      Indices into ``plans``, finest first, when there are at least two branches
      that all serve the same query heads (longnet) and nest; else None.
    """
    if len(plans) < 2 or any(p.branch.window is not None for p in plans):
        return None
    heads = plans[0].query_heads
    if any(not np.array_equal(p.query_heads, heads) for p in plans):
        return None
    order = sorted(range(len(plans)), key=lambda i: (plans[i].branch.effective_length,
                                                     plans[i].branch.rate))
    for f, c in zip(order, order[1:]):
        fine, coarse = plans[f], plans[c]
        w_f, r_f = fine.branch.effective_length, fine.branch.rate
        inside = (coarse.branch.effective_length % w_f == 0
                  or coarse.branch.num_segments(seq_len) == 1)
        # a rate that does not divide its segment shifts the next segment's columns
        inside &= (w_f % r_f == 0
                   and coarse.branch.effective_length % coarse.branch.rate == 0)
        if (not inside or coarse.branch.rate % r_f
                or np.any(np.asarray(coarse.offsets) % r_f != np.asarray(fine.offsets))):
            return None
    return order
