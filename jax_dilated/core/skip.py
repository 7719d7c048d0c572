"""Compute or skip: the one ``lax.cond`` every skippable piece of work goes through
(ring steps, block-sparse head classes, kernel blocks)."""

from __future__ import annotations

import jax

__all__ = ["maybe_skip"]


def maybe_skip(pred, compute, operand, skip=None):
    """``compute(operand)`` where ``pred`` holds, else ``skip(operand)``.

    ``pred``: None or True (statically needed: ``compute`` is traced alone, no
    conditional), False (statically not needed: ``skip`` alone), or a traced bool
    scalar (``lax.cond``). ``skip`` defaults to the identity, for ``operand`` an
    accumulator that a skipped step leaves unchanged; it must return what
    ``compute`` returns (same shapes and dtypes).
    """
    skip = (lambda x: x) if skip is None else skip
    if pred is None or pred is True:
        return compute(operand)
    if pred is False:
        return skip(operand)
    return jax.lax.cond(pred, compute, skip, operand)
