"""Branch kinds of dilated attention beyond ``(segment length, rate)`` pairs.

:class:`SlidingWindow` is an entry of ``segment_lengths`` (with rate 1) that makes a
*sliding-window branch*: its heads attend, on the whole sequence (no segment grid), to
the keys ``t`` with ``p - left <= t <= p + right`` (docs/semantics.md, section 2,
"Sliding-window branches, soft-capping and sinks").
"""

from __future__ import annotations

import dataclasses

from jax_dilated.core import validation

__all__ = ["SlidingWindow", "is_window"]


@dataclasses.dataclass(frozen=True)
class SlidingWindow:
    """A sliding-window branch, usable as an entry of ``segment_lengths`` (its entry of
    ``dilation_rates`` must be 1).

    The heads of the branch (all heads in ``mode="longnet"``, its head group in
    ``mode="head_groups"``) attend to the keys ``t`` with ``p - left <= t <= p +
    right`` (and causal, ``kv_mask``, ``segment_ids``), over the whole sequence;
    its ``(O, LSE)`` mixes with the other branches like any branch's.

    left: keys before the query (``>= 0``).
    right: keys after the query (``>= 0``), or None: 0 with ``is_causal=True``,
      ``left`` (symmetric) otherwise. An explicit ``right > 0`` with causal attention
      is a ``ValueError`` at call time.

    Example:
      >>> import jax_dilated as jd
      >>> jd.SlidingWindow(64).resolve(is_causal=True), jd.SlidingWindow(64).resolve(False)
      ((64, 0), (64, 64))
    """

    left: int
    right: int | None = None

    def __post_init__(self):
        check = validation.check_nonnegative_int
        object.__setattr__(self, "left", check("SlidingWindow left", self.left))
        if self.right is not None:
            object.__setattr__(self, "right", check("SlidingWindow right", self.right))

    def resolve(self, is_causal: bool) -> tuple[int, int]:
        """``(left, right)`` for a call with this causality (``ValueError`` for an
        explicit ``right > 0`` with ``is_causal``)."""
        if self.right is None:
            return (self.left, 0 if is_causal else self.left)
        if is_causal and self.right > 0:
            raise ValueError(
                f"{self!r} has right={self.right} > 0 with is_causal=True: causal attention "
                f"sees no later key; write SlidingWindow({self.left}) or "
                f"SlidingWindow({self.left}, 0).")
        return (self.left, self.right)


def is_window(entry) -> bool:
    """Whether a ``segment_lengths`` entry is a :class:`SlidingWindow`."""
    return isinstance(entry, SlidingWindow)
