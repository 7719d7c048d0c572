"""Dropout keys of the NNX layers: the ``dropout`` stream a layer keeps and the
``deterministic`` / ``rngs`` resolution of a call, as in ``nnx.Dropout``."""

from __future__ import annotations

import jax
from flax import nnx

__all__ = ["fork_dropout_rngs", "DropoutMixin"]


def fork_dropout_rngs(rngs, rate: float):
    """The dropout stream a module keeps (None without dropout or without rngs)."""
    if rate == 0.0 or rngs is None:
        return nnx.data(None)
    if isinstance(rngs, nnx.Rngs):
        return rngs.dropout.fork()
    if isinstance(rngs, nnx.RngStream):
        return rngs.fork()
    raise TypeError(f"rngs must be an nnx.Rngs, nnx.RngStream or None, got {type(rngs).__name__}.")


def _call_or_own(given, own, missing: str):
    """The value given to the call, else the layer's own; ``ValueError(missing)`` when
    neither is set."""
    value = own if given is None else given
    if value is None:
        raise ValueError(missing)
    return value


class DropoutMixin:
    """``deterministic`` / ``rngs`` resolution as in ``nnx.Dropout``."""

    def _dropout_key(self, rate: float, deterministic, rngs, who: str):
        if rate == 0.0:
            return None
        if _call_or_own(deterministic, self.deterministic,
                        f"{who} has dropout rate {rate}: pass deterministic=True/False to "
                        f"the constructor or the call (or use nnx.view(model, "
                        f"deterministic=...))."):
            return None
        rngs = _call_or_own(rngs, self.rngs,
                            f"{who}: deterministic=False needs random keys: pass rngs= (an "
                            f"nnx.Rngs with a 'dropout' stream) to the constructor or the call.")
        if isinstance(rngs, nnx.Rngs):
            return rngs.dropout()
        if isinstance(rngs, nnx.RngStream):
            return rngs()
        if isinstance(rngs, jax.Array):
            return rngs
        raise TypeError(
            f"rngs must be an nnx.Rngs, nnx.RngStream or a key, got {type(rngs).__name__}.")

    def set_view(self, deterministic: bool | None = None) -> None:
        """Used by ``nnx.view(model, deterministic=...)``."""
        if deterministic is not None:
            self.deterministic = deterministic
