"""Device-variance typing inside ``jax.shard_map(..., check_vma=True)``.

Under ``check_vma`` every value carries the set of mesh axes it varies over; a
loop carry or ``cond`` branch that starts from a constant (not varying) while the
loop body makes it varying is a type error. :func:`varying_like` lifts such
constants to the variance of a reference input. Outside ``shard_map`` it is the
identity.
"""

from __future__ import annotations

import jax

__all__ = ["varying_like"]


def _varying_axes(x) -> frozenset:
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax 0.10 - 0.12
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))  # older/newer spelling


def varying_like(x, like):
    """``x`` (a pytree) cast to vary over every mesh axis that any leaf of ``like`` varies over."""
    want = frozenset().union(*(_varying_axes(leaf) for leaf in jax.tree.leaves(like)))
    if not want:
        return x

    def cast(leaf):
        missing = want - _varying_axes(leaf)
        if not missing:
            return leaf
        return jax.lax.pcast(leaf, tuple(sorted(missing)), to="varying")

    return jax.tree.map(cast, x)
